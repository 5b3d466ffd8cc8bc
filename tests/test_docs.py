"""The documentation is complete, current and runnable.

* Every hook in :class:`kvcompress.hookspecs.ComponentSpecs` has ``docs/hooks/<hook>.md`` whose
  first heading names it, with the hook's signature and a worked example; the examples run, and
  the components they define pass kvcompress's contract checks.
* Every built-in component appears in ``docs/components.md`` with each of its parameters and
  defaults, every built-in method has a card under ``docs/methods/``, and the generated files
  (README methods table = ``kvcompress.cli.methods_table()`` of the built-ins, the methods index,
  the components reference, one config per method) are what ``scripts/update_docs.py`` writes.
* The "Write your own method" tutorial builds a working plugin: its files, written out from the
  page, are discovered through a real entry point and pass their own tests.
* Every command and ``generate`` option is in ``docs/cli.md``; every Python snippet compiles;
  the mkdocs site builds with ``--strict`` (when mkdocs is installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path

import pytest

import kvcompress
from kvcompress.cli import build_parser, methods_table
from kvcompress.components import KINDS, ComponentSpec, MethodSpec
from kvcompress.hookspecs import HOOK_KINDS, ComponentSpecs
from kvcompress.registry import Registry
from conftest import fresh_pytest_env

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _load_update_docs():
    spec = importlib.util.spec_from_file_location("update_docs", REPO / "scripts" / "update_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


update_docs = _load_update_docs()
HOOKS = sorted(n for n in vars(ComponentSpecs) if n.startswith("kvcompress_"))
BUILTIN = update_docs.builtin()

_BLOCK = re.compile(r"^(#{1,6} [^\n]*)$|^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)


def blocks(text: str):
    """``(section heading, language, info string, code)`` of every fenced block, in order."""
    section = ""
    for m in _BLOCK.finditer(text):
        if m.group(1):
            section = m.group(1)
        else:
            yield section, m.group(2), m.group(3).strip(), m.group(4)


def first_heading(path: Path) -> str:
    return next(ln for ln in path.read_text().splitlines() if ln.startswith("# "))


def nav_pages() -> set[str]:
    return set(re.findall(r"([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M))


# ------------------------------------------------------------------------------------------------
# Hook specs
# ------------------------------------------------------------------------------------------------


def test_hook_list_is_the_spec():
    assert HOOKS == sorted(HOOK_KINDS) and len(HOOKS) == 5


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_page_with_signature_and_example(hook):
    page = DOCS / "hooks" / f"{hook}.md"
    assert page.exists(), f"hook {hook} has no page docs/hooks/{hook}.md"
    assert hook in first_heading(page)
    found = list(blocks(page.read_text()))
    sig = [code for sec, lang, _, code in found if "Signature" in sec and lang == "python"]
    assert sig and f"def {hook}()" in sig[0], "the Signature section shows the hook's def"
    assert any("Example" in sec and lang == "python" for sec, lang, _, _ in found)
    assert f"hooks/{hook}.md" in nav_pages()
    assert f"({hook}.md)" in (DOCS / "hooks" / "index.md").read_text()


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_example_runs_and_passes_the_contract(hook, monkeypatch):
    """The Example section's blocks, run in order in one importable module (as a plugin's code
    is: a saved component state names its class by module), define the hook; what it returns
    registers, and the page's own contract check (its last block) passes."""
    page = DOCS / "hooks" / f"{hook}.md"
    mod = types.ModuleType(f"docs_example_{hook}")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    codes = [code for sec, lang, _, code in blocks(page.read_text()) if "Example" in sec and lang == "python"]
    assert any("kvcompress.testing.check_" in c for c in codes), "the example ends with a contract check"
    for code in codes:
        exec(compile(code, str(page), "exec", dont_inherit=True), mod.__dict__)
    fn = getattr(mod, hook)
    assert hasattr(fn, "kvcompress_impl"), "the example's hook is marked with @kvcompress.hookimpl"
    records = fn()
    kind = HOOK_KINDS[hook]
    assert records and all(isinstance(r, MethodSpec if kind is None else ComponentSpec) for r in records)
    reg = Registry(plugins=[("docs_example", types.SimpleNamespace(**{hook: fn}))])
    for r in records:
        assert reg.provider(kind, r.name).plugin == "docs_example"


# ------------------------------------------------------------------------------------------------
# Registry-generated pages
# ------------------------------------------------------------------------------------------------


def test_generated_docs_are_fresh():
    stale = [str(p.relative_to(REPO)) for p in update_docs.stale()]
    assert not stale, f"stale generated files {stale}: run `python scripts/update_docs.py`"


def test_readme_methods_table_is_methods_table():
    readme = (REPO / "README.md").read_text()
    assert update_docs.between(readme) == methods_table(BUILTIN)
    assert set(BUILTIN.methods) and all(f"| [{m}](" in readme or f"| {m} |" in readme for m in BUILTIN.methods)


def _component_section(text: str, kind: str, name: str) -> str:
    start = text.index(f"{{#{kind}-{name}}}")
    nxt = text.find("\n### ", start)
    return text[start : nxt if nxt > 0 else len(text)]


def test_every_builtin_component_is_documented_with_its_parameters():
    text = (DOCS / "components.md").read_text()
    n = 0
    for kind in KINDS:
        assert BUILTIN.components[kind], f"no built-in {kind}"
        for name, prov in BUILTIN.components[kind].items():
            assert f"### `{name}` {{#{kind}-{name}}}" in text, f"{kind} {name} missing from docs/components.md"
            section = _component_section(text, kind, name)
            for param, default in prov.spec.params().items():
                assert f"| `{param}` | `{default!r}` |" in section, f"{kind} {name}: parameter {param}"
            n += 1
    assert text.count("\n### ") == n, "docs/components.md documents exactly the built-in components"


def test_every_builtin_method_has_a_card_in_the_nav():
    cards = update_docs.method_cards()
    missing = sorted(set(BUILTIN.methods) - set(cards))
    assert not missing, f"methods without a card under docs/methods/ (name them in its first heading): {missing}"
    for m in BUILTIN.methods:
        assert f"methods/{cards[m]}" in nav_pages()
    index = (DOCS / "methods" / "index.md").read_text()
    assert all(f"[`{m}`]({cards[m]})" in index for m in BUILTIN.methods)


def test_every_docs_page_is_in_the_nav():
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages <= nav_pages(), f"pages missing from mkdocs.yml nav: {sorted(pages - nav_pages())}"
    assert not {p for p in nav_pages() if not (DOCS / p).exists()}


# ------------------------------------------------------------------------------------------------
# CLI page, snippets, README links
# ------------------------------------------------------------------------------------------------


def _subparsers(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    return {}


def test_cli_page_covers_every_command_and_option():
    text = (DOCS / "cli.md").read_text()
    commands = _subparsers(build_parser())
    for name, sub in commands.items():
        if name == "config":
            for cname in _subparsers(sub):
                assert f"## `kvcompress config {cname}`" in text
            continue
        assert f"## `kvcompress {name}`" in text, f"docs/cli.md has no section for `kvcompress {name}`"
        if name == "bench":
            for workload in _subparsers(sub):
                assert f"`{workload}`" in text
            continue
        for action in sub._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}" in text, f"`kvcompress {name} {opt}` is not documented in docs/cli.md"


def test_cli_page_shows_the_current_top_level_help(capsys, monkeypatch):
    """docs/cli.md's ``kvcompress --help`` block is what the command prints (80 columns)."""
    from kvcompress.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out.rstrip()
    text = (DOCS / "cli.md").read_text()
    block = text.split("$ kvcompress --help\n", 1)[1].split("\n```", 1)[0]
    assert block == out


def doc_files():
    return sorted([*DOCS.rglob("*.md"), REPO / "README.md", REPO / "examples" / "kvcompress-knorm" / "README.md"])


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_python_snippets_compile(path):
    for _, lang, _, code in blocks(path.read_text()):
        if lang == "python":
            try:
                compile(textwrap.dedent(code), str(path), "exec", dont_inherit=True)
            except SyntaxError as exc:
                pytest.fail(f"{path.relative_to(REPO)}: a python block does not compile: {exc}\n{code}")


def test_readme_links_the_docs():
    readme = (REPO / "README.md").read_text()
    for target in ("docs/index.md", "docs/quickstart.md", "docs/writing-a-plugin.md", "docs/components.md"):
        assert f"]({target})" in readme and (REPO / target).exists()


# ------------------------------------------------------------------------------------------------
# The tutorial builds a working plugin
# ------------------------------------------------------------------------------------------------


def write_tutorial_package(root: Path) -> Path:
    """Write every ``title="kvcompress-random/..."`` block of the tutorial under ``root``, plus the
    ``.dist-info`` that ``pip install`` would create (so the entry point is real), and return the
    project folder."""
    text = (DOCS / "writing-a-plugin.md").read_text()
    written = []
    for _, _, info, code in blocks(text):
        m = re.search(r'title="([^"]+)"', info)
        if m:
            path = root / m.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)
            written.append(m.group(1))
    project = root / "kvcompress-random"
    assert sorted(written) == sorted(
        f"kvcompress-random/{p}" for p in ("pyproject.toml", "conftest.py", "kvcompress_random/__init__.py",
                                           "kvcompress_random/scorer.py", "tests/test_contracts.py")
    )
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    eps = tomllib.loads((project / "pyproject.toml").read_text())["project"]["entry-points"]["kvcompress"]
    info = project / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    (info / "entry_points.txt").write_text("[kvcompress]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return project


def test_tutorial_plugin_is_discovered_through_its_entry_point(tmp_path, monkeypatch):
    project = write_tutorial_package(tmp_path)
    monkeypatch.syspath_prepend(str(project))
    reg = Registry()
    prov = reg.provider("scorer", "random")
    assert (prov.plugin, prov.dist, prov.version) == ("random", "kvcompress-random", "0.1.0")
    assert reg.methods["random"].dist == "kvcompress-random"
    assert kvcompress.build_method("random", seed=3, registry=reg).scorer.seed == 3
    with pytest.raises(kvcompress.CompositionError, match=r"requires \['attention_mass'\]"):
        kvcompress.build_method(scorer="random", selector="lowest", disposition="gated_merge",
                                budget="uniform", registry=reg)
    assert "random" not in Registry(disabled={"random"}).components["scorer"]


def test_tutorial_plugin_passes_its_own_tests(tmp_path):
    project = write_tutorial_package(tmp_path)
    # a fresh pytest, as the plugin's author runs it: not a worker of this run's pytest-xdist
    env = fresh_pytest_env(PYTHONPATH=os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-W", "error::pytest.PytestWarning", "tests"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\b4 passed\b", proc.stdout), proc.stdout[-2000:]
    assert "test_contract[scorer:random]" in proc.stdout and "test_contract[method:random]" in proc.stdout


# ------------------------------------------------------------------------------------------------
# The site builds
# ------------------------------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "components" / "index.html").exists()
    html = (tmp_path / "site" / "index.html").read_text()
    assert "fonts.googleapis" not in html, "the site must not fetch web fonts"
