"""SGLang's built-in file backend (``HiCacheFile``) -> kvformat files: ``kvformat compact --from sglang``.

``HiCacheFile`` (SGLang 0.5.23, ``mem_cache/hicache_storage.py``) writes each page as ``<dir>/<page key><suffix>.bin``:
the host pool's page as raw bytes (``get_data_page(flat=True)``: the host layout's own axis order), no header, no
checksum. An MLA model's suffix is ``_<model with / as ->`` whatever the TP size; a pipeline stage adds
``_<pp size>_<pp rank>``, context parallelism ``_cp<rank>_<size>``, DCP ``_tp<n>_dcp<rank>_<size>_page<n>``, and
head-sharded (non-MLA) KV ``_<tp rank>_<tp size>``. Nothing in a file says its layout, dtype or layer count, so
they are given; what can be checked is: the suffix (only a whole MLA page is converted), the file size against
the given geometry, and that the key is a page hash. A ``page_first`` page is transposed to the canonical
``[layer][token][latent]``; ``layer_first`` and ``page_first_direct`` pages already are. No SGLang import.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from ..format import BlockKey, Provenance, __version__
from ..cache import ENGINE
from ..errors import PathEscapeError, SchemaError
from ..storage import MOVED, open_in, open_store, unlink_in
from ._facts import _ITEM, _ST, HOST_LAYOUTS, PageFacts, page_plan

__all__ = ["SGLangCompactReport", "compact_sglang"]

_NAME = re.compile(r"(?P<key>[0-9a-f]{64})(?P<suffix>_.*)\.bin")


@dataclass
class SGLangCompactReport:
    """What a conversion did: pages converted / already there, files skipped by reason, bytes in and out."""

    namespace: str = ""
    seen: int = 0
    written: int = 0
    existed: int = 0
    deleted: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def compact_sglang(src: str, dst: str, *, model: str, n_layers: int, page_tokens: int, host_layout: str,
                   kv_dtype: str = "bfloat16", width: int = 576, revision: str | None = None,
                   key_scheme: str = ENGINE, rope: str | None = None, quantization: str | None = None,
                   dry_run: bool = False, delete_source: bool = False, fsync: bool = False) -> SGLangCompactReport:
    """Convert every whole-MLA-page file of an SGLang file-backend directory ``src`` into the kvformat root ``dst``.

    The files land in the namespace :class:`~kvformat.sglang.KVFormatHiCache` computes for the same facts and
    ``key_scheme``, so an SGLang (or, with ``"token-chain"``, a vLLM) deployment reads them. Raises SchemaError for
    given facts kvformat cannot describe (an unknown host layout or dtype, no model); each file it cannot convert
    is counted in :attr:`SGLangCompactReport.skipped` with the reason.
    """
    if host_layout not in HOST_LAYOUTS:
        raise SchemaError("host_layout", f"expected one of {', '.join(HOST_LAYOUTS)}, got {host_layout!r}")
    if kv_dtype not in _ST:
        raise SchemaError("kv_dtype", f"expected one of {', '.join(_ST)}, got {kv_dtype!r}")
    if not model:
        raise SchemaError("model", "the model SGLang served is needed (its files name it, without the revision)")
    facts = PageFacts(model=model, kv_dtype=kv_dtype, revision=revision, page_tokens=page_tokens, n_layers=n_layers,
                      width=width, host_layout=host_layout, host_tokens=page_tokens, tp_size=1, writer=True,
                      key_scheme=key_scheme, rope=rope, quantization=quantization)
    layout = facts.layout()
    plan, _, _ = page_plan(facts, layout)
    size = n_layers * page_tokens * width * _ITEM[_ST[kv_dtype]]
    suffix = "_" + "-".join(model.split("/"))
    rep = SGLangCompactReport(namespace=layout.namespace())
    out = open_store(dst)
    if not dry_run:
        out.ensure_namespace(layout)
    prov = Provenance(row="unknown", writer=f"kvformat {__version__} compact (sglang file backend, {host_layout})")
    scratch = memoryview(bytearray(size))
    wrong_size = f"size is not {size} bytes ({n_layers} layers x {page_tokens} tokens x {width} {kv_dtype})"
    for name in sorted(os.listdir(src)):
        if not name.endswith(".bin"):
            continue
        got = _read_page(src, name, rep, suffix, size, wrong_size)
        if got is None:
            continue
        m, st, raw = got
        rep.bytes_in += len(raw)
        if host_layout == "page_first":
            plan.gather(memoryview(raw), scratch)
            payload: bytes | memoryview = scratch
        else:
            payload = raw
        if dry_run:
            continue
        key = BlockKey(m["key"])
        rel, n, wrote = out.put_block(payload, layout, key, provenance=prov, fsync=fsync)
        if wrote:
            rep.written += 1
            rep.bytes_out += n
        else:
            rep.existed += 1
        if delete_source:
            check = bytearray(size)
            out.read_into(rel, check, expect=layout, key=key, verify=True)  # raises on any difference
            if check == bytes(payload) and unlink_in(src, name, (st.st_dev, st.st_ino)) == MOVED:
                rep.deleted += 1
    return rep


def _read_page(src: str, name: str, rep: SGLangCompactReport, suffix: str, size: int,
               wrong_size: str) -> tuple[re.Match[str], os.stat_result, bytes] | None:
    """(name match, stat, bytes) of one KV page file of this model; None (counted in ``rep`` if seen) otherwise."""
    # Opened from the directory without following a symlink, and deleted only if the name still holds the
    # inode that was read: a name swapped by someone else between the read and the delete is left alone.
    try:
        fd = open_in(src, name)
    except (PathEscapeError, IsADirectoryError, FileNotFoundError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        rep.seen += 1
        m = _NAME.fullmatch(name)
        if m is None:
            rep.skip("not a KV page (a sidecar pool's page or another name)")
            return None
        if m["suffix"] != suffix:
            rep.skip("another model, or a pipeline stage / context-parallel / DCP / head-sharded writer's part")
            return None
        if st.st_size != size:
            rep.skip(wrong_size)
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(size + 1)
    finally:
        os.close(fd)
    if len(raw) != size:
        rep.skip(wrong_size)
        return None
    return m, st, raw
