"""What the tier's vLLM keys name: the engine and file of each offload key, the off-thread probes of files the
index does not know, the KV events of files stored and removed, and the recency a finished request refreshes.
A mixin of :class:`~kvformat.vllm._tier.KVFormatTier`, which sets every attribute declared here."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality, Medium, OffloadingEvent, OffloadKey, ReqContext, get_offload_block_hash, get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from ..cache import Job, LRUIndex, RowEngine
from ..format import block_path_parts
from ._tokens import TokenNames

# vLLM 0.34 added ``req_context`` to OffloadingEvent (0.33's tracker takes request data from the scheduler
# instead); fields are probed, not versions compared.
_EVENT_TAKES_REQ_CONTEXT = "req_context" in getattr(OffloadingEvent, "__dataclass_fields__", {})


class Lookups(AsyncLookupManager):
    """Existence checks of blocks the index does not know (written by another instance), off-thread."""

    def __init__(self, tier: "TierKeys", tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._probe_many(keys, req_context)


class TierKeys:
    """Key -> engine/file routing and the KV events of a tier (see the module docstring)."""

    engines: dict[int, RowEngine]
    engine: RowEngine
    chain_engine: RowEngine
    index: LRUIndex
    events: list[OffloadingEvent] | None
    locality: Locality | None
    medium: ClassVar[Medium]
    _names: TokenNames | None
    _ns_group: dict[str, int]
    _events_lock: threading.Lock
    _event_owner: dict[str, Any]
    _stop: threading.Event

    def _target(self, key: OffloadKey, req_context: ReqContext | None = None) -> tuple[RowEngine | None, str | None]:
        """The engine of the key's KV-cache group and the file's hash (None, None for a group not stored): vLLM's
        block hash, or under the token-chain scheme the chunk's page-chain key when its request allows one."""
        if self._names is not None:
            named = self._names.resolve(key, req_context)
            if named is not None:
                return self.chain_engine, named
        eng = self.engines.get(get_offload_group_idx(key))
        if eng is None:
            return None, None
        return eng, str(get_offload_block_hash(key).hex())

    def _probe_many(self, keys: list[OffloadKey], req_context: ReqContext | None = None) -> list[bool]:
        out = [False] * len(keys)
        if self._stop.is_set():  # shutting down: no more storage round trips
            return out
        by_engine: dict[int, list[tuple[int, str]]] = {}
        for i, k in enumerate(keys):
            eng, h = self._target(k, req_context)
            if eng is not None and h is not None:
                by_engine.setdefault(id(eng), []).append((i, h))
        for eng in self._all_engines():
            todo = by_engine.get(id(eng))
            if todo:
                for (i, _), ok in zip(todo, eng.probe_many([h for _, h in todo])):
                    out[i] = ok
        return out

    def _all_engines(self) -> list[RowEngine]:
        return [*self.engines.values(), *([self.chain_engine] if self._names is not None else [])]

    def _on_removed(self, relpaths: list[str]) -> None:
        if self.events is None:
            return
        keys = []
        for rel in relpaths:
            parts = block_path_parts(rel, strict=False)
            group = self._ns_group.get(parts[0]) if parts is not None else None
            if parts is not None and self._names is not None and parts[0] == self.chain_engine.ns:
                vkey = self._names.vllm_key(parts[1])  # a page-chain file: announce the vLLM key it served
                if vkey is not None:
                    keys.append(vkey)
                continue
            if parts is not None and group is not None:
                try:
                    keys.append(make_offload_key(bytes.fromhex(parts[1]), group))
                except ValueError:  # an odd number of hex digits: no vLLM key
                    continue
        if keys:
            with self._events_lock:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True,
                                                   locality=self.locality, **self._event_owner))

    def _on_stored(self, job: Job, stored: list[OffloadKey]) -> None:
        extra = dict(self._event_owner)
        if _EVENT_TAKES_REQ_CONTEXT:
            extra["req_context"] = job.req_context  # lets vLLM's tracker describe the chunk
        with self._events_lock:
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                   locality=self.locality, **extra))

    def _refresh_recency(self, req_context: ReqContext) -> None:
        """Count the chunks a finished request used as recently used, CPU-tier hits included.

        vLLM never asks a secondary tier about a CPU-tier hit (and ``touch`` was never called, then
        removed in 0.34), so the request's end is the one hook that sees every chunk it used: the scheduler
        records each offload key's end-token position in the request context (0.33 and 0.34). Keys past
        the tokens actually processed are skipped, as vLLM's kvcr tier does.
        """
        positions = getattr(req_context, "_offload_key_positions", None)
        if not positions:
            return
        done = None
        counts = [getattr(req_context, a, None) for a in
                  ("num_computed_tokens", "num_in_flight_tokens", "num_prompt_tokens", "num_tokens")]
        if None not in counts:
            computed, in_flight, prompt, total = (int(c) for c in counts if c is not None)
            done = min(max(0, computed - in_flight), max(prompt, total - 1))
        # Deepest chunk first, so a request's shortest prefix ends up most recent: a longer prefix is
        # useless without the chunks before it, so those are the last to go.
        for key, pos in sorted(positions.items(), key=lambda kv: -kv[1]):
            if done is not None and pos > done:
                continue
            eng, h = self._target(key, req_context)
            if eng is not None and h is not None:
                self.index.touch(eng.relpath(h))
