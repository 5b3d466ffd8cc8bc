"""Batch edits of engines: rows taken, laid out and concatenated (mlx-lm's ``BatchKVCache``
protocol: ``merge`` / ``extract`` / ``filter`` / ``extend``, and a prompt's padding).

Every edit is the same three moves over the parts: the host facts (:class:`Rows`
``take`` / ``concat``), the slots (:class:`Slots` ``take_rows`` / ``laid_out`` /
``set_layouts``: each row laid out in a common width, held slots last and empty slots first,
then stacked along the batch axis), and the component states (their ``take_rows`` /
``stack_rows`` hooks). A row moved this way continues exactly as it would
have where it was.
"""

from __future__ import annotations


from .. import _state
from ..components import KINDS
from ..errors import ConfigError
from ..group import join
from .engine import Engine
from .rows import Rows

__all__ = ["check_same", "extract", "filter_rows", "extend", "merge", "prepare", "finalize"]


def check_same(a, b) -> None:
    """Refuse to batch ``b`` with ``a`` unless both are engines of one method and layer."""
    if not isinstance(b, Engine):
        raise ConfigError(f"cannot batch a kvcompress cache with a {type(b).__name__}")
    if a.method.config != b.method.config or a.info != b.info:
        raise ConfigError(
            f"cannot batch caches of different methods or layers: {a.method.describe()} (layer "
            f"{a.info.layer}) vs {b.method.describe()} (layer {b.info.layer})"
        )


def _layouts(caches: list, width: int) -> list:
    """Every cache's rows laid out in ``width`` columns (empty caches as empty rows)."""
    like = next((c._slots for c in caches if c.keys is not None), None)
    if like is None:
        return []
    return [c._slots.laid_out(width) if c.keys is not None else like.empty_layout(max(len(c._rows), 1), width)
            for c in caches]


def _take_states(e: Engine, rows: list) -> dict:
    return {kind: _state.take_rows(e.method.component(kind), e._hooks.of(kind).take_rows, e._states[kind], rows)
            for kind in KINDS}


def _stack_states(first: Engine, caches: list, empty_as_row: bool) -> dict:
    counts = [max(len(c._rows), 1) if empty_as_row else len(c._rows) for c in caches]
    return {kind: _state.stack_rows(first.method.component(kind), first._hooks.of(kind).stack_rows,
                                    [c._states[kind] for c in caches], counts)
            for kind in KINDS}


def extract(e: Engine, idx: int, single: type) -> Engine:
    """Row ``idx`` of ``e`` as a new ``single`` cache that continues exactly as this row would."""
    group = join(f"extract:{e.group.id}:{idx}", e.info.layer)
    c = single(e.method, e._rows.budget[idx], info=e.info, group=group)
    c._rows = e._rows.take([idx])
    c._rows.pad = c._rows.pending = c._rows.right = None
    c._rounds, c._query_steps, c._proxy_steps = e._rounds, e._query_steps, e._proxy_steps
    c._io_seen, c._restored = e._io_seen, e._restored
    c._passes, c._pass_seconds = e._passes, e._pass_seconds
    c._states.update(_take_states(e, [idx]))
    c._slots = e._slots.take_rows([idx])
    if e.keys is not None:
        c._slots.compacted_row(e._rows.held[idx])
    return c


def filter_rows(e: Engine, rows: list) -> None:
    """Keep only ``rows`` of ``e``, in that order (a prompt in progress keeps their padding)."""
    e._states.update(_take_states(e, rows))
    taken = e._rows.take(rows)
    width = max(taken.held, default=0)
    parts = [e._slots.take_rows(rows).laid_out(width)] if e.keys is not None else []
    e._rows = taken
    e._slots.set_layouts(parts, width)
    e._undo = None


def extend(e: Engine, other: Engine) -> None:
    """Append the rows of ``other`` to ``e``."""
    check_same(e, other)
    caches = [e, other]
    e._states.update(_stack_states(e, caches, empty_as_row=False))
    rows = Rows.concat([c._rows for c in caches], e._rows.default_budget)
    width = max(e._slots.n, other._slots.n)
    parts = _layouts(caches, width)
    e._rows = rows
    e._slots.set_layouts(parts, width)
    e._rounds = max(e._rounds, other._rounds)
    e._passes = max(e._passes, other._passes)
    e._pass_seconds += other._pass_seconds
    e._undo = None


def merge(batch: type, caches: list) -> Engine:
    """One ``batch`` cache whose rows are the given caches' rows, in order."""
    first = caches[0]
    for c in caches:
        check_same(first, c)
    key = "merge:" + ",".join(c.group.id for c in caches)
    out = batch(first.method, first._rows.default_budget, [], info=first.info, group=join(key, first.info.layer))
    out._states.update(_stack_states(first, caches, empty_as_row=True))
    width = max(c._slots.n for c in caches)
    out._rows = Rows.concat([c._rows for c in caches], first._rows.default_budget, empty_as_row=True)
    out._slots.g = max(c._slots.g for c in caches)
    out._slots.set_layouts(_layouts(caches, width), width)
    out._rounds = max(c._rounds for c in caches)
    out._query_steps = sum(c._query_steps for c in caches)
    out._proxy_steps = sum(c._proxy_steps for c in caches)
    out._io_seen = all(c._io_seen for c in caches)
    out._restored = any(c._restored for c in caches)
    out._passes = max(c._passes for c in caches)  # each row's own count is in Rows.passed
    out._pass_seconds = sum(c._pass_seconds for c in caches)
    return out


def prepare(e: Engine, left_padding=None, lengths=None, right_padding=None) -> None:
    """Before a prompt step: left padding (empty cache only) or the right padding of a
    right-padded prompt (``lengths`` real tokens per row; the rest become empty slots)."""
    if left_padding is not None:
        if e.keys is not None:
            raise ValueError("Left padding can only be added to an empty BatchCompressedKVCache")
        e._rows.offset = [o - int(p) for o, p in zip(e._rows.offset, left_padding)]
    if right_padding is not None and max(right_padding) > 0:
        e._rows.pending = [int(x) for x in lengths]
        e._rows.right = [int(x) for x in right_padding]


def finalize(e: Engine) -> None:
    """After a right-padded prompt: offsets count real tokens only."""
    e._rows.finalize()
