"""What ``kvcompress tune`` varies, defined once, and the candidates it builds from it.

:data:`SEARCH_SPACE` is keyed by component kind, component name and parameter. A registered
method is varied over a parameter only when it **uses that component** and **lists the
parameter among its defaults** (``MethodSpec.params``), so a new method built from these
components (a third-party plugin's included) is searched with no edit here; a method using
none of them is still tried at its defaults. A parameter two components of one method share
(``recent``: SnapKV's window and the selector's protected window) takes the values of the first
kind in ``scorer, selector, disposition, budget`` order that lists it, and is set as the flat
parameter the method's own defaults use (``--param recent=16``), so it reaches every component
that has it, as the method routes it.

Candidates (:class:`Candidate`) are a method plus flat parameter overrides; the budget is added
when a cache is built. The search order (:mod:`kvcompress.tune.search`):

1. every method at its defaults;
2. one-parameter changes, round-robin over the methods, the best (by their defaults' score)
   first;
3. per method, one ``combined`` candidate joining every change that helped on its own (each
   parameter at its best helping value), when at least two did.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import attrs

from kvcompress.components import KINDS

__all__ = ["SEARCH_SPACE", "Candidate", "method_space", "defaults", "one_parameter_changes", "combined"]

#: ``{kind: {component: {parameter: values}}}``. Values outside what a budget allows (a window
#: wider than the budget, ...) are skipped at build time with the ConfigError printed.
SEARCH_SPACE: dict[str, dict[str, dict[str, tuple]]] = {
    "scorer": {
        # SnapKV: re-scoring interval during decode (0 = prefill only), pooling kernel, window
        "snapkv": {
            "interval": (0, 1, 4, 16),
            "kernel": (1, 3, 7, 11),
            "recent": (8, 16, 32, 48),
            "pooling": ("max", "avg"),
        },
    },
    "selector": {
        # lowest-score selector: attention sinks, share of the budget kept as a recent window
        "lowest": {"n_sink": (0, 4, 8), "recent_ratio": (0.0, 0.25, 0.5, 0.75), "recent": (0, 8, 16)},
        # ChunkKV / tova_chunk: chunk size
        "chunk": {"chunk": (2, 5, 10, 20), "n_sink": (0, 4)},
        # AdaKV's head-wise selector (when its plugin is installed): per-head floor alpha x C
        "adaptive": {"alpha": (0.1, 0.2, 0.5)},
    },
    "disposition": {
        # CaM merge: how losers fold into survivors, the Bernoulli gate, attention-mass transfer
        "gated_merge": {
            "merge": ("sim_weighted", "mean", "drop"),
            "merge_gate": (True, False),
            "transfer_mass": (False, True),
        },
        # KIVI: bits of the quantized store
        "kivi_quant": {"bits": (2, 4)},
    },
    "budget": {
        # PyramidKV: top-to-bottom budget ratio of the linear pyramid
        "pyramid": {"beta": (2.0, 5.0, 20.0)},
        # SqueezeAttention: share kept by the squeezed (least important) layer cluster
        "squeeze": {"squeeze_ratio": (0.2, 0.4, 0.7)},
    },
}


@attrs.frozen
class Candidate:
    """A method and the flat parameters that differ from its defaults; ``stage`` is
    ``defaults``, ``one`` (one-parameter change) or ``combined``."""

    method: str
    params: dict = attrs.field(factory=dict, converter=dict)
    stage: str = "defaults"

    @property
    def label(self) -> str:
        if not self.params:
            return self.method
        return self.method + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in self.params.items())

    def config(self, budget: int) -> dict:
        """The method config (``make_prompt_cache(model, config=...)``) at ``budget``."""
        return {"method": self.method, "params": {"budget": int(budget), **self.params}}


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def method_space(spec, space: Optional[Mapping] = None) -> dict[str, tuple]:
    """``{parameter: values}`` a method (a ``MethodSpec``) is varied over: the entries of its
    components that it lists among its defaults (first kind listing a shared name wins)."""
    space = SEARCH_SPACE if space is None else space
    out: dict[str, tuple] = {}
    for kind in KINDS:
        for param, values in space.get(kind, {}).get(getattr(spec, kind), {}).items():
            if param in spec.params and param not in out:
                out[param] = tuple(values)
    return out


def defaults(registry, methods: Optional[Iterable[str]] = None) -> list[Candidate]:
    """Every method (``methods`` or every registered one, sorted) at its defaults."""
    names = list(methods) if methods else sorted(registry.methods)
    return [Candidate(n) for n in names]


def one_parameter_changes(spec, space: Optional[Mapping] = None) -> list[Candidate]:
    """The method's candidates that change one parameter from its default."""
    out = []
    for param, values in method_space(spec, space).items():
        for v in values:
            if not _same(v, spec.params[param]):
                out.append(Candidate(spec.name, {param: v}, "one"))
    return out


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and not isinstance(a, bool)
                                              and not isinstance(b, bool) and isinstance(b, (int, float))
                                              and float(a) == float(b))


def combined(method: str, base_score: float, tried: Iterable[tuple[Candidate, float]]) -> Optional[Candidate]:
    """One candidate joining the one-parameter changes of ``method`` that scored below
    ``base_score`` (lower is better), each parameter at its best value; None unless at least
    two parameters helped."""
    best: dict[str, tuple[float, Any]] = {}
    for cand, score in tried:
        if cand.method != method or cand.stage != "one" or score is None or not score < base_score:
            continue
        (param, value), = cand.params.items()
        if param not in best or score < best[param][0]:
            best[param] = (score, value)
    if len(best) < 2:
        return None
    return Candidate(method, {p: v for p, (_, v) in best.items()}, "combined")
