"""The ``kvcompress`` command line: every command, its options, its one-line errors (:data:`COMMANDS`)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Optional, Sequence

from ._blas import PRELOAD_COMMANDS
from ._config_check import NOMINAL_LAYERS, check_layer_budgets, cmd_config_validate  # noqa: F401 (kvcompress.cli API)
from ._listing import _registry, _width

__all__ = ["main"]

#: ``kvcompress bench <workload>`` -> module exposing ``add_arguments(parser)`` and ``run(args)``.
BENCH_WORKLOADS = {
    "retrieval": "kvcompress.bench.retrieval",
    "synthetic": "kvcompress.bench.synthetic",
    "perplexity": "kvcompress.bench.perplexity",
    "speed": "kvcompress.bench.speed",
    "scaling": "kvcompress.bench.scaling",
    "serve": "kvcompress.bench.serve",
    "restart": "kvcompress.bench.restart",
    "distributed": "kvcompress.bench.distributed",
    "longctx": "kvcompress.bench.longctx",
    "longppl": "kvcompress.bench.longctx_ppl",
    "storage": "kvcompress.bench.storage",
}
DEFAULT_WORKLOAD = "retrieval"
#: Every command with its one-line summary, in the groups ``kvcompress --help`` lists them in.
COMMANDS = {
    "run a model with a compressed KV cache": {
        "generate": "mlx_lm.generate with a compressed cache, and the bytes it saved",
        "chat": "mlx-lm's terminal chat with a compressed cache kept across turns",
        "serve": "mlx-lm's OpenAI-compatible server with every KV cache compressed",
    },
    "choose and measure a method": {
        "bench": "compare methods side by side (default workload: retrieval, no download)",
        "tune": "search methods and parameters for a model at a budget; write the best config",
    },
    "see what is installed": {
        "methods": "list the named methods: their components and what each does",
        "components": "list the components by kind, with their parameters",
        "plugins": "list the plugins, their package, version and components",
        "config": "check a TOML/JSON method config file (config validate FILE)",
        "doctor": "check MLX, BLAS speed, the CPU kernels and the plugins",
    },
}
SUMMARIES = {name: text for group in COMMANDS.values() for name, text in group.items()}
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
    rows = [(name, f"{p.spec.scorer} + {p.spec.selector} + {p.spec.disposition} + {p.spec.budget}",
             f"[unavailable: {why[name]}]" if why[name] else p.spec.summary.replace("`", ""))
            for name, p in sorted(reg.methods.items())]
    print("\n".join(aligned([("method", "scorer + selector + disposition + budget", "summary"), *rows])))
    return 0


def aligned(rows, wrap: Optional[int] = None) -> list[str]:
    """``rows`` of text cells as lines, every column but the last padded to its widest cell; the
    last column wrapped under itself to the terminal's width when stdout is one (``wrap``: that
    width)."""
    import shutil
    import textwrap

    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    indent = sum(widths) + 2 * len(widths)
    if wrap is None and sys.stdout.isatty():
        wrap = shutil.get_terminal_size().columns
    lines = []
    for r in rows:
        head = "".join(f"{c:<{w}}  " for c, w in zip(r, widths))
        tail = textwrap.wrap(r[-1], max(wrap - indent, 30)) if wrap else [r[-1]]
        lines += [head + (tail[0] if tail else ""), *(" " * indent + t for t in tail[1:])]
    return [line.rstrip() for line in lines]


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
        "bench", help=SUMMARIES["bench"],
        description="Compare methods side by side on a workload; each prints a table and\n"
                    f"writes JSON and a plot under ./{DEFAULT_OUT}/ (--out DIR picks another).",
        epilog=f"workloads:\n{listing}\n\nRun kvcompress bench WORKLOAD --help for a workload's options.",
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


def _overview() -> str:
    """``kvcompress --help``'s text above the options: what it is, every command with its summary."""
    width = max(map(len, SUMMARIES))
    lines = ["Composable KV-cache compression for mlx-lm: score the cached tokens, choose which",
             "leave, and drop, merge or quantize them, under a per-layer budget.", ""]
    for group, commands in COMMANDS.items():
        lines += [f"{group}:", *(f"  {name:<{width}}  {text}" for name, text in commands.items()), ""]
    return "\n".join(lines[:-1])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcompress", usage="%(prog)s [-h] [--version] COMMAND ...", description=_overview(),
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="Run kvcompress COMMAND --help for a command's options. First time here? "
                            "Try kvcompress bench\n(no download: the retrieval benchmark on a model shipped "
                            "with kvcompress).")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"kvcompress {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS,
                                prog="kvcompress")

    def command(name, **kw):
        kw.setdefault("description", SUMMARIES[name][0].upper() + SUMMARIES[name][1:] + ".")
        return sub.add_parser(name, help=SUMMARIES[name], **kw)

    p = command("plugins")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = command("components")
    p.add_argument("--kind", choices=["scorer", "selector", "disposition", "budget"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_components)

    p = command("methods")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true", help="the README's methods table")
    p.set_defaults(func=cmd_methods)

    p = command("config", description="Work with method config files.")
    csub = p.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="check a TOML/JSON method config and explain any error")
    v.add_argument("file")
    v.set_defaults(func=cmd_config_validate)

    _add_bench_parser(sub)

    p = command("generate")
    from . import generate

    generate.add_arguments(p)
    p.set_defaults(func=lambda a: generate.run(a) and 0)

    p = command("tune", description="A bounded search over the registered methods and their main parameters on "
                                    "your text (or the bundled workloads): ranking with standard errors, the "
                                    "winning config (tune.toml), tune.json and a plot.")
    from .tune.cli import add_arguments as tune_arguments

    tune_arguments(p)
    p.set_defaults(func=cmd_tune)

    for name in ("serve", "chat"):  # parsed by kvcompress.mlxlm.commands (mlx-lm's flags pass through)
        command(name, add_help=False)

    p = command("doctor")
    from ._doctor import cmd_doctor

    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``kvcompress ARGV``; returns the exit status (130 after Ctrl-C, 141 when the reader of
    stdout went away, as ``kvcompress methods | head`` does; both quietly)."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a reader gone away shows here, not as an error at exit
        return status
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
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
