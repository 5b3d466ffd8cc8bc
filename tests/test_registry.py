"""Plugin discovery: built-ins via entry points, broken/disabled/duplicate/ill-formed plugins."""

from __future__ import annotations

import json

import importlib.metadata as md
import re
import tomllib
import types
import warnings

import attrs
import pytest

import kvcompress
from kvcompress import ComponentSpec, MethodSpec, PluginError, hookimpl
from kvcompress.registry import Registry

from conftest import REPO

BUILTIN = {
    "basic": {"selector:lowest", "disposition:drop", "budget:uniform"},
    "h2o": {"scorer:h2o", "method:h2o"},
    "cam": {"disposition:gated_merge", "method:cam"},
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("KVCOMPRESS_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("KVCOMPRESS_DISABLE_PLUGINS", raising=False)


# ------------------------------------------------------------------------------------------
# Fake entry points
# ------------------------------------------------------------------------------------------


@attrs.frozen
class FakeDist:
    name: str
    version: str = "9.9"


@attrs.frozen
class FakeEntryPoint:
    """Quacks like importlib.metadata.EntryPoint; ``load`` returns ``obj`` or raises ``exc``."""

    name: str
    value: str
    obj: object = None
    exc: BaseException = None
    dist: FakeDist = FakeDist("thirdparty-dist")
    group: str = "kvcompress"

    def load(self):
        if self.exc is not None:
            raise self.exc
        return self.obj


def _with_entry_points(monkeypatch, *fakes):
    """Make discovery see the real ``kvcompress`` entry points plus ``fakes``."""
    real = md.entry_points

    def entry_points(**kw):
        eps = list(real(**kw))
        return eps + [f for f in fakes if f.group == kw.get("group")] if kw else eps

    monkeypatch.setattr(kvcompress.registry.md, "entry_points", entry_points)


class NotAttrs:
    """A plain class: not a valid component class."""


@attrs.frozen
class DummyScorer:
    requires = frozenset()
    provides = frozenset({"dummy"})

    def observe(self, scores, obs):
        return scores


def _scorer_plugin(name="dummy"):
    mod = types.SimpleNamespace()

    @hookimpl
    def kvcompress_scorers():
        return [ComponentSpec("scorer", name, DummyScorer, "test scorer")]

    mod.kvcompress_scorers = kvcompress_scorers
    return mod


# ------------------------------------------------------------------------------------------
# Built-ins
# ------------------------------------------------------------------------------------------


def test_builtins_come_from_the_entry_point_group():
    eps = {ep.name: ep for ep in md.entry_points(group="kvcompress") if ep.dist.name == "kvcompress"}
    assert set(BUILTIN) <= set(eps)
    reg = Registry()
    infos = {p.name: p for p in reg.plugins()}
    for name, comps in BUILTIN.items():
        info = infos[name]
        assert (info.dist, info.version, info.status) == ("kvcompress", kvcompress.__version__, "active")
        assert comps <= set(info.components)
        for label in comps:
            kind, comp = label.split(":")
            prov = reg.provider(None if kind == "method" else kind, comp)
            assert (prov.plugin, prov.dist) == (name, "kvcompress")
    assert not reg.failed()


def test_no_entry_points_means_no_components():
    reg = Registry(entry_points=False)
    assert all(not table for table in reg.components.values()) and not reg.methods
    with pytest.raises(kvcompress.ConfigError, match=r"registered methods: \(none\)"):
        reg.method("cam")


def test_pyproject_entry_points_match_plugin_folders():
    """Every built-in entry point names a package under plugins/, and every such package is listed
    -- in pyproject.toml and in the installed metadata (else: re-run ``pip install -e .``)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    table = data["project"]["entry-points"]["kvcompress"]
    folders = {p.name for p in (REPO / "plugins").iterdir() if (p / "__init__.py").exists()}
    assert set(table.values()) <= folders, "an entry point names a package missing from plugins/"
    assert folders <= set(table.values()), (
        f"plugin package(s) {sorted(folders - set(table.values()))} have no entry point in "
        "pyproject.toml [project.entry-points.kvcompress]: kvcompress would never load them"
    )
    for name, module in table.items():
        assert re.fullmatch(r"kvcompress_[a-z0-9_]+", module), module
        assert module == f"kvcompress_{name}"
        assert (REPO / "plugins" / module / "__init__.py").is_file()
    installed = {ep.name: ep.value for ep in md.distribution("kvcompress").entry_points if ep.group == "kvcompress"}
    assert installed == table, "installed entry points are stale: run `pip install -e .`"


# ------------------------------------------------------------------------------------------
# Broken plugins
# ------------------------------------------------------------------------------------------


BROKEN = FakeEntryPoint("broken_plugin", "broken_mod", exc=ImportError("No module named 'torch'"))


def test_broken_plugin_is_skipped_with_a_warning(monkeypatch):
    _with_entry_points(monkeypatch, BROKEN, FakeEntryPoint("extra", "extra_mod", _scorer_plugin()))
    with pytest.warns(RuntimeWarning, match=r"'broken_plugin' from thirdparty-dist 9\.9 failed to import.*torch"):
        reg = Registry()
    [failed] = reg.failed()
    assert (failed.name, failed.dist, failed.status) == ("broken_plugin", "thirdparty-dist", "failed")
    assert "torch" in failed.error
    # The rest still works: built-ins and the healthy third-party plugin.
    assert reg.provider("scorer", "dummy").dist == "thirdparty-dist"
    assert kvcompress.build_method("cam", budget=16, registry=reg).name == "cam"


@pytest.mark.parametrize("exc", [ImportError("no torch"), RuntimeError("boom at import")])
def test_strict_env_makes_a_broken_plugin_fatal(monkeypatch, exc):
    _with_entry_points(monkeypatch, attrs.evolve(BROKEN, exc=exc))
    monkeypatch.setenv("KVCOMPRESS_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"'broken_plugin'.*KVCOMPRESS_STRICT_PLUGINS") as info:
        Registry()
    assert info.value.__cause__ is exc


def test_disable_env_blocks_plugins_by_name(monkeypatch):
    _with_entry_points(monkeypatch, BROKEN)
    monkeypatch.setenv("KVCOMPRESS_DISABLE_PLUGINS", " broken_plugin , cam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a disabled broken plugin is never imported
        reg = Registry()
    status = {p.name: p.status for p in reg.plugins()}
    assert status["broken_plugin"] == status["cam"] == "disabled"
    assert status["h2o"] == "active"
    assert "cam" not in reg.methods and "gated_merge" not in reg.components["disposition"]
    assert reg.pm.is_blocked("cam")
    with pytest.raises(kvcompress.ConfigError) as info:
        kvcompress.build_method("cam", registry=reg)
    assert str(info.value) == (
        "method 'cam' comes from plugin 'cam', which is disabled; "
        "remove 'cam' from KVCOMPRESS_DISABLE_PLUGINS to re-enable it"
    )


def test_a_method_needing_a_disabled_plugin_is_unavailable_with_why(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_DISABLE_PLUGINS", "streaming_llm")
    reg = Registry()
    why = "scorer 'recency' comes from plugin 'streaming_llm', which is disabled"
    assert reg.unavailable("kivi") == why
    assert reg.unavailable("h2o") is None and "streaming_llm" not in reg.methods
    with pytest.raises(kvcompress.ConfigError) as info:
        kvcompress.build_method("kivi", registry=reg)
    assert str(info.value) == why + "; remove 'streaming_llm' from KVCOMPRESS_DISABLE_PLUGINS to re-enable it"
    # Another scorer makes the method buildable again.
    assert kvcompress.build_method("kivi", scorer="h2o", registry=reg).config.scorer.name == "h2o"


def test_a_misspelt_disabled_plugin_name_is_warned_about(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_DISABLE_PLUGINS", "streaming-llm")
    with pytest.warns(RuntimeWarning, match=r"unknown plugin\(s\) \['streaming-llm'\]; known plugins: .*'streaming_llm'"):
        reg = Registry()
    assert "streaming_llm" in reg.methods


@pytest.mark.parametrize(
    "kind, typo, meant",
    [(None, "snapvk", "snapkv"), ("scorer", "h2", "h2o"), ("disposition", "gated-merge", "gated_merge")],
)
def test_a_misspelt_name_gets_a_did_you_mean(kind, typo, meant):
    reg = kvcompress.get_registry()
    with pytest.raises(kvcompress.ConfigError) as info:
        reg.method(typo) if kind is None else reg.component(kind, typo)
    what = kind or "method"
    assert str(info.value).startswith(f"unknown {what} {typo!r}; did you mean {meant!r}? registered {what}s: ")
    with pytest.raises(kvcompress.ConfigError, match=r"^unknown method 'zzzz'; registered methods: "):
        reg.method("zzzz")


# ------------------------------------------------------------------------------------------
# Conflicts and ill-formed plugins
# ------------------------------------------------------------------------------------------


def test_component_claimed_twice_names_both_providers(monkeypatch):
    _with_entry_points(monkeypatch, FakeEntryPoint("evil", "evil_mod", _scorer_plugin("h2o")))
    with pytest.raises(PluginError) as info:
        Registry()
    msg = str(info.value)
    assert "scorer name 'h2o' is claimed twice" in msg
    assert "plugin 'h2o' (kvcompress 0.1.0)" in msg and "plugin 'evil' (thirdparty-dist 9.9)" in msg


def test_method_claimed_twice_names_both_providers():
    mod = types.SimpleNamespace(
        kvcompress_methods=hookimpl(
            lambda: [MethodSpec("cam", "h2o", "lowest", "drop", "uniform", "impostor")]
        )
    )
    with pytest.raises(PluginError, match=r"method name 'cam' is claimed twice: by plugin 'cam'.*plugin 'impostor'"):
        Registry(plugins=[("impostor", mod)])


@pytest.mark.parametrize("fake, why", [
    (FakeEntryPoint("evil", "evil_mod", _scorer_plugin("h2o")), "scorer name 'h2o' is claimed twice"),
    (FakeEntryPoint("h2o", "other_h2o", _scorer_plugin()), "two plugins are named 'h2o'"),
])
def test_plugins_and_doctor_still_run_and_list_a_collision_as_failed(monkeypatch, capsys, fake, why):
    """Bug: two plugins claiming one name broke every command, ``kvcompress plugins`` and
    ``doctor`` included; they list the later claimant as failed with the reason now, while the
    other commands still refuse (one line)."""
    from kvcompress.cli import main
    from kvcompress.registry import reset_registry

    _with_entry_points(monkeypatch, fake)
    reset_registry()
    try:
        assert main(["plugins", "--json"]) == 0
        rows = {(p["name"], p["package"]): p for p in json.loads(capsys.readouterr().out)}
        row = rows[(fake.name, "thirdparty-dist")]
        assert row["status"] == "failed" and why in row["error"] and row["components"] == []
        assert rows[("h2o", "kvcompress")]["status"] == "active"
        assert main(["doctor"]) == 0
        out = capsys.readouterr().out
        assert f"[failed] {why}" in out and "1 plugin(s) failed to load" in out
        assert main(["methods"]) == 2
        assert why in capsys.readouterr().err
    finally:
        reset_registry()


def test_two_plugins_with_one_name(monkeypatch):
    _with_entry_points(monkeypatch, FakeEntryPoint("h2o", "other_h2o", _scorer_plugin()))
    with pytest.raises(PluginError, match=r"two plugins are named 'h2o'.*kvcompress.*thirdparty-dist"):
        Registry()


def _bad_records_plugin(records):
    return types.SimpleNamespace(kvcompress_scorers=hookimpl(lambda: records))


@pytest.mark.parametrize(
    "records, why",
    [
        ([MethodSpec("x", "h2o", "lowest", "drop", "uniform", "a method")], "must return ComponentSpec"),
        ([{"kind": "scorer", "name": "x"}], "must return ComponentSpec"),
        ([ComponentSpec("selector", "x", DummyScorer, "wrong kind")], "returned a selector"),
    ],
    ids=["methodspec", "dict", "wrong-kind"],
)
def test_wrong_record_type_is_reported(records, why):
    with pytest.warns(RuntimeWarning, match=rf"'bad'.*returned a bad kvcompress_scorers.*{why}"):
        reg = Registry(plugins=[("bad", _bad_records_plugin(records))])
    assert [p.name for p in reg.failed()] == ["bad"]
    assert "x" not in reg.components["scorer"] and "x" not in reg.components["selector"]
    assert "h2o" in reg.components["scorer"]
    with pytest.raises(PluginError, match=r"'bad'.*returned a bad kvcompress_scorers"):
        Registry(plugins=[("bad", _bad_records_plugin(records))], strict=True)


class WrongSignature:
    @hookimpl
    def kvcompress_scorers(self, model):  # the hook spec takes no arguments
        return []


def test_hook_with_wrong_signature_is_reported(monkeypatch):
    _with_entry_points(monkeypatch, FakeEntryPoint("wrongsig", "wrongsig_mod", WrongSignature()))
    with pytest.warns(RuntimeWarning, match=r"'wrongsig'.*could not be registered.*model"):
        reg = Registry()
    assert [(p.name, p.status) for p in reg.failed()] == [("wrongsig", "failed")]
    assert "cam" in reg.methods
    with pytest.raises(PluginError, match="'wrongsig'"):
        Registry(strict=True)


def test_record_validation_rejects_bad_names_and_classes():
    with pytest.raises(ValueError, match="lower case"):
        ComponentSpec("scorer", "KNorm", DummyScorer, "x")
    with pytest.raises(ValueError, match="identifier"):
        ComponentSpec("scorer", "k-norm", DummyScorer, "x")
    with pytest.raises(ValueError, match="attrs class"):
        ComponentSpec("scorer", "plain", NotAttrs, "x")
    with pytest.raises(ValueError):
        ComponentSpec("gadget", "x", DummyScorer, "x")


def test_get_registry_is_cached_and_resettable():
    from kvcompress.registry import get_registry, reset_registry

    a = get_registry()
    assert get_registry() is a
    reset_registry()
    try:
        b = get_registry()
        assert b is not a and set(b.methods) == set(a.methods)
    finally:
        reset_registry()
