"""Reusable contract tests for kvcompress components and methods, built-in or third-party.

Check one component against its kind's protocol, or a whole method inside real mlx-lm
generation on a tiny random Llama::

    from kvcompress.testing import check_scorer, check_method

    def test_my_scorer():
        check_scorer("knorm")        # a registered name, or a ComponentSpec

    def test_my_method():
        check_method("knorm")        # a registered name, a config dict or a MethodConfig

Each ``check_*`` raises :class:`ContractFailure` (an ``AssertionError``) naming the contract it
broke, and returns a :class:`ContractReport` of the checks that passed and those that did not
apply. What is checked:

* per component, on seeded synthetic contexts built as the engine builds them (GQA, batch 2,
  shuffled slot order, float32 / float16 / bfloat16, and rows of different lengths with empty
  slots, right padding and per-row eviction counts): the record, defaults, frozen attrs class,
  protocol, capabilities, JSON-serialisable parameters, the kind's own rules -- each batch row
  handled as it is alone, empty slots never selected or merged into, a selector's per-row
  choice in priority order -- and the optional hooks the component declares (a state from
  ``init_state`` survives ``cache.state``, deep copies and batch-row splits and merges; see
  :mod:`kvcompress._contracts.units`);
* then, unless ``run=False``, the component composed with the baseline parts
  (:data:`BASELINE`: ``h2o`` / ``lowest`` / ``drop`` / ``uniform``) runs the method contracts;
* per method, through :func:`mlx_lm.generate.generate_step` with chunked prefill and greedy
  decode: the budget rule at every step, positions, protected tokens (sinks) kept, real-query
  float32 scores, honest ``nbytes``, exact equality with ``KVCache`` when nothing is evicted,
  determinism, no NaN in float16, save/load round trip with identical continued decoding,
  batched generation (mlx-lm's ``BatchGenerator``, rows of different lengths) equal to each
  row's solo run, and the config's JSON round trip (see :mod:`kvcompress._contracts.runs`).

A whole plugin in one parametrized test (no pytest plugin needed)::

    import pytest
    from kvcompress.testing import contract_cases

    @pytest.mark.parametrize("case", contract_cases(dist="kvcompress-knorm"), ids=str)
    def test_contract(case):
        case.check()

Opt-in pytest plugin: put ``pytest_plugins = ["kvcompress.testing"]`` in your root
``conftest.py``; every test taking a ``contract_case`` argument is then parametrized over the
registered components and methods, filtered by the marker
``@pytest.mark.kvcompress_contracts(dist=..., kinds=..., names=...)`` (or, when the plugin is
declared in the test module itself, by a module-level ``kvcompress_contracts = dict(dist=...)``,
since markers are evaluated before a module's plugins register them).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional, Union

import attrs

from ._contracts import ContractFailure, ContractReport, fail
from ._contracts.generation import tiny_llama
from ._contracts.runs import RunSettings, check_method_runs, method_subject
from ._contracts.unit_kinds import UNIT_CHECKS
from ._contracts.units import check_spec
from .components import KINDS, ComponentSpec
from .errors import KVCompressError
from .hookspecs import hookimpl
from .method import build_method
from .registry import Registry, get_registry

__all__ = [
    "BASELINE",
    "ContractCase",
    "ContractFailure",
    "ContractReport",
    "check_budget",
    "check_component",
    "check_disposition",
    "check_method",
    "check_scorer",
    "check_selector",
    "contract_cases",
    "tiny_llama",
    "use_registry",
]

#: The parts a component under test is composed with for its generation run.
BASELINE = {"scorer": "h2o", "selector": "lowest", "disposition": "drop", "budget": "uniform"}

_HOOKS = {
    "scorer": "kvcompress_scorers",
    "selector": "kvcompress_selectors",
    "disposition": "kvcompress_dispositions",
    "budget": "kvcompress_budgets",
}


@contextlib.contextmanager
def use_registry(registry: Optional[Registry]):
    """Make ``registry`` the process-wide one for the duration (``load_prompt_cache`` rebuilds
    methods from the process-wide registry)."""
    from . import registry as _reg

    if registry is None or registry is _reg._DEFAULT:
        yield registry or get_registry()
        return
    with _reg._LOCK:
        saved, _reg._DEFAULT = _reg._DEFAULT, registry
    try:
        yield registry
    finally:
        with _reg._LOCK:
            _reg._DEFAULT = saved


def _registry_with(spec: ComponentSpec, registry: Optional[Registry]) -> Registry:
    """``registry`` (default: the process-wide one) if it holds ``spec``; else a copy that adds it
    through an in-process plugin, so an unregistered spec can be checked before it is packaged."""
    reg = registry or get_registry()
    table = reg.components[spec.kind]
    if spec.name in table and table[spec.name].spec == spec:
        return reg
    if spec.name in table:
        raise ContractFailure(
            f"{spec.kind} {spec.name!r} under test differs from the registered one "
            f"({table[spec.name].provider}); rename it or pass registry="
        )

    class _UnderTest:
        pass

    setattr(_UnderTest, _HOOKS[spec.kind], staticmethod(hookimpl(lambda: [spec])))
    return Registry(plugins=[("contract_under_test", _UnderTest)])


def check_component(
    kind: str,
    component: Union[str, ComponentSpec],
    *,
    registry: Optional[Registry] = None,
    compose: Optional[dict] = None,
    run: bool = True,
    budget: Optional[int] = None,
    decode: int = 8,
    atol: float = 1e-6,
    seed: int = 0,
    **params: Any,
) -> ContractReport:
    """Check a component of ``kind`` (a registered name or a :class:`ComponentSpec`).

    ``compose`` overrides parts of :data:`BASELINE` for the generation run (e.g. a disposition
    that requires a capability the baseline scorer lacks); ``params`` are flat method parameters
    for that run, and those the component has also configure it for the unit checks;
    ``run=False`` checks the component alone.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    reg = registry or get_registry()
    if isinstance(component, str):
        try:
            spec = reg.component(kind, component)
        except KVCompressError as exc:
            raise ContractFailure(f"{kind} {component!r}: not registered: {exc}") from exc
    else:
        spec = component
    subject = f"{kind} {spec.name!r}"
    report = ContractReport(subject)
    if spec.kind != kind:
        raise fail(subject, "record", f"the record's kind is {spec.kind!r}, not {kind!r}")
    reg = _registry_with(spec, reg)
    comp = check_spec(spec, report)
    own = {k: v for k, v in params.items() if k in spec.params()}
    if own:  # the unit checks run the configuration asked for, not only the defaults
        from .config import structure_component

        try:
            comp = structure_component(spec, own)
        except KVCompressError as exc:
            raise fail(subject, "parameters", str(exc)) from exc
        report.details["unit_params"] = own
    UNIT_CHECKS[kind](comp, report, seed)
    if not run:
        return report
    config = {**BASELINE, **(compose or {}), kind: spec.name}
    sub = _check_method(config, f"{subject} composed as {config}", reg, params,
                        RunSettings(budget=budget, decode=decode, atol=atol, seed=seed))
    report.merge(sub, prefix="run: ")
    report.details.update(sub.details)
    return report


def check_scorer(scorer: Union[str, ComponentSpec], **kw) -> ContractReport:
    """:func:`check_component` for a scorer."""
    return check_component("scorer", scorer, **kw)


def check_selector(selector: Union[str, ComponentSpec], **kw) -> ContractReport:
    """:func:`check_component` for a selector."""
    return check_component("selector", selector, **kw)


def check_disposition(disposition: Union[str, ComponentSpec], **kw) -> ContractReport:
    """:func:`check_component` for a disposition."""
    return check_component("disposition", disposition, **kw)


def check_budget(budget: Union[str, ComponentSpec], **kw) -> ContractReport:
    """:func:`check_component` for a budget."""
    return check_component("budget", budget, **kw)


def check_method(
    method: Any,
    *,
    registry: Optional[Registry] = None,
    budget: Optional[int] = None,
    decode: int = 8,
    atol: float = 1e-6,
    seed: int = 0,
    **params: Any,
) -> ContractReport:
    """Check a method (a registered name, a config dict or a :class:`~kvcompress.MethodConfig`)
    inside mlx-lm generation on a tiny random Llama.

    ``budget=None`` picks the smallest budget that leaves 4 evictable slots in every layer;
    the prompt is then about twice that long, prefilled in chunks of half the budget, followed by
    ``decode`` greedy steps. ``atol`` bounds the log-probability difference from ``KVCache``
    when nothing is evicted. ``params`` are flat method parameters.
    """
    return _check_method(method, method_subject(method), registry or get_registry(), params,
                         RunSettings(budget=budget, decode=decode, atol=atol, seed=seed))


def _check_method(config, subject: str, reg: Registry, params: dict, settings: RunSettings) -> ContractReport:
    report = ContractReport(subject)
    try:
        method = build_method(config, registry=reg, **params)
    except KVCompressError as exc:
        raise fail(subject, "composition", f"{type(exc).__name__}: {exc}") from exc
    report.ok("composition")
    with use_registry(reg):
        check_method_runs(config, method, report, settings, reg, params)
    return report


# ------------------------------------------------------------------------------------------------
# Cases: iterate a registry
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class ContractCase:
    """One registered component (``kind`` in :data:`~kvcompress.components.KINDS`) or method
    (``kind == "method"``) to check; ``str(case)`` is its pytest id, e.g. ``"scorer:h2o"``."""

    kind: str
    name: str
    dist: str = ""

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.name}"

    def __str__(self) -> str:
        return self.id

    def check(self, **kw) -> ContractReport:
        if self.kind == "method":
            return check_method(self.name, **kw)
        return check_component(self.kind, self.name, **kw)


def contract_cases(
    registry: Optional[Registry] = None,
    dist: Optional[Union[str, Iterable[str]]] = None,
    kinds: Optional[Iterable[str]] = None,
    names: Optional[Iterable[str]] = None,
) -> list[ContractCase]:
    """Every registered component and method, optionally only those of distribution(s) ``dist``
    (e.g. ``"kvcompress"`` for the built-ins, ``"kvcompress-knorm"``), of ``kinds`` (component
    kinds and/or ``"method"``) or called ``names``."""
    reg = registry or get_registry()
    dists = {dist} if isinstance(dist, str) else (set(dist) if dist is not None else None)
    kinds = set(kinds) if kinds is not None else None
    names = set(names) if names is not None else None
    tables = [(k, reg.components[k]) for k in KINDS] + [("method", reg.methods)]
    out = []
    for kind, table in tables:
        for name, prov in sorted(table.items()):
            if (dists is None or prov.dist in dists) and (kinds is None or kind in kinds) and (
                names is None or name in names
            ):
                out.append(ContractCase(kind, name, prov.dist))
    return out


# ------------------------------------------------------------------------------------------------
# Opt-in pytest plugin: pytest_plugins = ["kvcompress.testing"]
# ------------------------------------------------------------------------------------------------

_MARKER = "kvcompress_contracts"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(dist=None, kinds=None, names=None): which registered components/methods a test "
        "taking a `contract_case` argument is parametrized over (kvcompress.testing)",
    )


def pytest_generate_tests(metafunc) -> None:
    """Parametrize a ``contract_case`` argument; the filter comes from the test's
    ``kvcompress_contracts`` marker, else from a ``kvcompress_contracts = {...}`` dict in its
    module (usable where the plugin is only registered by that module)."""
    if "contract_case" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker(_MARKER)
    if marker is not None:
        kw = dict(marker.kwargs)
    else:
        kw = dict(getattr(metafunc.module, _MARKER, None) or {})
    cases = contract_cases(**kw)
    metafunc.parametrize("contract_case", cases, ids=[c.id for c in cases])
