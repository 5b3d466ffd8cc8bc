"""Outside ``kvcompress/engine/`` nothing reads or writes an engine's private fields (issue 24).

The engine's private names are collected from live caches (a single and a batched one: their
instance fields) and from the engine's classes (their private methods); every Python file of
the package outside ``kvcompress/engine/``, of the plugins, the examples and the tests is parsed
with ``ast`` and each attribute access ``x._name`` with one of those names is a finding (so is a
string argument naming one, as in ``monkeypatch.setattr(Cls, "_name", ...)``). ``self._name``
inside a class that is not an engine is that class's own field, not a finding. White-box tests
inspect the engine's parts through ``cache.parts`` (rows, slots, planned eviction) and their
public fields.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx

import kvcompress
from kvcompress import BatchCompressedKVCache, CompressedKVCache

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENGINE_CLASSES = {"Engine", "CompressedKVCache", "BatchCompressedKVCache"}

#: file -> private engine names it may still touch (white-box checks of the step's internals)


def _engine_private_names() -> set:
    single = CompressedKVCache(kvcompress.build_method("h2o", budget=16), 16)
    single.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    batch = BatchCompressedKVCache(kvcompress.build_method("h2o", budget=16), 16, [0, 1])
    batch.update_and_fetch(mx.zeros((2, 2, 3, 8)), mx.zeros((2, 2, 3, 8)))
    names = set()
    for c in (single, batch):
        names |= {n for n in vars(c) if n.startswith("_") and not n.startswith("__")}
        for cls in type(c).__mro__:
            if cls.__module__.startswith("kvcompress"):
                names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
    return names


def _files() -> list:
    out = [f for f in sorted((ROOT / "kvcompress").rglob("*.py")) if "engine" not in f.relative_to(ROOT).parts]
    for folder in ("plugins", "examples", "tests"):
        out += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in out if f.resolve() != Path(__file__).resolve()]


class _Scan(ast.NodeVisitor):
    def __init__(self, private: set):
        self.private, self.hits, self.engine_class = private, set(), [False]

    def visit_ClassDef(self, node):
        bases = {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases}
        self.engine_class.append(bool(bases & ENGINE_CLASSES))
        self.generic_visit(node)
        self.engine_class.pop()

    def visit_Attribute(self, node):
        own = isinstance(node.value, ast.Name) and node.value.id == "self" and not self.engine_class[-1]
        if node.attr in self.private and not own:
            self.hits.add(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):  # getattr(c, "_n"), monkeypatch.setattr(Cls, "_evict", ...)
        for a in node.args:
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in self.private:
                self.hits.add(a.value)
        self.generic_visit(node)


def _findings() -> dict:
    private = _engine_private_names()
    out = {}
    for f in _files():
        scan = _Scan(private)
        scan.visit(ast.parse(f.read_text(), filename=str(f)))
        if scan.hits:
            out[str(f.relative_to(ROOT))] = sorted(scan.hits)
    return out


def test_the_scan_sees_the_engines_fields():
    names = _engine_private_names()
    assert {"_slots", "_rows", "_plan", "_states", "_pending", "_hooks", "_evict", "_undo"} <= names


def test_the_scan_finds_a_private_access(tmp_path):
    scan = _Scan(_engine_private_names())
    scan.visit(ast.parse("class Other:\n    def f(self, cache):\n        self._n = cache._rows\n"))
    assert scan.hits == {"_rows"}


def test_nothing_outside_the_engine_touches_its_privates():
    found = _findings()
    assert not found, (
        f"code or tests outside kvcompress/engine/ reach into engine privates (use the public views, "
        f"e.g. slot_positions, rows_held, component_state): {found}")
