"""The token-chain names of vLLM's chunks (``key_scheme: "token-chain"``; kvformat.cache._keyscheme).

A chunk of a plain-token request is named by SGLang's page chain over the request's token ids up to the chunk's
end, so an SGLang deployment (whose backend is handed exactly that chain as its page key) and this tier name the
same tokens' KV the same file. vLLM 0.34 hands a tier the chunk's end position (``ReqContext.
get_offload_key_position``) but not the token ids: they are read from private state, the scheduler's
``_req_status[req_id].req`` reachable from vLLM's request context, feature-detected. Where they are not
reachable, or the request's KV depends on more than its token ids (LoRA, multimodal inputs, prompt embeddings,
cache salt, or any other extra key vLLM's own block hasher adds), the chunk keeps vLLM's own key, in the tier's
engine namespace. docs/sglang.md has the upstream ask (token ids on the public request context).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx

from ..cache import page_chain

__all__ = ["TokenNames"]

logger = logging.getLogger("kvformat.vllm")

_MAX_KNOWN = 1 << 20  # key -> name memo entries kept (a lost entry only costs a recomputation or one event)


class _Req:
    """One request's token ids (None: its chunks keep vLLM's keys) and the page chain computed so far."""

    __slots__ = ("tokens", "chain", "why")

    def __init__(self, tokens: list[int] | None, why: str | None) -> None:
        self.tokens = tokens
        self.chain: list[str] = []
        self.why = why


def _request(ctx: Any) -> Any:
    """vLLM's Request behind a request context (0.34's ``_VllmReqContext``), or None where it is not reachable."""
    status = getattr(getattr(ctx, "_scheduler", None), "_req_status", None)
    entry = status.get(getattr(ctx, "req_id", None)) if isinstance(status, dict) else None
    return getattr(entry, "req", None)


def _engine_only(req: Any, page: int) -> str | None:
    """Why ``req``'s KV depends on more than its token ids (then no token-only name), else None."""
    for attr, what in (("lora_request", "a LoRA adapter"), ("cache_salt", "a cache salt"),
                       ("mm_features", "multimodal inputs"), ("prompt_embeds", "prompt embeddings")):
        v = getattr(req, attr, None)
        if v is not None and (not hasattr(v, "__len__") or len(v)):
            return what
    try:  # vLLM's own definition: any extra key its block hasher would add for some page
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:
        return None
    mm = 0
    n = getattr(req, "num_tokens", 0)
    for start in range(0, n - n % page, page):
        extra, mm = generate_block_hash_extra_keys(req, start, start + page, mm)
        if extra:
            return "extra block-hash keys"
    return None


class TokenNames:
    """Maps a vLLM offload key of one group to its page-chain name, per request (see the module docstring)."""

    def __init__(self, group: int, page_tokens: int, warn: Callable[..., None]) -> None:
        self.group = group
        self.page = page_tokens
        self._warn = warn
        self._known: dict[OffloadKey, str] = {}
        self._keys: dict[str, OffloadKey] = {}  # name -> the key it served (removal events)
        self._why_logged: set[str] = set()

    def on_new_request(self, ctx: ReqContext) -> None:
        self._state(ctx)

    def _state(self, ctx: Any) -> _Req | None:
        if not hasattr(ctx, "get_state"):
            self._warn("token-chain:ctx", "kvformat tier: this vLLM's request context keeps no per-request state; "
                       "token-chain names are off, chunks keep vLLM's keys")
            return None
        st: _Req | None = ctx.get_state(_Req)
        if st is not None:
            return st
        req = _request(ctx)
        if req is None or not hasattr(req, "all_token_ids"):
            self._warn("token-chain:tokens", "kvformat tier: vLLM does not expose the request's token ids here "
                       "(private scheduler state not found); token-chain names are off for such requests, their "
                       "chunks keep vLLM's keys")
            st = _Req(None, "token ids not reachable")
        else:
            why = _engine_only(req, self.page)
            st = _Req(None if why else list(req.all_token_ids), why)
            if why and why not in self._why_logged:
                self._why_logged.add(why)
                logger.info("kvformat tier: requests with %s keep vLLM's keys (their KV depends on more than token "
                            "ids); logged once", why)
        ctx.set_state(st)
        return st

    def resolve(self, key: OffloadKey, ctx: Any) -> str | None:
        """The page-chain name of ``key``, or None when the chunk keeps vLLM's key."""
        if get_offload_group_idx(key) != self.group:
            return None
        name = self._known.get(key)
        if name is not None or ctx is None:
            return name
        st = self._state(ctx)
        pos = ctx.get_offload_key_position(key) if hasattr(ctx, "get_offload_key_position") else None
        if st is None or st.tokens is None or pos is None or pos % self.page or pos <= 0:
            return None
        if pos > len(st.tokens):  # decode tokens since the request started: read them again
            req = _request(ctx)
            if req is None or len(req.all_token_ids) < pos:
                return None
            st.tokens = list(req.all_token_ids)
        i = pos // self.page - 1
        if i >= len(st.chain):
            page_chain(st.tokens[:(i + 1) * self.page], self.page, start_page=len(st.chain), out=st.chain)
        name = str(st.chain[i])
        if len(self._known) >= _MAX_KNOWN:
            self._known.clear()
            self._keys.clear()
        self._known[key] = name
        self._keys[name] = key
        return name

    def vllm_key(self, name: str) -> OffloadKey | None:
        """The vLLM key a page-chain file served (for its removal event), if this tier named it."""
        return self._keys.get(name)
