"""The method-agnostic engine behind the cache classes: one :class:`Engine` per layer, which
alone sequences a step (evict -> store -> attend -> observe) over parts that own their data.

* :mod:`.engine` -- ``Engine``: the step itself, over the parts;
* :mod:`.rows` -- ``Rows``: per-row host bookkeeping and the one rule for how many slots leave;
* :mod:`.slots` -- ``Slots``: keys, values, positions and scores on the device, every layout op;
* :mod:`.plan` -- ``PlannedEviction``: the next decode step's eviction, chosen a step early;
* :mod:`.attend` -- attention over the slots and the scorer's observation;
* :mod:`.passes` -- scoring passes (the whole model run against the cache, nothing stored);
* :mod:`.steps` -- input checks, exact trims and ``state`` (save / load);
* :mod:`.batching` -- merge / extract / filter / extend: the parts taken and stacked by row;
* :mod:`.report` -- read-only views, sizes and diagnostics.

Nothing here imports :mod:`kvcompress.mlxlm`: the glue registers itself
(:func:`engine.before_update`). Code outside this package uses only the engine's public names
(``docs/architecture.md``).
"""

from .engine import Engine
from .plan import PlannedEviction
from .rows import Rows, room_to_evict
from .slots import Slots

__all__ = ["Engine", "PlannedEviction", "Rows", "Slots", "room_to_evict"]
