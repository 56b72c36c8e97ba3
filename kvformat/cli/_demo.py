"""``kvformat demo``: the whole story in a few seconds, with no flags and no GPU.

1. write a legacy vLLM fs-tier tree as a TP=8 DeepSeek-shaped deployment does (8 identical worker slots
   per row, vLLM's own path scheme and config.json);
2. inspect it; 3. compact it; 4. inspect the result (root and one file);
5. read every block back into TP=2 and TP=1 primary rows the way KVFormatTier loads (one checked read
   into slot 0, fanned out to the other slots) and compare with what was written;
6. show the bytes saved; 7. corrupt one file and show it caught (read refused, buffer zeroed,
   ``verify --quarantine`` moves it aside).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from ..format import BlockKey, CanonicalLayout, block_relpath, hash_relpath, round_up
from ..errors import ChecksumError, UsageError
from ..legacy import ROW_ALIGN, compact, legacy_fields, write_legacy_row
from ..storage import Store, open_store
from ._compact import summary_lines
from ..admin import find_store_root, scan_root
from ._inspect import inspect_file, inspect_legacy, inspect_root, render_file, render_root
from ._util import human

MODEL = "deepseek-ai/DeepSeek-V3"
TOKENS_PER_BLOCK = 64  # DeepSeek's MLA block size
WIDTH = 576  # kv_lora_rank 512 + rope 64, bf16
TP = 8


def _say(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 72 - len(title)))


def run_demo(workdir: str | None = None, *, n_layers: int = 8, n_blocks: int = 12,
             summary: dict[str, Any] | None = None) -> int:
    """Run the demo in ``workdir`` (kept) or a temp directory (removed). Returns 0 when every check holds.

    ``summary``, when given, is filled with the ``--json`` fields (see ``_schema.DEMO_SCHEMA``).
    """
    if n_layers < 1 or n_blocks < 1:
        raise UsageError(f"demo: expected at least 1 layer and 1 block, got {n_layers} and {n_blocks}")
    base = workdir or tempfile.mkdtemp(prefix="kvformat-demo-")
    os.makedirs(base, exist_ok=True)
    out = summary if summary is not None else {}
    out.update({"dir": base if workdir else None, "layers": n_layers, "blocks": n_blocks})
    try:
        return _run(base, n_layers, n_blocks, out)
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)


def _run(base: str, n_layers: int, n_blocks: int, summary: dict[str, Any]) -> int:
    t0 = time.monotonic()
    legacy, dst = os.path.join(base, "vllm-fs-cache"), os.path.join(base, "kvformat-cache")
    payloads, slot = _write_legacy(legacy, n_layers, n_blocks)

    _say("2. kvformat inspect <legacy root>")
    print(render_root(inspect_legacy(legacy)))

    _say("3. kvformat compact <legacy root> <kvformat root>")
    rep = compact(legacy, dst, jobs=2)
    for line in summary_lines(rep):
        print(line)
    ok = rep.exit_code == 0 and rep.converted == n_blocks

    _say("4. kvformat inspect <kvformat root>, and one file")
    print(render_root(inspect_root(dst)))
    store = open_store(dst)
    first = sorted(payloads)[0]
    ns = store.namespaces()[0]
    rel0 = hash_relpath(ns, first)
    print()
    print(render_file(inspect_file(os.path.join(dst, rel0))))

    _say("5. read back into TP=2 and TP=1 primary rows (KVFormatTier's load path)")
    layout = store.read_header(rel0).layout
    read_back = _read_back(store, layout, payloads, slot)
    ok &= all(equal == len(payloads) for equal in read_back.values())

    _say("6. bytes saved")
    saved = rep.bytes_before - rep.bytes_after
    print(f"legacy {human(rep.bytes_before)} -> kvformat {human(rep.bytes_after)}: saved {human(saved)} "
          f"({rep.bytes_before / max(rep.bytes_after, 1):.1f}x smaller), and the files now load at any TP size")

    _say("7. a corrupted file is caught")
    caught, n_bad = _corrupt_and_catch(store, dst, rel0, layout, slot)
    ok &= caught and n_bad == 1
    root, _ = find_store_root(dst)
    tp_ok = {tp: n for tp, n in read_back.items()}
    summary.update({"ok": bool(ok), "converted": rep.converted, "bytes_before": rep.bytes_before,
                    "bytes_after": rep.bytes_after, "read_back_identical": {str(k): v for k, v in tp_ok.items()},
                    "corruption_caught": n_bad == 1, "elapsed_s": round(time.monotonic() - t0, 3)})
    kept = summary["dir"] is not None  # a scratch directory is removed on return: never name it as if it stayed
    where = f"files under {root}" if kept else "scratch files removed; --dir DIR keeps them"
    print(f"\ndemo {'OK' if ok else 'FAILED'} in {time.monotonic() - t0:.1f} s ({where})")
    return 0 if ok else 1


def _write_legacy(legacy: str, n_layers: int, n_blocks: int) -> tuple[dict[str, bytes], int]:
    """Step 1: the legacy tree; returns the payload of each block hash and the bytes of one worker slot."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    fields = legacy_fields(MODEL, tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_file=1, dtype="bfloat16",
                           kv_cache_groups=[{"tokens_per_block": TOKENS_PER_BLOCK, "layer_names": names}], tp=TP)
    slot = n_layers * TOKENS_PER_BLOCK * WIDTH * 2
    row_bytes = round_up(slot * TP, ROW_ALIGN)
    rng = np.random.default_rng(0)
    payloads: dict[str, bytes] = {}
    _say(f"1. a legacy vLLM fs-tier cache written at TP={TP}")
    print(f"{MODEL}: {n_layers} MLA layers (of 61, to stay quick), {TOKENS_PER_BLOCK} tokens x {WIDTH} bf16 latent "
          f"per block; {n_blocks} blocks")
    for i in range(n_blocks):
        h = hashlib.sha256(f"demo/{i}".encode()).hexdigest()
        p = rng.standard_normal(slot // 2, dtype=np.float32).astype(np.float16).tobytes()  # bf16-sized values
        payloads[h] = p
        row = bytearray(row_bytes)
        for r in range(TP):  # every TP rank holds the same MLA latent: vLLM stores all 8 copies
            row[r * slot:(r + 1) * slot] = p
        write_legacy_row(legacy, fields, h, row)
    print(f"wrote {n_blocks} files of {human(row_bytes)} ({TP} worker slots of {human(slot)} each) under {legacy}")
    return payloads, slot


def _read_back(store: Store, layout: CanonicalLayout, payloads: dict[str, bytes], slot: int) -> dict[int, int]:
    """Step 5: blocks byte-identical to what was stored, per TP size read back into."""
    read_back: dict[int, int] = {}
    for tp in (2, 1):
        rb = memoryview(bytearray(round_up(slot * tp, ROW_ALIGN)))
        equal = 0
        for h, p in payloads.items():
            store.read_into(block_relpath(layout, BlockKey(h, 0)), rb[:slot], expect=layout, key=BlockKey(h, 0))
            for r in range(1, tp):
                rb[r * slot:(r + 1) * slot] = rb[:slot]
            equal += all(rb[r * slot:(r + 1) * slot] == p for r in range(tp))
        print(f"TP={tp}: {equal}/{len(payloads)} blocks byte-identical to what TP={TP} stored")
        read_back[tp] = equal
    return read_back


def _corrupt_and_catch(store: Store, dst: str, rel0: str, layout: CanonicalLayout, slot: int) -> tuple[bool, int]:
    """Step 7: flip a bit of ``rel0``; (whether the read refused it and zeroed its row, bad files verify found)."""
    ok = True
    path = os.path.join(dst, rel0)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1000)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x04]))  # one bit flipped in the payload, as a bad disk would
    buf = bytearray(b"\xff" * slot)
    try:
        store.read_into(rel0, buf, expect=layout)
        print("NOT caught: the read succeeded")
        ok = False
    except ChecksumError as e:
        print(f"read refused: {e.reason}: {e.message}")
        print(f"destination zeroed, not left holding wrong bytes: {not any(buf)}")
        ok &= not any(buf)
    bad = scan_root(dst, verify=True).bad
    for rel, err in bad:
        q = store.quarantine_read(rel, err).relpath
        print(f"kvformat verify --quarantine: {rel} -> {q} (exit code 1)")
    return ok, len(bad)
