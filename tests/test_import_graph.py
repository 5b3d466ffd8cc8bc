"""The import graph of ``kvcompress/``: no circles, and the engine imports no mlx-lm glue (issue 24).

The graph is built from the source with ``ast``: every ``import`` / ``from ... import`` statement
(relative or absolute) at module level, inside functions and classes, under ``if TYPE_CHECKING``,
and ``importlib.import_module`` / ``__import__`` calls given a literal name. A function-level import
counts: it only moves the circle from import time to call time. The one thing left out is the
body of an ``if __name__ == "...":`` guard at module level, which runs only when the file is run as
a script (``__main__.py``; ``_autoload.py`` exec'd by ``kvcompress-autoload.pth``), never when the
module is imported.

``from pkg import name`` is an edge to ``pkg.name`` when that is a module of the package, else to
``pkg``; importing a module does not count as an edge to its parent packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvcompress"


def _modules() -> dict:
    """Module name -> source file, for every ``.py`` file under ``kvcompress/``."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _is_main_guard(node: ast.stmt) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
            and isinstance(t.comparators[0], ast.Constant) and isinstance(t.comparators[0].value, str))


def _imports(tree: ast.Module):
    """``(node, module name or None for relative, names, level)`` of every import in ``tree``."""
    nodes = []
    for stmt in tree.body:
        if _is_main_guard(stmt):
            nodes.extend(ast.walk(ast.Module(body=stmt.orelse, type_ignores=[])))
        else:
            nodes.extend(ast.walk(stmt))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name, [], 0
        elif isinstance(node, ast.ImportFrom):
            yield node, node.module, [a.name for a in node.names], node.level
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            arg = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(arg, str) and not arg.startswith("."):
                yield node, arg, [], 0


def _graph() -> dict:
    """Module -> {imported module of the package: first line importing it}."""
    mods = _modules()
    edges: dict = {m: {} for m in mods}
    for cur, path in mods.items():
        base = cur.split(".") if path.name == "__init__.py" else cur.split(".")[:-1]
        for node, module, names, level in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                parts = base[: len(base) - (level - 1)]
                module = ".".join(parts + ([module] if module else []))
            targets = [f"{module}.{n}" if f"{module}.{n}" in mods else module for n in names] or [module]
            for t in targets:
                if t in mods and t != cur:
                    edges[cur].setdefault(t, node.lineno)
    return edges


def _circles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_sees_the_package():
    edges = _graph()
    assert "kvcompress.engine.engine" in edges and "kvcompress.mlxlm.attention" in edges
    assert "kvcompress.engine" in edges["kvcompress.cache"]  # a relative module-level import
    assert "kvcompress.engine.attend" in edges["kvcompress.engine.engine"]
    assert "kvcompress.mlxlm.entry_points" in edges["kvcompress.mlxlm.attention"]  # ``from . import x``


def test_no_import_circle_inside_the_package():
    edges = _graph()
    circles = _circles(edges)
    lines = []
    for comp in circles:
        lines.append("circle: " + ", ".join(comp))
        for m in comp:
            for t, line in sorted(edges[m].items()):
                if t in comp:
                    lines.append(f"    {m} -> {t}  ({_modules()[m].relative_to(ROOT)}:{line})")
    assert not circles, "import circles in kvcompress/ (function-level imports count):\n" + "\n".join(lines)


def test_the_engine_imports_nothing_from_the_mlx_lm_glue():
    edges = _graph()
    engine = [m for m, f in _modules().items() if PKG / "engine" in f.parents or f == PKG / "engine" / "__init__.py"]
    assert {"kvcompress.engine", "kvcompress.engine.engine", "kvcompress.engine.passes"} <= set(engine)
    bad = [f"{m} -> {t} (line {line})" for m in engine for t, line in sorted(edges[m].items())
           if t == "kvcompress.mlxlm" or t.startswith("kvcompress.mlxlm.")]
    assert not bad, "the engine imports kvcompress.mlxlm (let the glue register what it needs):\n" + "\n".join(bad)
