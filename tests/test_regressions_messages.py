"""Regression tests for the Python API's error messages: each names the problem in plain words
(no attrs/typing objects), with the valid choices and, for a near miss, a did-you-mean. Each
test's docstring names the bug it catches."""

from __future__ import annotations

import pytest

import kvcompress
from kvcompress import ConfigError, build_method, make_prompt_cache

COMPOSED = {"scorer": "h2o", "selector": "lowest", "disposition": "drop"}


def _error(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kw)
    return str(info.value)


@pytest.mark.parametrize("method, n_layers", [("h2o", 2), ("cam", 2), ("snapkv", 2), ("streaming_llm", 2),
                                              ("adakv", 2), ("chunkkv", 2)])
def test_the_minimum_budget_hint_is_the_smallest_budget_that_builds(model, method, n_layers):
    """Bug: h2o with budget=1 said "use a budget > 4", but 5..8 failed too: the protected recent
    window grows with the budget (recent_ratio), so the real minimum is 9."""
    msg = _error(make_prompt_cache, model, method, budget=1)
    least = int(msg.split("the smallest budget that builds is ")[1].split(",")[0])
    make_prompt_cache(model, method, budget=least)
    assert "leaves no room to evict" in _error(make_prompt_cache, model, method, budget=least - 1)
    if method == "h2o":
        assert least == 9


def test_config_validate_names_the_smallest_budget(tmp_path, capsys):
    from kvcompress.cli import main

    path = tmp_path / "c.toml"
    path.write_text('method = "h2o"\n[params]\nbudget = 5\n')
    assert main(["config", "validate", str(path)]) == 2
    assert "the smallest budget that builds is 9" in capsys.readouterr().err


def test_a_validator_error_is_a_sentence_not_an_attrs_object():
    """Bug: kivi bits=3 printed the attrs ``Attribute(...)`` and validator objects."""
    msg = _error(build_method, "kivi", budget=32, bits=3)
    assert "bits must be one of 2, 4, 8, got 3" in msg and "Attribute(" not in msg and "validator" not in msg


def test_a_bad_method_type_in_a_config_is_a_sentence():
    """Bug: ``method = 5`` in a config leaked the attrs field description."""
    msg = _error(kvcompress.load_config, {"method": 5})
    assert msg == "invalid method config: method must be a str, got 5 (int)"


def test_a_bad_choice_lists_the_choices_with_a_did_you_mean():
    """Bug: ``merge=meen`` said "meen not in literal typing.Literal[...]"."""
    msg = _error(build_method, "cam", merge="meen")
    assert "merge: 'meen' is not one of 'sim_weighted', 'mean', 'drop'; did you mean 'mean'?" in msg
    assert "typing" not in msg and "Literal" not in msg


@pytest.mark.parametrize("call", [
    lambda: build_method("cam", n_sinks=4),
    lambda: build_method({"method": "h2o", "selector": {"name": "lowest", "n_sinks": 3}}),
])
def test_a_misspelt_parameter_gets_a_did_you_mean(call):
    """Bug: ``--param n_sinks=4`` listed the valid parameters but did not suggest ``n_sink``."""
    with pytest.raises(ConfigError, match="did you mean 'n_sink'"):
        call()


@pytest.mark.parametrize("method", ["cam", "h2o"])
def test_an_explicit_method_with_a_config_is_refused(model, method):
    """Bug: ``make_prompt_cache(model, "cam", config=...)`` silently ignored "cam" (it is also
    the default), while any other method was refused."""
    config = {**COMPOSED, "budget": "uniform", "params": {"budget": 32}}
    msg = _error(make_prompt_cache, model, method, config=config)
    assert msg.startswith("give either a method or config=..., not both")
    assert make_prompt_cache(model, config=config)[0].method.name == "custom"
    assert make_prompt_cache(model, None, config=config)[0].method.name == "custom"
    with pytest.raises(ConfigError, match="not both"):
        kvcompress.attach(model, method, config=config)


def test_a_composition_with_only_a_budget_size_says_to_name_the_budget(model):
    """Bug: a composition with ``budget=32`` said "missing ['budget']"."""
    msg = _error(make_prompt_cache, model, None, **COMPOSED, budget=32)
    assert "names its budget component too: budget=32 is only a size" in msg
    assert "budget={'name': 'uniform', 'budget': 32}" in msg
    make_prompt_cache(model, None, **COMPOSED, budget={"name": "uniform", "budget": 32})


def test_a_budget_size_given_as_a_string_says_it_must_be_an_int():
    """Bug: ``budget="32"`` said "unknown budget '32'"."""
    msg = _error(build_method, "h2o", budget="32")
    assert msg.startswith("budget '32' is a string; the budget size must be an int (budget=32)")


# ------------------------------------------------------------------------------------------
# Docs that said something the code did not do
# ------------------------------------------------------------------------------------------


def test_a_component_table_without_a_name_changes_only_the_methods_parameters(tmp_path):
    """Bug: docs/cli.md said a ``[disposition]`` table may override only its parameters, but a
    table without ``name`` was rejected."""
    path = tmp_path / "c.toml"
    path.write_text('method = "cam"\n[params]\nbudget = 64\n[disposition]\nmerge = "mean"\n'
                    '[selector]\nn_sink = 8\n')
    m = build_method(kvcompress.load_config(path))
    base = build_method("cam", budget=64)
    assert m.config.disposition.name == base.config.disposition.name and m.disposition.merge == "mean"
    assert m.config.selector.name == base.config.selector.name and m.selector.n_sink == 8
    assert m.scorer == base.scorer and m.budget == base.budget
    again = kvcompress.load_config(path).to_dict()
    assert "name" not in again["disposition"] and build_method(again) == m
    with pytest.raises(ConfigError, match=r"the \[disposition\] table needs a 'name' key when no method is named"):
        kvcompress.load_config({**COMPOSED, "budget": "uniform", "disposition": {"merge": "mean"}})


def test_bench_help_names_the_real_output_folder(capsys):
    """Bug: ``kvcompress bench --help`` said results go under docs/results/ (the default is
    ./kvcompress-results)."""
    from kvcompress.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "./kvcompress-results/" in " ".join(out.split()) and "docs/results" not in out


def test_docs_say_what_the_code_does():
    """Bugs: docs/quickstart.md said mlx-lm's loader cannot read kvcompress cache files (it
    can); docs/cli.md said KVCOMPRESS_STRICT_PLUGINS=1 gives a traceback (the CLI prints one
    line)."""
    from conftest import REPO

    quick = " ".join((REPO / "docs" / "quickstart.md").read_text().split())
    cli = " ".join((REPO / "docs" / "cli.md").read_text().split())
    assert "mlx-lm's loader only knows" not in quick and "mlx-lm's own `load_prompt_cache`" in quick
    assert "error with a traceback" not in cli and "one `error:` line from the command line" in cli
