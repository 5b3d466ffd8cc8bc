"""The bounded search of ``kvcompress tune``: order, bounds, estimates, finalists, winner.

1. One untimed warm-up pass and one timed full-cache pass on the search items; the full cache's
   losses are the reference every candidate is paired with, its bytes per token the memory
   yardstick. The time estimate is printed before any candidate runs: the full-cache pass times
   :data:`COST_FACTOR` per candidate, plus the held-out phase.
2. Every method at its defaults; then a second estimate from their measured times.
3. One-parameter changes (:func:`~kvcompress.tune.space.one_parameter_changes`) of the methods
   that fit the memory budget, round-robin over the methods with the best defaults first (each
   method's first change, then each one's second, ...: a bounded run reaches every method);
   then one ``combined`` candidate per method (:func:`~kvcompress.tune.space.combined`), whose
   slots and time are kept back from the bounds (what they leave goes to the changes that waited).
4. The best ``finalists`` candidates and the full cache are measured again on the held-out
   items; the winner is the lowest held-out gap.

Memory is measured, not assumed: a candidate whose cache holds more than :data:`MEMORY_SLACK`
times the bytes of ``budget`` full-precision tokens (the full cache's measured bytes per token)
at the end of an item is marked over budget: its method gets no one-parameter changes, and it
cannot win unless ``allow_over``. ``candidates`` and ``max_seconds`` bound the run (the
held-out phase's estimated time is kept back from ``max_seconds``); what is left out is listed.
A candidate the budget cannot build (a ``ConfigError``: a window wider than the budget, ...) is
skipped with its error printed.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

from kvcompress.errors import KVCompressError

from .space import Candidate, combined, defaults, method_space, one_parameter_changes
from .workloads import Measurement, paired_gap

__all__ = ["MEMORY_SLACK", "COST_FACTOR", "run_search", "model_cache_factory"]

#: A candidate may hold up to this many times the bytes of ``budget`` full-precision tokens
#: (room for positions and scores, quantized stores, per-layer budgets) before it is "over".
MEMORY_SLACK = 2.0
#: Time of one candidate per full-cache pass, before any candidate is measured (compressed
#: caches score, select and evict: 1x-3.5x of the full cache on stories260K).
COST_FACTOR = 1.5


def model_cache_factory(model, registry=None, tokenizer=None) -> Callable[[Optional[dict]], Callable[[], list]]:
    """``factory(config)`` -> a function building a fresh prompt cache for ``model``: mlx-lm's
    full cache for ``None``, else ``kvcompress.make_prompt_cache(model, config=config,
    tokenizer=tokenizer)``."""

    def factory(config: Optional[dict]):
        if config is None:
            from mlx_lm.models.cache import make_prompt_cache as full_cache

            return lambda: full_cache(model)
        from kvcompress import make_prompt_cache

        return lambda: make_prompt_cache(model, config=config, registry=registry, tokenizer=tokenizer)

    return factory


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class _Bar:
    """A tqdm bar on stderr (or nothing) with a ``write`` that does not break it."""

    def __init__(self, total: int, enabled: bool, say: Callable[[str], None]):
        self.bar, self.say = None, say
        if enabled:
            from kvcompress.bench._report import progress_bar

            bar = progress_bar(total=total, desc="tune", unit="cand", leave=False)
            self.bar = bar if hasattr(bar, "update") else None

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            self.say(line)

    def step(self, label: str, best: Optional[str]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{label[:40]} | best {best or '-'}"[:80])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_search(workload, budget: int, *, registry=None, cache_factory=None, methods=None,
               candidates: int = 100, max_seconds: float = 600.0, finalists: int = 4,
               allow_over: bool = False, space=None, clock: Callable[[], float] = time.perf_counter,
               progress: bool = True, log: Optional[Callable[[str], None]] = None) -> dict:
    """Run the search on ``workload`` at ``budget``; return the results (see
    :mod:`kvcompress.tune.report` for what each key holds)."""
    from kvcompress import get_registry

    reg = registry or get_registry()
    factory = cache_factory or model_cache_factory(workload.model, reg, workload.tokenizer)
    say = log or (lambda line: print(line, file=sys.stderr))
    start = clock()
    queue = defaults(reg, methods)
    missing = [c for c in queue if reg.unavailable(c.method)]
    queue = [c for c in queue if c not in missing]
    n_search = len(_flat(workload, "search"))
    n_held = len(_flat(workload, "heldout"))

    workload.measure(factory(None), "warmup")
    full = workload.measure(factory(None), "search")
    token_bytes = full.nbytes / max(full.kept, 1.0)
    limit = MEMORY_SLACK * budget * token_bytes

    # the plan and the first estimate, before any candidate runs
    n_one = sum(len(one_parameter_changes(_spec(reg, c.method), space)) for c in queue)
    n_comb = sum(len(method_space(_spec(reg, c.method), space)) >= 2 for c in queue)
    planned = len(queue) + n_one + n_comb
    bounded = min(planned, candidates)
    per = full.seconds * COST_FACTOR

    def heldout_time(per_candidate: float) -> float:
        """The held-out phase: the full cache and the finalists (the current best candidates'
        own times once known: the slow ones often lead) on ``n_held`` items."""
        best = sorted((r for r in records if r.get("gap") is not None and (allow_over or not r["over"])),
                      key=lambda r: r["gap"])[:finalists]
        times = [r["seconds"] for r in best] + [per_candidate] * (finalists - len(best))
        return (full.seconds + sum(times)) * n_held / max(n_search, 1)

    records: list[dict] = []
    first = bounded * per + heldout_time(per)
    say(f"tune: {len(queue)} methods at budget {budget}; up to {planned} candidates ({len(queue)} defaults, "
        f"{n_one} one-parameter changes, {n_comb} combined), {bounded} within --candidates {candidates}")
    say(f"tune: full-cache pass {full.seconds:.1f} s x {COST_FACTOR:g} per candidate: about "
        f"{_minutes(first)} in all (bounded by --max-minutes {max_seconds / 60:g})")
    estimates = {"full_pass_seconds": full.seconds, "cost_factor": COST_FACTOR, "planned": planned,
                 "before_seconds": first}

    left_out = [{"label": c.label, "stage": c.stage, "why": reg.unavailable(c.method)} for c in missing]
    bar = _Bar(bounded, progress, say)
    state = {"stopped": None}

    def best_label() -> Optional[str]:
        ok = [r for r in records if r.get("gap") is not None and (allow_over or not r["over"])]
        return min(ok, key=lambda r: r["gap"])["label"] if ok else None

    def mean_seconds() -> float:
        times = [r["seconds"] for r in records if r.get("gap") is not None]
        return sum(times) / len(times) if times else per

    def run_one(cand: Candidate, cap: int = candidates, keep: int = 0, deferred: Optional[list] = None):
        """Measure ``cand`` unless a bound says no; past ``cap`` slots, or when the time of ``keep``
        more candidates would not fit (slots and time kept back for the combined candidates),
        it goes to ``deferred``, tried with what they leave over."""
        measured = sum(1 for r in records if "skipped" not in r)
        ahead = clock() - start + mean_seconds() + heldout_time(mean_seconds())
        why = state["stopped"]
        if why is None and measured >= candidates:
            why = state["stopped"] = f"--candidates {candidates} reached"
        elif why is None and ahead > max_seconds:
            why = state["stopped"] = f"--max-minutes {max_seconds / 60:g} reached"
        elif why is None and (measured >= cap or ahead + keep * mean_seconds() > max_seconds):
            deferred.append(cand)
            return None
        if why:
            left_out.append({"label": cand.label, "stage": cand.stage, "why": why})
            return None
        rec = _measure(workload, factory, cand, budget, full, limit, bar)
        records.append(rec)
        if "skipped" not in rec:
            bar.step(cand.label, best_label())
        return rec

    for cand in queue:
        run_one(cand)
    base = {r["method"]: r for r in records if r["stage"] == "defaults" and r.get("gap") is not None}
    order = sorted((r for r in base.values() if not r["over"]), key=lambda r: r["gap"])
    # round-robin over the methods, best defaults first: a bounded run tries every method's first
    # changes before any method's last (SEARCH_SPACE lists each component's main parameter first)
    lists = [one_parameter_changes(_spec(reg, r["method"]), space) for r in order]
    grid = [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]
    n_comb = sum(len(method_space(_spec(reg, r["method"]), space)) >= 2 for r in order)
    second = mean_seconds() * min(len(grid) + n_comb, max(candidates - len(base), 0)) + heldout_time(mean_seconds())
    estimates.update(after_defaults_seconds=second, defaults_mean_seconds=mean_seconds())
    bar.write(
        f"tune: defaults done in {_minutes(clock() - start)}; {len(grid)} one-parameter changes and up to "
        f"{n_comb} combined left: about {_minutes(second)} more")
    # slots and time for the combined candidates are kept back from the bounds; one-parameter
    # changes past them wait, and run in what the combined candidates leave unused
    deferred: list[Candidate] = []
    for cand in grid:
        run_one(cand, cap=max(candidates - n_comb, len(base)), keep=n_comb, deferred=deferred)
    for r in order:
        tried = [(Candidate(x["method"], x["params"], x["stage"]), x.get("gap")) for x in records]
        cand = combined(r["method"], r["gap"], tried)
        if cand is not None:
            run_one(cand)
    for cand in deferred:
        run_one(cand)
    bar.close()
    if left_out:
        why = "; ".join(sorted({x["why"] for x in left_out}))
        say(f"tune: {len(left_out)} candidates left out ({why})")

    # finalists on held-out items
    ok = [r for r in records if r.get("gap") is not None and (allow_over or not r["over"])]
    if not ok:
        raise ValueError(_nothing_to_rank(records, left_out, budget, full.seconds))
    chosen = sorted(ok, key=lambda r: r["gap"])[:finalists]
    say(f"tune: re-measuring {len(chosen)} finalists and the full cache on {n_held} held-out items")
    full_held = workload.measure(factory(None), "heldout")
    finals = []
    for r in chosen:
        m = workload.measure(factory(Candidate(r["method"], r["params"]).config(budget)), "heldout")
        gap, se = paired_gap(m.losses, full_held.losses)
        finals.append({"label": r["label"], "method": r["method"], "params": r["params"], "search_gap": r["gap"],
                       "gap": gap, "se": se, "ratio": workload.ratio(gap), "nbytes": m.nbytes,
                       "over": r["over"], "seconds": round(m.seconds, 3)})
    winner = min(finals, key=lambda f: f["gap"])
    return {
        "budget": budget, "memory_slack": MEMORY_SLACK, "token_bytes": token_bytes, "memory_limit": limit,
        "allow_over": allow_over,
        "full": _full_record(full), "full_heldout": _full_record(full_held),
        "estimates": estimates, "candidates": records, "left_out": left_out,
        "stopped": state["stopped"], "finalists": finals, "winner": winner,
        "config": Candidate(winner["method"], winner["params"]).config(budget),
        "seconds_total": round(clock() - start, 1),
    }


def _nothing_to_rank(records: list, left_out: list, budget: int, full_seconds: float) -> str:
    """Why no candidate can win, each cause counted with what to change (one line)."""
    over = [r for r in records if r.get("gap") is not None]  # measured: all over, or one would win
    skipped = [r for r in records if "skipped" in r]
    failed = [r for r in records if r.get("error")]
    parts = []
    if over:
        parts.append(f"{len(over)} measured over the memory budget ({MEMORY_SLACK:g} x {budget} full-precision "
                     "tokens: raise --budget or pass --allow-over-budget)")
    if skipped:
        parts.append(f"{len(skipped)} skipped because budget {budget} cannot build them (first: "
                     f"{skipped[0]['label']}: {skipped[0]['skipped']}; raise --budget)")
    if failed:
        parts.append(f"{len(failed)} failed (first: {failed[0]['label']}: {failed[0]['error']})")
    whys: dict[str, int] = {}
    for x in left_out:
        whys[x["why"]] = whys.get(x["why"], 0) + 1
    for why, n in whys.items():
        hint = (f"; the full-cache pass alone took {full_seconds:.1f} s: raise --max-minutes"
                if why.startswith("--max-minutes") else
                "; raise --candidates" if why.startswith("--candidates") else "")
        parts.append(f"{n} left out ({why}{hint})")
    return "no candidate to rank: " + "; ".join(parts or ["no method to try"])


def _spec(reg, name: str):
    return reg.method(name)


def _flat(workload, split: str) -> list:
    items = workload.items[split]
    return [x for v in items.values() for x in v] if isinstance(items, dict) else list(items)


def _full_record(m: Measurement) -> dict:
    return {"loss": float(m.losses.mean()), "losses": [float(x) for x in m.losses], "nbytes": m.nbytes,
            "kept": m.kept, "seconds": round(m.seconds, 3)}


def _measure(workload, factory, cand: Candidate, budget: int, full: Measurement, limit: float, bar) -> dict:
    rec: dict[str, Any] = {"label": cand.label, "method": cand.method, "params": dict(cand.params),
                           "stage": cand.stage}
    try:
        m = workload.measure(factory(cand.config(budget)), "search")
    except KVCompressError as exc:  # the budget cannot build it: skipped, said why
        rec["skipped"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        bar.write(f"tune: skipped {cand.label}: {rec['skipped']}")
        return rec
    except Exception as exc:  # a method failing on this model must not end the search
        rec.update(error=f"{type(exc).__name__}: {' '.join(str(exc).split())}", gap=None, over=False)
        bar.write(f"tune: {cand.label} failed: {rec['error']}")
        return rec
    gap, se = paired_gap(m.losses, full.losses)
    rec.update(gap=gap, se=se, ratio=workload.ratio(gap), loss=float(m.losses.mean()),
               losses=[float(x) for x in m.losses], nbytes=m.nbytes, kept=m.kept,
               bytes_vs_budget=m.nbytes / (limit / MEMORY_SLACK) if limit else None,
               over=bool(m.nbytes > limit), seconds=round(m.seconds, 3))
    return rec
