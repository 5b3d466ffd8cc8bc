"""The method-agnostic engine behind the cache classes: one :class:`Engine` per layer, which
alone sequences a step (evict -> store -> attend -> observe) over parts that own their data.

* :mod:`.rows` -- ``Rows``: per-row host bookkeeping and the one rule for how many slots leave;
* :mod:`.engine` -- ``Engine``: the slots on the device and the step itself;
* :mod:`.attend` -- attention over the slots and the scorer's observation;
* :mod:`.plan` -- planned evictions (chosen at the end of the step before);
* :mod:`.passes` -- scoring passes (the whole model run against the cache, nothing stored);
* :mod:`.steps` -- input checks, exact trims and ``state`` (save / load);
* :mod:`.report` -- read-only views and diagnostics.

Nothing here imports :mod:`kvcompress.mlxlm`: the glue registers itself
(:data:`engine.BEFORE_UPDATE`). Code outside this package uses only the engine's public names.
"""

from .engine import Engine
from .rows import Rows, room_to_evict

__all__ = ["Engine", "Rows", "room_to_evict"]
