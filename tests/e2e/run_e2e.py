"""kvformat inside a running vLLM (issue 36): engine A (TP=2) stores, engine B (TP=1, a new process, the same root)
serves, and the oracles are the engine and the model, never kvformat's code. Three engine runs:

* A, TP=2: the tiering config exactly as docs/vllm.md documents it (read from the doc; only the root and the CPU
  tier's size changed), with vLLM's own ``fs`` tier appended on another root so both store the same chunks, and
  the doc's tier again, sealed, on a third.
  Five prompt groups (G0..G4), each two prompts sharing a 128-token prefix (8 blocks of 16). After the
  first prompt of each group, every worker dumps the KV-cache blocks that request used (engine.py).
* Between A and B: one byte of the file holding G1's block 3 is flipped in kvformat's root, and the file of G3's
  block 5 is cut to half its length. A copy of that root keeps only G1's and G3's files, without those two (the
  "deleted instead" root). A's sealed root (a third tier of A: the doc's, with seal "authenticate") keeps G4's
  files only, with block 4's replaced by A's clear file (written without the key); that file is deleted from
  A's clear root (B's "deleted instead"). A fourth root gets vLLM's fs-tier files
  planted at the path vLLM's own FileMapper names for a TP=1 engine, payload = the engine's row for the chunk
  built from A's dumped KV: G0's and G2's blocks, G2's block 3 with the same byte flipped.
* B, TP=1: the doc's config alone, on A's kvformat root. Dumps like A.
* B', TP=1: tiers [1:fs on A's fs root, 2:fs on the planted root, 3:KVFormatTier on the copy, 4:KVFormatTier
  sealed, with the key, on the sealed root (G4)]. Tier 1 is vLLM's
  own cross-TP reuse (A wrote it at TP=2); tier 2 serves G0 and G2 from the planted bytes; kvformat serves G1 and G3
  without the broken files (the "deleted instead" run).

Checks (all must hold; the last line printed is one JSON object, issue 36 item 5):
bytes_match_writer_kv: B's workers hold, for every block it loaded, byte for byte A's workers' KV, every layer;
layer0_matches_model: A's layer 0 vs the latent recomputed from the weights in plain torch (layer0.py);
hits/chunks_stored/files: vLLM's chunk hits for the kvformat tier in B, vLLM's bytes written to it in A (in
chunks), the .kvf files on disk: one per chunk, each equal (read with the safetensors library) to A's KV;
outputs_match_engine_tier: G0 served by vLLM's fs tier (B') gives exactly B's tokens and first-token logprobs;
corrupt_* / truncated_*: B misses G1's block 3 (48 cached tokens) / G3's block 5 (80), logs each file once, moves
exactly those two under .quarantine, and each group's outputs equal B''s (file deleted instead); unsealed_*: the
same for G4 in B' (the clear file in the sealed root: 64 cached tokens), against B (file deleted);
peer_*: B' tier 1's hits (0 expected: a TP=1 engine looks in another directory) and what B' tier 2 did with the
flipped byte of G2 (loaded it: outputs against B's); control_cold_runs_agree: a prompt served cold by B and B'.

KVFORMAT_E2E_MUTANT=store_nothing|load_zeros swaps the tier for tests/e2e/mutant_tier.py's broken one: the run
must then fail. KVFORMAT_E2E_WORK: the work directory (default: a new temp dir, kept for inspection).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from layer0 import check as layer0_check  # noqa: E402
from tiny_model import write_model  # noqa: E402

BLOCK = 16
CORRUPT_BLOCK = 3  # a middle block of the 8-block prefix: B keeps 3 blocks (48 tokens) of G1
GROUPS, PER_GROUP = 5, 2
# the files broken between A and B: group -> (how, block). G1: one byte flipped; G3: cut to half its length (both
# read by B, deleted instead for B'); G4: A's clear file planted in a sealed root B' reads with the key (deleted
# instead for B).
FAULTS = {1: ("flip", CORRUPT_BLOCK), 3: ("truncate", 5), 4: ("unsealed", 4)}
CLEAN = (0, 2)  # served whole in B; in B' by vLLM's fs tier from planted bytes (G2's block 3 flipped there)
MUTANT = os.environ.get("KVFORMAT_E2E_MUTANT", "")


def doc_tiering_config(root: Path) -> dict[str, Any]:
    doc = (REPO / "docs" / "vllm.md").read_text()
    m = re.search(r"--kv-transfer-config '(\{.*?\})'", doc, re.S)
    assert m, "docs/vllm.md has no --kv-transfer-config block"
    ktc: dict[str, Any] = json.loads(m.group(1))
    extra = ktc["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 64 << 20  # the doc's 64 GiB does not fit this machine
    [tier] = [t for t in extra["secondary_tiers"] if t["type"] == "KVFormatTier"]
    tier["root"] = str(root)
    if MUTANT:
        tier["type"], tier["module_path"] = "MutantKVFormatTier", "mutant_tier"
    return ktc


def with_fs(ktc: dict[str, Any], fs_roots: list[Path], first: bool) -> dict[str, Any]:
    """The config with vLLM's fs tier on each of ``fs_roots`` before (``first``) or after the doc's tier."""
    ktc = json.loads(json.dumps(ktc))
    tiers = ktc["kv_connector_extra_config"]["secondary_tiers"]
    fs = [{"type": "fs", "root_dir": str(r)} for r in fs_roots]
    if first:
        tiers[:0] = fs
    else:
        tiers.extend(fs)
    return ktc


def prompts() -> list[str]:
    """GROUPS groups of PER_GROUP prompts; a group's prompts share a 128-word (= 128-token) prefix."""
    out = []
    for g in range(GROUPS):
        rnd = random.Random(100 + g)
        prefix = " ".join(f"w{rnd.randrange(2000)}" for _ in range(128))
        out += [prefix + " " + " ".join(f"w{rnd.randrange(2000)}" for _ in range(4 + i)) for i in range(PER_GROUP)]
    return out


def control_prompt() -> str:
    """A prompt no engine has seen before B and B' (not served by A, B' does not see B's stores): served cold
    by both, it must give exactly the same outputs, the control showing the configuration is deterministic."""
    rnd = random.Random(999)
    return " ".join(f"w{rnd.randrange(2000)}" for _ in range(100))


def run_engine(work: Path, name: str, tp: int, model: Path, ktc: dict[str, Any], ps: list[str],
               dump: bool) -> dict[str, Any]:
    spec, out = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec.write_text(json.dumps({"model": str(model), "tp": tp, "kv_transfer_config": ktc, "prompts": ps,
                                "dump": str(work / name) if dump else None,
                                "dump_prompts": [g * PER_GROUP for g in range(GROUPS)]}))
    path = [str(HERE / "shim")] + ([str(HERE)] if MUTANT else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), KVFORMAT_E2E_SHIM="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # collective_rpc with a function (the KV dump)
               VLLM_CPU_OMP_THREADS_BIND="|".join(str(i) for i in range(tp)) if tp > 1 else "0")
    t0 = time.monotonic()
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run([sys.executable, str(HERE / "engine.py"), str(spec), str(out)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=900).returncode
    print(f"e2e: engine {name} (TP={tp}) rc={rc} in {time.monotonic() - t0:.0f} s, log {work / name}.log",
          file=sys.stderr)
    if rc != 0:
        raise SystemExit(f"engine {name} failed (rc={rc}); see {work / name}.log")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def metric(res: dict[str, Any], name: str, tier: str | None = None) -> float:
    """Sum of vLLM metric ``name`` over its series (only those whose tier label is ``tier`` ("2:fs") or, without
    an index, whose tier type ends with it)."""
    total = 0.0
    for key, v in res["metrics"].items():
        base, labels = key.split("{", 1)
        if base != name:
            continue
        t = re.search(r"tier=([^,}]*)", labels)
        if tier is not None and not (t and (t.group(1) == tier if ":" in tier else
                                            t.group(1).split(":", 1)[-1].endswith(tier))):
            continue
        total += v["sum"] if isinstance(v, dict) else (v or 0)
    return total


def load_dumps(work: Path, name: str, tp: int) -> dict[int, list[dict[str, Any]]]:
    import torch
    return {g: [torch.load(work / f"{name}.p{g * PER_GROUP}.rank{r}.pt") for r in range(tp)] for g in range(GROUPS)}


def block_bytes(dump: dict[str, Any], layer: str, j: int) -> bytes:
    return bytes(dump["layers"][layer][j].contiguous().view(-1).numpy().view("uint8").tobytes())


def safetensors_data_start(path: Path) -> tuple[int, dict[str, Any]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8:8 + n])


def flip_byte(path: Path, offset: int) -> None:
    """XOR bit 0 of the byte at ``offset`` (the top byte of an fp32 value: its exponent scales by 4)."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def quarantined_files(root: Path) -> list[Path]:
    q = root / ".quarantine"
    return [p for p in q.rglob("*") if p.is_file()] if q.exists() else []


def quarantined_names(files: list[Path]) -> list[str]:
    """A quarantined file keeps its name with the reason appended (".kvf.ChecksumError")."""
    return sorted(p.name[:p.name.index(".kvf") + 4] if ".kvf" in p.name else p.name for p in files)


def sealed_tier(doc: dict[str, Any], root: Path, key: Path) -> dict[str, Any]:
    """The doc's tier dict on ``root``, sealed ("authenticate") under the key in ``key`` (made if missing)."""
    import secrets

    if not key.exists():
        key.write_text(secrets.token_hex(32) + "\n")
        key.chmod(0o600)
    [tier] = [t for t in doc["kv_connector_extra_config"]["secondary_tiers"] if "KVFormatTier" in t["type"]]
    return dict(tier, root=str(root), seal="authenticate", seal_key=str(key))


def prune_sealed_root(root_s: Path, kvf_of: dict[tuple[int, int], Path]) -> bool:
    """Keep, in the sealed root A wrote, the files of the unsealed-fault group only (named as in A's clear root):
    B' must ask its other tiers for every other group (see the fs-tier note in main)."""
    keep = {f.name for (g, _), f in kvf_of.items() if FAULTS.get(g, ("",))[0] == "unsealed"}
    kept = 0
    for p in list(root_s.rglob("*.kvf")):
        if p.name in keep:
            kept += 1
        else:
            p.unlink()
    return kept == len(keep) > 0


def outputs_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["tokens"] == b["tokens"] and a["first_logprobs"] == b["first_logprobs"]
                and a["num_cached_tokens"] == b["num_cached_tokens"])


def main() -> int:
    import torch
    from safetensors import safe_open
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.file_mapper import FileMapper

    t_start = time.monotonic()
    work = Path(os.environ.get("KVFORMAT_E2E_WORK") or tempfile.mkdtemp(prefix="kvformat-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "model")
    root_k, root_f, root_k_del, root_f1, root_s = (work / n for n in ("rootK", "rootF", "rootK_del", "rootF_planted",
                                                                      "rootS"))
    ps = prompts()
    doc = doc_tiering_config(root_k)
    details: dict[str, Any] = {"work": str(work), "mutant": MUTANT or None}

    # ---- A: TP=2 stores --------------------------------------------------------------------------------------
    # A: the doc's tier, vLLM's fs tier, and the doc's tier sealed on a third root (for G4's fault)
    a_cfg = with_fs(doc, [root_f], first=False)
    a_cfg["kv_connector_extra_config"]["secondary_tiers"].append(sealed_tier(doc, root_s, work / "seal.key"))
    a = run_engine(work, "A", 2, model, a_cfg, ps, dump=True)
    a_dump = load_dumps(work, "A", 2)
    fs_cfg_path = next(root_f.glob("*/config.json"))
    fs_cfg = json.loads(fs_cfg_path.read_text())
    layers = list(fs_cfg["kv_cache_groups"][0]["layer_names"])  # vLLM's group layer order (its row layout)
    n_blocks = [min(len(a_dump[g][0]["block_ids"]), (r["prompt_tokens"] + len(r["tokens"]) - 1) // BLOCK)
                for g in range(GROUPS) for r in [a["results"][g * PER_GROUP]]]
    details["a_replicas_equal"] = all(torch.equal(a_dump[g][0]["layers"][n], a_dump[g][1]["layers"][n])
                                      for g in range(GROUPS) for n in layers)
    chunk_bytes = len(layers) * len(block_bytes(a_dump[0][0], layers[0], 0))
    row_len = -(-chunk_bytes // 4096) * 4096

    def row(g: int, j: int) -> bytes:
        return b"".join(block_bytes(a_dump[g][0], n, j) for n in layers)

    # the kvformat files, read with the safetensors library, against A's KV: which (group, block) each holds
    kvf = sorted(root_k.glob("*/*/*/*.kvf"))
    kvf_of: dict[tuple[int, int], Path] = {}
    unmatched = 0
    for f in kvf:
        with safe_open(str(f), "pt") as s:
            got = {n: s.get_tensor(n) for n in layers}
        hit = [(g, j) for g in range(GROUPS) for j in range(n_blocks[g])
               if all(torch.equal(got[n].reshape(a_dump[g][0]["layers"][n][j].shape), a_dump[g][0]["layers"][n][j])
                      for n in layers)]
        if len(hit) == 1 and hit[0] not in kvf_of:
            kvf_of[hit[0]] = f
        else:
            unmatched += 1
    expected_chunks = sum(n_blocks)
    details.update(expected_chunks=expected_chunks, kvf_files_equal_to_writer_kv=len(kvf_of),
                   kvf_files_unmatched=unmatched)
    # vLLM's fs files (A's peer tier) against the same rows
    fs_files = sorted(root_f.glob("*_r0/*/*/*.bin"))
    fs_of: dict[tuple[int, int], Path] = {}
    for f in fs_files:
        data = f.read_bytes()
        for g in range(GROUPS):
            for j in range(n_blocks[g]):
                if len(data) == row_len and data[:chunk_bytes] == row(g, j):
                    fs_of[(g, j)] = f
    details["fs_files"], details["fs_files_equal_to_writer_kv"] = len(fs_files), len(fs_of)
    doc_type = doc["kv_connector_extra_config"]["secondary_tiers"][0]["type"]  # A's tier 1: the doc's, clear
    chunks_stored = metric(a, "vllm:kv_offload_tiering_write_bytes", f"1:{doc_type}") / row_len

    # ---- between A and B: break G1's and G3's files (and delete them in a copy); plant the fs tier's files --
    targets = {g: kvf_of.get((g, j)) for g, (_, j) in FAULTS.items()}
    if root_k.exists():
        shutil.copytree(root_k, root_k_del, symlinks=True)
    # B' asks kvformat only for the faulted groups (the clean groups' files go): kvformat answers a lookup at
    # once, vLLM's fs tier a step later, so with both holding a chunk the fs tier would never serve it
    for (g, j), f in kvf_of.items():
        if g not in FAULTS or j == FAULTS[g][1] or FAULTS[g][0] == "unsealed":
            (root_k_del / f.relative_to(root_k)).unlink()
    sealed_root_ok = prune_sealed_root(root_s, kvf_of)
    for g, target in targets.items():
        if target is None:
            continue
        if FAULTS[g][0] == "unsealed":
            # planted in place of the sealed file of the same chunk; B reads the root with the file deleted
            planted_at = [p for p in root_s.rglob(target.name)]
            for p in planted_at:
                p.write_bytes(target.read_bytes())
            sealed_root_ok = sealed_root_ok and len(planted_at) == 1
            target.unlink()
        elif FAULTS[g][0] == "flip":
            start, header = safetensors_data_start(target)
            s0, e0 = header[layers[0]]["data_offsets"]
            flip_byte(target, start + s0 + ((e0 - s0) // 2 // 4) * 4 + 3)
        else:
            target.write_bytes(target.read_bytes()[:target.stat().st_size // 2])
    mapper = FileMapper(str(root_f1), model_name=fs_cfg["model_name"], tokens_per_hash=fs_cfg["tokens_per_hash"],
                        blocks_per_file=fs_cfg["blocks_per_file"], tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                        rank=0, dtype=fs_cfg["dtype"], kv_cache_groups=fs_cfg["kv_cache_groups"])
    planted = 0
    for (g, j), f in fs_of.items():
        if g not in CLEAN:
            continue
        # the block hash is the A file's name (block hashes do not depend on TP); one KV-cache group: index 0
        dest = Path(mapper.get_file_name(make_offload_key(bytes.fromhex(f.stem), 0)))
        payload = bytearray(row(g, j) + b"\x00" * (row_len - chunk_bytes))
        if g == 2 and j == CORRUPT_BLOCK:
            payload[chunk_bytes // len(layers) // 2 // 4 * 4 + 3] ^= 0x01  # the same byte of layer 0
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(bytes(payload))
        planted += 1
    details["fs_planted"] = planted

    # ---- B: TP=1 loads; B': vLLM's fs tier from the planted bytes, kvformat with the file deleted ------------
    b = run_engine(work, "B", 1, model, doc, ps + [control_prompt()], dump=True)
    b_dump = load_dumps(work, "B", 1)
    quarantined = quarantined_files(root_k)
    # B': tiers [1:fs on A's fs root (the peer's cross-TP reuse), 2:fs on the planted root, 3:kvformat]
    doc_del = json.loads(json.dumps(doc).replace(json.dumps(str(root_k)), json.dumps(str(root_k_del))))
    doc_del["kv_connector_extra_config"]["secondary_tiers"].append(sealed_tier(doc, root_s, work / "seal.key"))
    bp = run_engine(work, "Bprime", 1, model, with_fs(doc_del, [root_f, root_f1], first=True), ps + [control_prompt()],
                    dump=False)

    # bytes: every block B loaded equals A's, byte for byte, every layer
    b_cached = [r["num_cached_tokens"] for r in b["results"]]
    compared, equal = 0, 0
    for g in range(GROUPS):
        for j in range(b_cached[g * PER_GROUP] // BLOCK):
            for n in layers:
                compared += 1
                equal += block_bytes(b_dump[g][0], n, j) == block_bytes(a_dump[g][0], n, j)
    details.update(b_num_cached_tokens=b_cached, bytes_blocks_compared=compared, bytes_blocks_equal=equal)
    bytes_ok = compared > 0 and equal == compared and details["a_replicas_equal"]

    l0 = layer0_check(model, ps[0], a_dump[0][0]["layers"][layers[0]].reshape(-1, 576))
    details["layer0"] = l0

    # counters: vLLM's own, in B (kvformat's tier label) and A
    hits = metric(b, "vllm:kv_offload_tiering_chunk_hits", "KVFormatTier")
    token_bytes = chunk_bytes // BLOCK
    load_bytes = metric(b, "vllm:kv_offload_load_bytes")
    details.update(b_load_bytes=load_bytes, b_load_bytes_expected=sum(b_cached) * token_bytes)
    # every chunk A stored is a lookup hit in B (the broken ones too: their loads are what fails), but the one
    # deleted for B
    deleted_for_b = sum(1 for g in FAULTS if FAULTS[g][0] == "unsealed")
    counters_ok = (hits == chunks_stored - deleted_for_b and load_bytes == sum(b_cached) * token_bytes
                   and chunks_stored == expected_chunks == len(kvf) == len(kvf_of)
                   and all(b_cached[g * PER_GROUP + i] == n_blocks[g] * BLOCK for g in CLEAN
                           for i in range(PER_GROUP)))

    # faults: the reading engine kept the blocks before the broken one, logged the file once, quarantined it, and
    # the group's outputs equal those of the engine that read the root with that file deleted instead
    # outputs equal B''s, where kvformat served the group with that file deleted
    logs = {n: (work / f"{n}.log").read_text(errors="replace").splitlines() for n in ("B", "Bprime")}
    q_names = {"B": quarantined_names(quarantined), "Bprime": quarantined_names(quarantined_files(root_s))}
    fault: dict[str, dict[str, Any]] = {}
    for g, target in targets.items():
        kind, j, grp = FAULTS[g][0], FAULTS[g][1], slice(g * PER_GROUP, (g + 1) * PER_GROUP)
        reader, other = (bp, b) if kind == "unsealed" else (b, bp)
        name = "Bprime" if kind == "unsealed" else "B"
        log_lines = sum(target.name in ln for ln in logs[name]) if target else 0
        fault[kind] = {
            "missed": target is not None and reader["results"][g * PER_GROUP]["num_cached_tokens"] == j * BLOCK
            and log_lines == 1,
            "quarantined": q_names[name].count(target.name) if target else 0,
            "equals_deleted": target is not None and all(outputs_equal(x, y) for x, y in
                                                         zip(reader["results"][grp], other["results"][grp])),
            "log_lines": log_lines}
    details["sealed_root_ok"] = sealed_root_ok
    details["sealed_quarantined"] = q_names["Bprime"]
    details["faults"] = fault
    details["quarantined"] = [str(p.relative_to(root_k)) for p in quarantined]
    details["b_kvformat_corrupt_files"] = metric(b, "vllm:kv_offload_kvformat_corrupt_files", "KVFormatTier")

    # outputs: G0 from vLLM's fs tier (B') equals G0 from kvformat (B)
    g0, g2 = slice(0, PER_GROUP), slice(2 * PER_GROUP, 3 * PER_GROUP)
    bp_fs_hits = metric(bp, "vllm:kv_offload_tiering_chunk_hits", "2:fs")
    outputs_ok = (bp_fs_hits == sum(n_blocks[g] for g in CLEAN) and all(outputs_equal(x, y) for x, y in
                                                     zip(b["results"][g0], bp["results"][g0])))
    details["bprime_fs_hits"] = bp_fs_hits
    details["bprime_num_cached_tokens"] = [r["num_cached_tokens"] for r in bp["results"]]

    # control: the prompt after the groups, cold in B and in B'
    cb, cbp = b["results"][len(ps)], bp["results"][len(ps)]
    control_ok = cb["num_cached_tokens"] == cbp["num_cached_tokens"] == 0 and outputs_equal(cb, cbp)

    # the peer side by side
    peer_hits = metric(bp, "vllm:kv_offload_tiering_chunk_hits", "1:fs")
    details["peer_cross_tp_queries"] = metric(bp, "vllm:kv_offload_tiering_chunk_queries", "1:fs")
    x, y = b["results"][g2], bp["results"][g2]
    lp = sum(p["first_logprobs"] != q["first_logprobs"] for p, q in zip(x, y))
    tk = sum(p["tokens"] != q["tokens"] for p, q in zip(x, y))
    peer_on_corrupt = (f"loaded: {[r['num_cached_tokens'] for r in y]} cached tokens on G2 with the flipped block; "
                       f"first-token logprobs changed on {lp}/{len(x)} prompts, greedy tokens on {tk}/{len(x)}")

    out = {"tp_write": 2, "tp_read": 1, "hits": int(hits), "chunks_stored": chunks_stored, "files": len(kvf),
           "bytes_match_writer_kv": bytes_ok, "layer0_matches_model": bool(l0["ok"]),
           "outputs_match_engine_tier": outputs_ok,
           **{f"{name}_{c}": fault[k][c] for k, name in (("flip", "corrupt"), ("truncate", "truncated"),
                                                        ("unsealed", "unsealed"))
              for c in ("missed", "quarantined", "equals_deleted")},
           "peer_cross_tp_hits": int(peer_hits), "peer_on_corrupt": peer_on_corrupt,
           "control_cold_runs_agree": control_ok}
    checks = {"control": control_ok, "bytes": bytes_ok, "layer0": bool(l0["ok"]), "counters": counters_ok,
              "outputs": outputs_ok,
              **{f"{k}_{c}": bool(v[c]) for k, v in fault.items() for c in ("missed", "equals_deleted")},
              "quarantined_exactly_the_broken_files": sealed_root_ok and q_names == {
                  "B": sorted(t.name for g, t in targets.items() if t and FAULTS[g][0] != "unsealed"),
                  "Bprime": sorted(t.name for g, t in targets.items() if t and FAULTS[g][0] == "unsealed")},
              "peer_cross_tp_hits": peer_hits == 0 and details["peer_cross_tp_queries"] > 0}
    details.update(checks=checks, seconds=round(time.monotonic() - t_start))
    (work / "report.json").write_text(json.dumps({"result": out, "details": details}, indent=1))
    print(json.dumps(details), file=sys.stderr)
    print(json.dumps(out))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
