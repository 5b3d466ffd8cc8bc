"""``kvcompress`` command line: plugins, components, methods, config validation, bench, doctor."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Optional, Sequence

__all__ = ["main"]

#: ``kvcompress bench <workload>`` -> module exposing ``add_arguments(parser)`` and ``run(args)``.
BENCH_WORKLOADS = {
    "retrieval": "kvcompress.bench.retrieval",
    "synthetic": "kvcompress.bench.synthetic",
    "perplexity": "kvcompress.bench.perplexity",
    "speed": "kvcompress.bench.speed",
    "scaling": "kvcompress.bench.scaling",
    "serve": "kvcompress.bench.serve",
    "distributed": "kvcompress.bench.distributed",
    "longctx": "kvcompress.bench.longctx",
    "longppl": "kvcompress.bench.longctx_ppl",
}
DEFAULT_WORKLOAD = "retrieval"
#: Commands that restart themselves once with OpenBLAS preloaded (Linux, when it is installed).
PRELOAD_COMMANDS = ("bench", "generate", "serve", "chat", "tune")


def _registry(listing: bool = False):
    """The process-wide registry; ``listing``: for ``plugins`` and ``doctor``, which must still
    run when two plugins claim one name (the later claimant is listed as failed, with why)."""
    from .errors import PluginError
    from .registry import Registry, get_registry

    try:
        return get_registry()
    except PluginError:
        if not listing:
            raise
        return Registry(tolerate_collisions=True)


def _width(names, least: int = 16) -> int:
    """The name column's width: ``least``, or the longest name (a name never runs into the next
    column)."""
    return max([least, *(len(n) for n in names)])


def cmd_plugins(args) -> int:
    reg = _registry(listing=True)
    rows = reg.plugins()
    if args.json:
        print(json.dumps([
            {"name": p.name, "package": p.dist, "version": p.version, "status": p.status,
             "components": list(p.components), **({"error": p.error} if p.error else {})}
            for p in rows
        ], indent=2))
        return 0
    width = _width(p.name for p in rows)
    for p in rows:
        print(f"{p.name:<{width}} {p.dist} {p.version}  [{p.status}]")
        for c in p.components:
            print(f"    {c}")
        if p.error:
            print(f"    error: {p.error}")
    return 0


def cmd_components(args) -> int:
    from .components import KINDS

    reg = _registry()
    kinds = [args.kind] if args.kind else list(KINDS)
    out = {}
    for kind in kinds:
        out[kind] = [
            {"name": name, "plugin": prov.plugin, "summary": prov.spec.summary, "params": prov.spec.params()}
            for name, prov in sorted(reg.components[kind].items())
        ]
    if args.json:
        print(json.dumps(out, indent=2, default=repr))
        return 0
    width = _width(it["name"] for items in out.values() for it in items)
    for kind, items in out.items():
        print(f"{kind}s:")
        for it in items:
            params = ", ".join(f"{k}={v!r}" for k, v in it["params"].items())
            print(f"  {it['name']:<{width}} {it['summary']}  ({params or 'no parameters'}) [{it['plugin']}]")
    return 0


def methods_table(reg=None) -> str:
    """A Markdown table of the registered methods, generated from the registry."""
    reg = reg or _registry()
    lines = [
        "| method | scorer | selector | disposition | budget | defaults | summary |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, prov in sorted(reg.methods.items()):
        s = prov.spec
        defaults = ", ".join(f"{k}={v}" for k, v in s.params.items())
        title = f"[{name}]({s.paper})" if s.paper else name
        lines.append(
            f"| {title} | {s.scorer} | {s.selector} | {s.disposition} | {s.budget} | {defaults} | {s.summary} |"
        )
    return "\n".join(lines)


def cmd_methods(args) -> int:
    reg = _registry()
    if args.markdown:
        print(methods_table(reg))
        return 0
    why = {name: reg.unavailable(name) for name in reg.methods}
    if args.json:
        print(json.dumps({n: {"scorer": p.spec.scorer, "selector": p.spec.selector,
                              "disposition": p.spec.disposition, "budget": p.spec.budget,
                              "params": p.spec.params, "summary": p.spec.summary,
                              "plugin": p.plugin, "available": why[n] is None,
                              **({"why": why[n]} if why[n] else {})}
                          for n, p in sorted(reg.methods.items())}, indent=2))
        return 0
    width = _width(reg.methods)
    for name, prov in sorted(reg.methods.items()):
        s = prov.spec
        if why[name]:
            print(f"{name:<{width}} [unavailable: {why[name]}]")
        else:
            print(f"{name:<{width}} {s.scorer} + {s.selector} + {s.disposition} + {s.budget}   {s.summary}")
    return 0


#: Layer counts ``config validate`` evaluates a budget for, without a model.
NOMINAL_LAYERS = (1, 2, 8, 32)


def check_layer_budgets(method, layer_counts=NOMINAL_LAYERS) -> None:
    """Raise ConfigError unless every layer budget, for each nominal layer count, leaves room to
    evict past the selector's reserved tokens (what building the caches would check)."""
    from .components import ModelInfo
    from .errors import ConfigError

    budget, selector = method.config.budget.name, method.config.selector.name
    for n in layer_counts:
        where = f"budget {budget!r} for a {n}-layer model"
        try:
            budgets = method.budget.layer_budgets(ModelInfo(n_layers=n))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        for layer, b in enumerate(budgets):
            reserved = method.selector.reserved(int(b))
            if reserved >= b:
                from .factory import smallest_budget

                size = getattr(method.budget, "budget", None)
                least = smallest_budget(method, ModelInfo(n_layers=n), size) if isinstance(size, int) else None
                raise ConfigError(
                    f"{where}: layer {layer} gets {b} tokens but selector {selector!r} always keeps "
                    f"{reserved} (sinks + recent window); "
                    + (f"the smallest budget that builds is {least}" if least else "raise the budget")
                    + " or protect fewer tokens"
                )


def cmd_config_validate(args) -> int:
    from .config import load_config
    from .errors import KVCompressError
    from .method import build_method

    try:
        method = build_method(load_config(args.file))
        check_layer_budgets(method)
    except KVCompressError as exc:
        print(f"{args.file}: invalid: {exc}", file=sys.stderr)
        return 2
    print(f"{args.file}: ok")
    print(method.describe())
    print(f"checked: names, parameters, composition, and layer budgets for "
          f"{', '.join(map(str, NOMINAL_LAYERS))} layers; left to build time: the model's layer count "
          "and head dim, and data-driven budgets (e.g. squeeze re-splits after the prompt)")
    return 0


def cmd_bench(args) -> int:
    from .bench._options import check_file_stem, check_out_dir, out_dir

    mod = importlib.import_module(BENCH_WORKLOADS[args.workload])
    try:
        check_out_dir(out_dir(args))  # before any work: a run must not fail at its last step
        if getattr(args, "out_name", None) is not None:
            check_file_stem(args.out_name)
        mod.run(args)
    except ValueError as exc:  # bad settings: unknown methods, impossible sizes, ...
        print(f"kvcompress bench {args.workload}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_tune(args) -> int:
    from .tune.cli import run

    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:  # bad options, data or model: one line
        print(f"kvcompress tune: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def cmd_doctor(args) -> int:
    import platform

    import mlx.core as mx

    from ._blas import FIX_HINT, find_openblas, openblas_preloaded

    print(f"python     {platform.python_version()} on {platform.system()} {platform.machine()}")
    try:
        import mlx_lm

        lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover - mlx_lm is a dependency
        lm_version = "?"
    print(f"mlx        {mx.__version__}   mlx-lm {lm_version}")
    print(f"device     {mx.default_device()}")
    if platform.system() == "Linux":
        lib = find_openblas()
        auto = ", ".join(f"`kvcompress {c}`" for c in PRELOAD_COMMANDS)
        if openblas_preloaded():
            print("blas       OpenBLAS preloaded in this process (fast CPU matmul)")
        elif lib is None:
            print("blas       reference BLAS (~35x slower matmul); OpenBLAS not found")
            print(f"           fix: {FIX_HINT}")
        else:
            off = os.environ.get("KVCOMPRESS_NO_BLAS_REEXEC")
            how = ("not preloaded: KVCOMPRESS_NO_BLAS_REEXEC is set" if off
                   else f"{auto} preload it automatically")
            print(f"blas       OpenBLAS found at {lib}; {how}")
            print(f"           for your own scripts: export LD_PRELOAD={lib}")
    from . import _lowbit

    lowbit = _lowbit.status()
    why = lowbit["reason"] or ""
    print("lowbit     " + ("few-row low-bit CPU kernel built (KIVI decode)" if lowbit["available"] else (
        "low-bit CPU kernel " if why.startswith("not built yet") else "MLX's quantized_matmul: ") + why))
    reg = _registry(listing=True)
    width = _width((p.name for p in reg.plugins()), 14)
    for p in reg.plugins():
        print(f"plugin     {p.name:<{width}} {p.dist} {p.version} [{p.status}]" + (f" {p.error}" if p.error else ""))
    if reg.failed():
        print(f"{len(reg.failed())} plugin(s) failed to load (why: on its line above); "
              "KVCOMPRESS_STRICT_PLUGINS=1 makes a broken plugin an error instead of a skip")
    return 0


def _add_bench_parser(sub) -> None:
    """``kvcompress bench [WORKLOAD]``; its help lists every workload with its one-line summary."""
    from .bench._options import DEFAULT_OUT

    mods, summaries = {}, {}
    for name, modname in BENCH_WORKLOADS.items():
        try:
            mods[name] = importlib.import_module(modname)
            doc = (mods[name].__doc__ or f"the {name} workload").strip().splitlines()[0]
            summaries[name] = doc.rstrip(".").replace("``", "")
        except ImportError as exc:  # missing optional dependencies
            mods[name], summaries[name] = None, f"unavailable: {exc}"
    width = max(map(len, summaries))
    listing = "\n".join(f"  {name:<{width}}  {text}" for name, text in summaries.items())
    p = sub.add_parser(
        "bench", help=f"compare methods side by side (default workload: {DEFAULT_WORKLOAD})",
        description="Compare methods side by side on a workload; each prints a table and\n"
                    f"writes JSON and a plot under ./{DEFAULT_OUT}/ (--out DIR picks another).",
        epilog=f"workloads:\n{listing}\n\n`kvcompress bench WORKLOAD --help` lists a workload's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    wsub = p.add_subparsers(dest="workload", metavar="WORKLOAD",
                            help=f"one of the workloads below (default: {DEFAULT_WORKLOAD})")
    for name, mod in mods.items():
        w = wsub.add_parser(name, description=summaries[name])
        try:
            mod.add_arguments(w)
        except AttributeError as exc:  # not a workload module, or not importable (mod is None)
            w.set_defaults(_import_error=str(exc) if mod else summaries[name])
        w.set_defaults(func=cmd_bench, workload=name)
    p.set_defaults(func=cmd_bench, workload=None)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, ``PROG: error: MESSAGE (see PROG --help)``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcompress", description=__doc__)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"kvcompress {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list plugins, their package, version and components")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("components", help="list components by kind with a one-line summary")
    p.add_argument("--kind", choices=["scorer", "selector", "disposition", "budget"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_components)

    p = sub.add_parser("methods", help="list named methods (compositions)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true", help="the README's methods table")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("config", help="work with method config files")
    csub = p.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="check a TOML/JSON method config and explain any error")
    v.add_argument("file")
    v.set_defaults(func=cmd_config_validate)

    _add_bench_parser(sub)

    p = sub.add_parser("generate", help="mlx_lm.generate with a compressed cache, and the bytes it saved")
    from . import generate

    generate.add_arguments(p)
    p.set_defaults(func=lambda a: generate.run(a) and 0)

    p = sub.add_parser("tune", help="search methods and parameters for a model at a budget; write the best config",
                       description="A bounded search over the registered methods and their main parameters on "
                                   "your text (or the bundled workloads): ranking with standard errors, the "
                                   "winning config (tune.toml), tune.json and a plot.")
    from .tune.cli import add_arguments as tune_arguments

    tune_arguments(p)
    p.set_defaults(func=cmd_tune)

    from .mlxlm.commands import _DESCRIPTIONS

    for name in ("serve", "chat"):  # parsed by kvcompress.mlxlm.commands (mlx-lm's flags pass through)
        sub.add_parser(name, help=_DESCRIPTIONS[name], add_help=False)

    p = sub.add_parser("doctor", help="check MLX, BLAS speed and plugins")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``kvcompress ARGV``; returns the exit status (130 after Ctrl-C, quietly)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        try:
            sys.stdout.flush()
        except Exception:  # pragma: no cover - a closed pipe
            pass
        print("", file=sys.stderr)  # end the progress bar's or the answer's line
        return 130


def _main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from ._blas import reexec_with_openblas

    if argv and argv[0] in PRELOAD_COMMANDS:
        reexec_with_openblas(["-m", "kvcompress", *argv])
    if argv and argv[0] in ("serve", "chat"):
        from .mlxlm.commands import main as mlx_main

        return mlx_main(argv[0], argv[1:])
    parser = build_parser()
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1].startswith("-")) \
            and not {"-h", "--help"} & set(argv[1:]):
        argv = ["bench", DEFAULT_WORKLOAD, *argv[1:]]
    args = parser.parse_args(argv)
    if getattr(args, "_import_error", None):
        parser.error(f"workload {args.workload!r} is unavailable: {args._import_error}")
    from .errors import KVCompressError

    prog = f"kvcompress {args.command}"
    try:
        return int(args.func(args) or 0)
    except KVCompressError as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # bad files and values met while generating
        if args.command != "generate":
            raise
        print(f"{prog}: error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
