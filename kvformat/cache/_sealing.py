"""The engine-neutral sealing hook of the chunk cache (spec §12): the layouts a sealed tier stores (their
namespace says how files are sealed) and the keyring it seals and opens them with. Every adapter (vLLM,
SGLang) calls these two; the row engine (``_rows``) does the rest."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from typing import TypeVar

from ..format import ENV_PREFIX, Keyring, load_key
from ..layout import RowPlan
from ..errors import KeySourceError, SchemaError
from ._config import TierConfig

__all__ = ["sealed_plans", "tier_keyring"]

logger = logging.getLogger("kvformat.vllm")

_K = TypeVar("_K")


def sealed_plans(plans: dict[_K, RowPlan], cfg: TierConfig) -> dict[_K, RowPlan]:
    """``plans`` with each layout carrying the tier's seal level (a clear tier's plans come back unchanged)."""
    seal = None if cfg.seal == "off" else cfg.seal
    return {g: (p if p.layout.seal == seal else dataclasses.replace(p, layout=p.layout.with_seal(seal)))
            for g, p in plans.items()}


def tier_keyring(cfg: TierConfig) -> Keyring | None:
    """The tier's keys: ``seal_key`` first (it seals new files), then ``seal_read_keys`` (they only open
    files sealed earlier: rotation). None for a clear tier. A source that cannot be used is a SchemaError
    naming the parameter and the source, never the key."""
    if cfg.seal == "off":
        return None
    keys = []
    for name, sources in (("seal_key", (cfg.seal_key,)), ("seal_read_keys", cfg.seal_read_keys)):
        for src in sources:
            if src is None:
                continue
            try:
                keys.append(load_key(src))
            except KeySourceError as e:
                raise SchemaError(name, e.message) from None
            _warn_if_world_readable(src)
    ring = Keyring(tuple(keys))
    # Key ids only: an operator can match them with `kvformat inspect`; the keys never reach a log.
    logger.info("kvformat tier: sealing (%s) new files under key id %s; opening files of key ids %s", cfg.seal,
                ring.write_key.key_id, ", ".join(ring.ids))
    return ring


def _warn_if_world_readable(src: str) -> None:
    if src.startswith(ENV_PREFIX):
        return
    try:
        mode = os.stat(src).st_mode
    except OSError:
        return
    if mode & stat.S_IROTH:
        logger.warning("kvformat tier: seal key file %s is readable by every user of this host; make it 0600 (or "
                       "0640 for a group of services)", src)
