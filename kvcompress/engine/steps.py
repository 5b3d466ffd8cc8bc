"""The engine's input checks, exact trims and ``state`` (mlx-lm protocol)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import mlx.core as mx

from .. import _state
from ..errors import ConfigError, KVCompressError
from .rows import Rows
from .slots import Slots
from ..storage import dtype_name, from_state, to_state

STATE_VERSION = 2


class _StateMixin:
    def _refuse_step(self, b: int, S: int):
        """Refuse, before anything changes, a step the cache could only take differently from an
        uninterrupted run; returns the step's token ids for scorers that require them (else None).

        * a forward that left some of the prompt's layers behind (a cache list with more layers
          than the model runs: checked at the prompt's first layer);
        * a scorer with scoring passes or token ids, called without the model hook that provides
          them (e.g. a cache loaded in a fresh process and used with ``model(...)`` directly);
        * a restored cache whose budget measures the prompt's layer input/output
          (SqueezeAttention), about to see its prompt in a model that does not route them.
        """
        if self.group.first == self.info.layer:
            self.group.check_aligned(self)
        hooked, self._hooked = self._hooked, False
        if self._has_passes and not self._wants_tokens and not hooked:
            raise KVCompressError(self._unhooked("runs scoring passes before each model call"))
        if self._restored and self.wants_layer_io() and self._io_input is None:
            raise KVCompressError(
                f"budget {type(self.method.budget).__name__} measures each layer's input and attention "
                "output in the prompt's first forward, but this model does not route them to the cache "
                "(e.g. a cache loaded in a fresh process): call kvcompress.install(model) before using it "
                "(mlx_lm.generate and BatchGenerator do it themselves); the cache is unchanged"
            )
        if not self._wants_tokens:
            return None
        tok, self._tokens = self._tokens, None
        if tok is not None and tuple(tok.shape) == (b, S):
            return tok
        if hooked or tok is not None:
            raise KVCompressError(
                f"scorer {type(self.method.scorer).__name__} needs the step's token ids, but the model was "
                "called with input embeddings (or ids of another shape); call it with token ids; the cache "
                "is unchanged"
            )
        raise KVCompressError(self._unhooked("needs the step's token ids"))

    def _unhooked(self, what: str) -> str:
        return (
            f"scorer {type(self.method.scorer).__name__} {what}, but the model was called without "
            "kvcompress's model hook (e.g. a cache loaded in a fresh process and used with model(...) "
            "directly): call kvcompress.install(model) first (make_prompt_cache does it; mlx_lm.generate "
            "and BatchGenerator do it themselves); the cache is unchanged"
        )

    def _check_input(self, keys, values):
        if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
            raise TypeError("update_and_fetch expects mx.array keys and values")
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(f"keys/values must be [B, H_kv, S, D]; got shapes {keys.shape} and {values.shape}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on [B, H_kv, S]")
        if not mx.issubdtype(keys.dtype, mx.floating) or keys.dtype != values.dtype:
            raise TypeError(f"keys/values must share a floating dtype; got {keys.dtype}, {values.dtype}")
        if self._rows.held and keys.shape[0] != len(self._rows.held):
            raise ValueError(f"keys have {keys.shape[0]} rows but the cache holds {len(self._rows.held)}")
        if self.keys is not None:
            if keys.shape[1] != self.keys.shape[1] * max(self._slots.g, 1) or keys.shape[3] != self.keys.shape[3] or (
                values.shape[3] != self.values.shape[3]
            ):
                raise ValueError(
                    f"keys {keys.shape} do not match the cache's [B, H_kv, *, D] = "
                    f"{self.keys.shape[:2] + (self.keys.shape[3],)}"
                )
            if keys.dtype != self.keys.dtype:
                raise TypeError(f"keys dtype {keys.dtype} does not match the cache's {self.keys.dtype}")

    def is_trimmable(self) -> bool:
        """True: the last step's tokens can always be trimmed exactly (see :meth:`trim`)."""
        return True

    def can_trim(self, n: int) -> bool:
        """Whether :meth:`trim` can remove the last ``n`` tokens exactly."""
        if n <= 0 or self.keys is None:
            return True
        if self._undo is None:
            return False
        S, valid, _, _, queries, _, _ = self._undo
        if n > S or any(x != S for x in valid):
            return False
        if self._undo_predictions is False and n < S:
            return False
        return queries is not None or not self._needs_queries or n == S

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens exactly, as if they had never been seen.

        Eviction is deferred and its count does not depend on the step's size, so the tokens of
        the last step can leave exactly: their slots are freed, and the scores are those of the
        remaining tokens' queries. Anything older cannot be undone; that raises before anything
        changes.
        """
        if n <= 0 or self.keys is None:
            return 0
        if not self.can_trim(n):
            last = 0 if self._undo is None else self._undo[0]
            raise KVCompressError(
                f"cannot trim {n} token(s) exactly from a compressed cache: only the last step's "
                f"{last} token(s) can be removed (older tokens already shaped evictions and scores)"
            )
        S, valid, qpos, (scores, sstate), queries, scale, proxy = self._undo
        keep = S - n
        self._plan.clear()  # planned for a cache that no longer exists
        self._slots.drop_last(n * self._slots.g, scores)
        self._rows.rewind(n, self._slots.g)
        self._states["scorer"] = sstate
        self._slots.observed = None  # what the restored state saw is not what is stored now
        self._undo = None
        if not keep:  # the whole step leaves: so does its observation
            if proxy:
                self._proxy_steps -= 1
            else:
                self._query_steps -= 1
        tokens, self._undo_tokens = getattr(self, "_undo_tokens", None), None
        if keep:
            self._pending = (keep, [keep] * len(self._rows.held), None)
            self._step_tokens = None if tokens is None else tokens[:, :keep]
            pred, self._undo_predictions = self._undo_predictions, None
            self._score_step(queries[:, :, :keep] if queries is not None else None, scale, proxy=False)
            if pred:
                self.observe_predictions(pred.truncated(keep))
        else:
            self._undo_predictions = None
        return n

    def _meta(self) -> dict:
        comp, n_arrays, arrays = {}, {}, []
        for kind in ("scorer", "selector", "disposition", "budget"):
            meta, arrs = _state.flatten_state(self._states[kind])
            comp[kind] = meta
            n_arrays[kind] = len(arrs)
            arrays += arrs
        return {
            "version": STATE_VERSION,
            "config": self.method.config.to_dict(),
            "info": attrs.asdict(self.info),
            "budget": self._rows.default_budget,
            "group": self.group.id,
            "n": self._slots.n,
            "g": self._slots.g,
            **self._rows.to_meta(),
            "rounds": self._rounds,
            "query_steps": self._query_steps,
            "proxy_steps": self._proxy_steps,
            "unreduced": self._unreduced,
            "components": comp,
            "n_component_arrays": n_arrays,
            # only caches that ran scoring passes: other methods' files keep their format
            **({"passes": {"count": self._passes, "rows_tokens": self._rows.passed, "seconds": self._pass_seconds}}
               if self._passes else {}),
            # low-bit storage only (float files keep their format): the stored vectors' dtype
            **({"kv_dtype": dtype_name(self.keys.dtype)}
               if self._store.quantized and self.keys is not None else {}),
        }, arrays

    @property
    def state(self):
        meta, extra = self._meta()
        text = json.dumps(meta)
        if self.keys is None:
            return [*extra, text]
        k, v = self.keys_and_values()
        return [*extra, to_state(k), to_state(v), self._slots.pos, self._slots.score, text]

    @state.setter
    def state(self, v):
        *arrays, text = v
        m = json.loads(text)
        if m.get("version") != STATE_VERSION:
            raise ConfigError(f"unsupported kvcompress cache state version {m.get('version')!r} (expected {STATE_VERSION})")
        n_extra = sum(m["n_component_arrays"].values())
        extra, arrays = arrays[:n_extra], arrays[n_extra:]
        i = 0
        for kind in ("scorer", "selector", "disposition", "budget"):
            k = m["n_component_arrays"][kind]
            comp = self.method.component(kind)
            self._states[kind] = _state.restore_state(comp, m["components"][kind], extra[i : i + k])
            i += k
        slots = self._slots = Slots()  # (nothing is known about what changed since an eviction)
        if arrays:
            k, v, pos, score = arrays
            st, dtype = self._store, m.get("kv_dtype")
            slots.keys = from_state(k, st.k_bits, st.group_size, dtype)
            slots.values = from_state(v, st.v_bits, st.group_size, dtype)
            slots.pos, slots.score = pos.astype(mx.int32), score.astype(mx.float32)
        slots.n = int(m["n"])
        slots.g = int(m.get("g", 0))
        self._rounds = int(m["rounds"])
        self._query_steps, self._proxy_steps = int(m["query_steps"]), int(m["proxy_steps"])
        self._unreduced = bool(m.get("unreduced", False)) and self._reduce
        passes = m.get("passes") or {}
        self._passes, self._pass_seconds = int(passes.get("count", 0)), float(passes.get("seconds", 0.0))
        self._rows = Rows.from_meta(m, int(m["budget"]), passes.get("rows_tokens"))
        self._pending = self._undo = None

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, v):
        pass  # everything lives in ``state``

    def component_state(self, kind: str) -> Any:
        """The state of this cache's ``kind`` component (immutable by convention: replace it)."""
        return self._states[kind]

    def set_component_state(self, kind: str, state: Any) -> None:
        """Replace the ``kind`` component's state (what its ``bind`` hook returned, at build)."""
        self._states[kind] = state
        if kind == "scorer":
            self._slots.observed = None

    def __deepcopy__(self, memo):
        """A copy that continues exactly like the original; copies of a prompt's caches made in
        one ``deepcopy`` share one new group."""
        import copy

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        new.group.add(new.info.layer, new)
        return new

