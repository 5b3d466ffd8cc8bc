"""Method configs load from dicts, TOML and JSON files; malformed, missing, binary files and
folders are one-line ConfigErrors naming the file; resolved configs round-trip."""

from __future__ import annotations

import json

import pytest

from kvcompress import ConfigError, MethodConfig, build_method, load_config

COMPOSED = dict(scorer="h2o", selector="lowest", disposition="drop", budget="uniform")


def _error(fn, *args, exc=ConfigError, **kw) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    return str(info.value)


# ------------------------------------------------------------------------------------------
# load_config: dict, TOML, JSON
# ------------------------------------------------------------------------------------------

TOML = """
method = "cam"
[params]
budget = 64
n_sink = 2
[disposition]
name = "gated_merge"
merge = "mean"
merge_keys = true
"""

CONFIG = {
    "method": "cam",
    "params": {"budget": 64, "n_sink": 2},
    "disposition": {"name": "gated_merge", "merge": "mean", "merge_keys": True},
}


def _expected():
    return build_method("cam", budget=64, n_sink=2, merge="mean", merge_keys=True)


def _same(a, b):
    return all(a.component(k) == b.component(k) for k in ("scorer", "selector", "disposition", "budget"))


def test_load_config_from_dict_toml_and_json(tmp_path):
    toml_path = tmp_path / "cam.toml"
    toml_path.write_text(TOML)
    json_path = tmp_path / "cam.json"
    json_path.write_text(json.dumps(CONFIG))
    configs = [load_config(CONFIG), load_config(toml_path), load_config(str(json_path))]
    assert configs[0] == configs[1] == configs[2]
    for cfg in configs:
        m = build_method(cfg)
        assert _same(m, _expected())
        assert m.disposition.merge == "mean" and m.disposition.merge_keys is True
        assert m.budget.budget == 64 and m.selector.n_sink == m.disposition.n_sink == 2


def test_composed_config_without_a_method_name(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        'scorer = "h2o"\nselector = { name = "lowest", n_sink = 1 }\ndisposition = "drop"\n'
        'budget = { name = "uniform", budget = 16 }\n'
    )
    m = build_method(load_config(path))
    assert m.name == "custom" and m.selector.n_sink == 1 and m.budget.budget == 16


def test_resolved_config_round_trips(tmp_path):
    m = _expected()
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(m.config.to_dict()))
    assert _same(build_method(load_config(path)), m)


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("bad.toml", 'method = "cam\n', r"bad\.toml.*is not valid toml"),
        ("bad.json", '{"method": "cam",}', r"bad\.json.*is not valid json"),
        ("list.json", '["cam"]', "a method config is a table/object, got list"),
        ("cam.yaml", "method: cam\n", r"use a \.toml or \.json file"),
        ("extra.toml", 'method = "cam"\nbudget_tokens = 3\n', r"unknown config key\(s\) \['budget_tokens'\]; valid keys"),
        ("noname.toml", '[scorer]\nfoo = 1\n', "needs a 'name' key"),
        ("num.json", '{"scorer": 3}', "a component is a name or a table"),
    ],
)
def test_malformed_files(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_missing_file_and_bad_values_in_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    path = tmp_path / "bad_value.toml"
    path.write_text('method = "cam"\n[params]\nmerge = "bogus"\n')
    cfg = load_config(path)  # syntactically fine; the value is checked when the method is built
    with pytest.raises(ConfigError, match=r"merge.*bogus.*'sim_weighted', 'mean', 'drop'"):
        build_method(cfg)


@pytest.mark.parametrize("name", ["binary.toml", "binary.json"])
def test_a_binary_file_is_a_config_error_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(ConfigError, match=rf"config file '.*{name}' is not UTF-8 text .*binary file"):
        load_config(path)


def test_a_folder_is_a_config_error(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.toml' cannot be read"):
        load_config(tmp_path / "dir.toml")


def test_method_config_is_validated():
    with pytest.raises(ConfigError):
        MethodConfig.from_dict({"method": 3})
    assert MethodConfig(scorer="h2o").scorer.name == "h2o"
