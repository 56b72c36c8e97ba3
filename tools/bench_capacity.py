"""Token hit ratio per disk byte on a request trace: kvformat's evictor against LRU, vLLM's fs tier and Belady.

Replays a Mooncake-format trace (one JSON request a line, ``hash_ids``: one id per 512-token prefix block) the way
the vLLM tier drives the cache: look up the longest stored prefix of the request's full blocks, load it, store the
rest. Index-driven policies run the shipped index classes (``cache._lru.LRUIndex``, ``cache._prefix.PrefixIndex``)
with the same reserve/add/forget calls as the tier, with true file sizes (header + payload); with ``--root DIR``
each store also writes a real file there (payload scaled down by ``--scale``, header at its true size), each victim
is unlinked and each load reads its files, so the index is checked against a real directory. The other policies:

* ``kvformat``: what ships (the tier's ``GhostSegmentedIndex``, ``eviction="ghost-slru"``: a segmented LRU whose
  protected share follows ARC's ghost rule, chunks touched in load order); ``kvformat-lru``: ``LRUIndex``
  (``eviction="lru"``, the default before issue 45); ``kvformat-ghost:S`` starts the share at S; ``kvformat-prefix``: the
  ``PrefixIndex`` this tool measured against it (predecessor links, dead chunks first, chains touched tail first);
  ``kvformat-slru[:share]``: ``SegmentedLRUIndex`` (stored-only files in probation, evicted before loaded ones,
  whose protected segment holds ``share`` of the budget, 0.2 by default); ``kvformat-slru-prefix``: both rules;
  ``kvformat-adaptive[:share]``: ``AdaptiveSegmentedIndex`` (protects only while a segmented shadow beats an LRU one);
  ``kvformat-arc-lru``: ``ArcLruIndex`` (evicts what the leading one of an LRU and an ARC shadow evicted; ARC
  unless LRU leads significantly); ``kvformat-arc-lru:arc`` / ``:lru`` follow one expert throughout (check rows);
* ``s3fifo[:T]``, ``w-tinylfu[:W]``, ``arc[:S]``, ``sieve``: the field's online policies (tools/capacity_policies.py,
  from the papers), by block, the same file sizes and prefix-chain lookups; ``s3fifo:1`` moves a block to the main
  queue after one hit in the small one (the paper's pseudo-code says more than one), ``w-tinylfu:0.2`` a 20 % window;
* ``POLICY+second-sight`` / ``POLICY+dwpd:N``: an admission setting in front of the disk tier (write a block only
  at its second offer; or write each request's new blocks with a probability steered to N drive-writes a day);
* ``lru``: plain LRU by block, written here, the same file sizes, chunks touched in load order (what every cache does);
  ``lru-oracle-admission``: the same LRU, storing only blocks a later request holds (it knows the future: a
  diagnostic of how much of the gap to ``optimal`` is admission, not a policy that could ship);
* ``vllm-fs-replicated`` / ``vllm-fs-per-worker-tp8``: vLLM's fs tier (headerless rows, one copy or one per rank
  at TP=8; it never deletes, so stores stop when the budget is full);
* ``optimal``: offline Belady over prefix chains (evict the block whose next use is farthest; a block's next use
  is never earlier than its predecessor's, so it drops tails first; a block not worth caching is not stored).

Every row has the disk tier's bytes written and drive-writes per day (bytes written over the budget, scaled from
the trace's span to 24 h). ``--codec-ratio 1,1.4`` repeats every row with payloads stored in 1/r of their bytes;
``--cpu-tier-gb G`` puts vLLM's CPU tier (LRU, write-through, disk hits promoted) in front of the block-level
policies and reports its share of the hits.

    python tools/bench_capacity.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \
        --model deepseek-v3 --budget-tb 0.5,1,2,4 [--codec-ratio 1,1.4] [--cpu-tier-gb 128] [--json]
        [--plot FILE.png] [--root DIR --scale 4096]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # capacity_policies beside this file

from capacity_replay import ANCHORS, make_index, replay_blocks  # noqa: E402

BLOCK_TOKENS = 512
TB = 10**12
# layers, latent width, dtype bytes: the MLA families of our layout tables (kvformat/layout/_rules.py).
MODELS = {"deepseek-v3": (61, 576, 2), "deepseek-v2-lite": (27, 576, 2), "kimi-k2": (61, 576, 2)}


def header_bytes(model: str) -> int:
    """The true header region of one chunk file (64-token pages, 8 a chunk), from the real encoder."""
    import kvformat
    layers, width, dsize = MODELS[model]
    specs = tuple(kvformat.LayerSpec(f"model.layers.{i}.self_attn.attn", "BF16", (64, width)) for i in range(layers))
    layout = kvformat.CanonicalLayout(model=model, kv_dtype="bfloat16", tokens_per_block=64, blocks_per_chunk=8,
                                      tokens_per_hash=BLOCK_TOKENS, layers=specs)
    hdr, _ = kvformat.encode(bytes(BLOCK_TOKENS * layers * width * dsize), layout, kvformat.BlockKey("ab" * 8))
    return len(hdr)


def load_times(path: str) -> list[float]:
    """Each request's arrival in seconds (the trace's ``timestamp`` is in ms)."""
    with open(path) as f:
        return [float(json.loads(line)["timestamp"]) / 1000 for line in f if line.strip()]


def load_trace(path: str) -> list[tuple[list[int], int]]:
    """(full-block ids, input tokens) per request; a trailing partial block is never stored (vLLM hashes full ones)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                n = int(r["input_length"])
                out.append((list(r["hash_ids"])[: n // BLOCK_TOKENS], n))
    return out


class Result:
    def __init__(self, policy: str, budget_tb: float, codec_ratio: float = 1.0, cpu_tier_gb: float = 0.0) -> None:
        self.policy, self.budget_tb, self.codec_ratio, self.cpu_tier_gb = policy, budget_tb, codec_ratio, cpu_tier_gb
        self.hit = self.total = self.written = self.read = self.evictions = self.cpu_hit = 0

    def row(self, duration_s: float = 0.0) -> dict[str, Any]:
        """``drive_writes_per_day``: disk bytes written over the budget, scaled from the trace's span to 24 h."""
        budget = self.budget_tb * TB
        dwpd = self.written / budget * 86400 / duration_s if budget > 0 and duration_s > 0 else 0.0
        return {"policy": self.policy, "budget_tb": self.budget_tb, "codec_ratio": self.codec_ratio,
                "cpu_tier_gb": self.cpu_tier_gb,
                "token_hit_ratio": self.hit / self.total if self.total else 0.0,
                "cpu_hit_ratio": self.cpu_hit / self.total if self.total else 0.0,
                "bytes_written": self.written, "drive_writes_per_day": dwpd,
                "bytes_read": self.read, "evictions": self.evictions}


def replay_index(trace: list[tuple[list[int], int]], budget: int, size: int, res: Result, *, policy: str,
                 root: str | None = None, scale: int = 1, hdr: int = 0, keep: bool = False,
                 tick: Callable[[], None] = lambda: None) -> None:
    """The tier's calls on the shipped index: lookup prefix, pin/touch/load it, reserve+write+add the rest."""
    idx = make_index(policy, budget)
    prefix = hasattr(idx, "link")
    disk = size - hdr
    ondisk = hdr + max(1, disk // scale)

    def path(b: int) -> str:
        return os.path.join(root, f"{b % 256:02x}", f"{b}.kvf") if root else ""

    def drop(victims: list[tuple[str, int]]) -> None:
        if root:
            for rel, _ in victims:
                os.unlink(path(int(rel)))
        idx.forget(rel for rel, _ in victims)
        res.evictions += len(victims)

    if root:
        for i in range(256):
            os.makedirs(os.path.join(root, f"{i:02x}"), exist_ok=True)
    for blocks, n in trace:
        tick()
        res.total += n
        rels = [str(b) for b in blocks]
        k = 0
        while k < len(rels) and rels[k] in idx:
            k += 1
        if prefix:
            idx.touch_chain(rels[:k])
        else:
            for r in rels[:k]:
                idx.touch(r)
        if root:
            for b in blocks[:k]:
                with open(path(b), "rb") as f:
                    f.read()
        res.hit += k * BLOCK_TOKENS
        res.read += k * size
        for i in range(k, len(rels)):
            rel = rels[i]
            if prefix:
                idx.link(rel, rels[i - 1] if i else None)
            drop(idx.reserve(size, rel))
            if root:
                with open(path(blocks[i]), "wb") as out:
                    out.write(bytes(ondisk))
            drop(idx.add(rel, size, reserved=size))
            res.written += size
    if root:
        on = sum(os.path.getsize(os.path.join(d, e)) for d, _, fs in os.walk(root) for e in fs)
        if on != len(idx) * ondisk:
            raise SystemExit(f"index says {len(idx)} files, the root holds {on} bytes")
        if not keep:
            shutil.rmtree(root)  # up to a budget's worth of files (GBs at 4 TB): they were only there to be checked


def next_uses(trace: list[tuple[list[int], int]]) -> list[list[int]]:
    """Per request, per block: the next request holding that block (``len(trace)``: none)."""
    inf = len(trace)
    nxt: list[list[int]] = [[] for _ in trace]
    last: dict[int, int] = {}
    for r in range(len(trace) - 1, -1, -1):
        nxt[r] = [last.get(b, inf) for b in trace[r][0]]
        for b in trace[r][0]:
            last[b] = r
    return nxt


def replay_lru(trace: list[tuple[list[int], int]], budget: int, size: int, res: Result,
               tick: Callable[[], None], nxt: list[list[int]] | None = None) -> None:
    """Plain LRU by block, written here (not the shipped index) as the baseline. With ``nxt``
    (``lru-oracle-admission``): a block is stored only if a later request holds it (an admission oracle; eviction
    stays LRU). Block ids name whole prefixes, so a block with no later use has none after it either."""
    from collections import OrderedDict
    cache: OrderedDict[int, None] = OrderedDict()
    cap = budget // size
    for r, (blocks, n) in enumerate(trace):
        tick()
        res.total += n
        k = 0
        while k < len(blocks) and blocks[k] in cache:
            cache.move_to_end(blocks[k])
            k += 1
        res.hit += k * BLOCK_TOKENS
        res.read += k * size
        for i in range(k, len(blocks)):
            b = blocks[i]
            if cap <= 0 or (nxt is not None and nxt[r][i] >= len(trace)):
                break
            cache[b] = None
            res.written += size
            if len(cache) > cap:
                cache.popitem(last=False)
                res.evictions += 1


def replay_vllm_fs(trace: list[tuple[list[int], int]], budget: int, size: int, res: Result,
                   tick: Callable[[], None]) -> None:
    stored: set[int] = set()
    used = 0
    for blocks, n in trace:
        tick()
        res.total += n
        k = 0
        while k < len(blocks) and blocks[k] in stored:
            k += 1
        res.hit += k * BLOCK_TOKENS
        res.read += k * size
        for b in blocks[k:]:
            if used + size > budget:
                break  # no deletion: the disk is full and every later store fails
            stored.add(b)
            used += size
            res.written += size


def replay_optimal(trace: list[tuple[list[int], int]], budget: int, size: int, res: Result,
                   tick: Callable[[], None], nxt: list[list[int]]) -> None:
    """``nxt``: :func:`next_uses` of ``trace``."""
    inf = len(trace)
    cap = budget // size
    when: dict[int, int] = {}  # cached block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale rows skipped
    depth: dict[int, int] = {}
    for r, (blocks, n) in enumerate(trace):
        tick()
        res.total += n
        k = 0
        while k < len(blocks) and blocks[k] in when:
            k += 1
        res.hit += k * BLOCK_TOKENS
        res.read += k * size
        for i in range(len(blocks)):
            b = blocks[i]
            if i >= k:
                if nxt[r][i] >= inf or cap <= 0:
                    break
                while len(when) >= cap:
                    top = heap[0]
                    if when.get(top[2]) != -top[0]:
                        heapq.heappop(heap)
                        continue
                    if -top[0] <= nxt[r][i]:
                        break
                    heapq.heappop(heap)
                    del when[top[2]]
                    res.evictions += 1
                if len(when) >= cap:
                    break  # every cached block is needed sooner: bypass this one and its suffix
                res.written += size
            when[b] = nxt[r][i]
            depth[b] = i
            heapq.heappush(heap, (-nxt[r][i], -i, b))


POLICIES = ("kvformat", "kvformat-lru", "kvformat-prefix", "kvformat-slru", "kvformat-slru-prefix", "kvformat-adaptive",
            "kvformat-arc-lru", "lru",
            "s3fifo", "s3fifo:1", "w-tinylfu", "arc", "sieve", "lru-oracle-admission", "vllm-fs-replicated",
            "vllm-fs-per-worker-tp8", "optimal")


def run(trace: list[tuple[list[int], int]], model: str, budgets: list[float], policies: Iterable[str],
        root: str | None, scale: int, progress: bool, keep: bool = False, times: list[float] | None = None,
        codec_ratios: Iterable[float] = (1.0,), cpu_tier_gb: float = 0.0,
        cpu_touches_disk: bool = False) -> list[dict[str, Any]]:
    """Every (codec ratio, budget, policy). A codec of ratio r stores a chunk's payload in 1/r of its bytes (the
    header is not compressed), so the same budget holds ~r times the blocks and a store writes 1/r the bytes;
    vLLM's fs tier has no codec, so its rows are made at r = 1 only. With ``cpu_tier_gb`` the block-level
    policies (anchors, ``kvformat``) run behind vLLM's CPU tier of that many GB of payload; ``optimal``, the
    oracle and the fs-tier rows do not (they stay disk-only references)."""
    layers, width, dsize = MODELS[model]
    row = BLOCK_TOKENS * layers * width * dsize
    hdr = header_bytes(model)
    times = times if times is not None else [0.0] * len(trace)
    duration = times[-1] - times[0] if times else 0.0
    cpu_cap = int(cpu_tier_gb * 1e9) // row
    policies = list(policies)
    jobs = [(r, p, b) for r in codec_ratios for b in budgets for p in policies
            if r == 1 or not p.startswith("vllm-fs")]
    done = [0]
    steps = len(jobs) * len(trace)
    t0 = time.monotonic()

    def tick() -> None:
        done[0] += 1
        if progress and done[0] % 2000 == 0:
            f = done[0] / steps
            bar = "#" * int(30 * f)
            sys.stderr.write(f"\r[{bar:<30}] {100 * f:5.1f}% {time.monotonic() - t0:6.1f}s")
            sys.stderr.flush()

    rows = []
    # Each request's next uses, computed once and shared by every budget of the two rows that know the future.
    nxt = next_uses(trace) if {"optimal", "lru-oracle-admission"} & {p for _, p, _ in jobs} else []
    for ratio, p, btb in jobs:
        budget = int(btb * TB)
        size = hdr + (row if ratio == 1 else math.ceil(row / ratio))
        blockwise = "+" in p or (cpu_cap > 0 and (p.partition(":")[0] in ANCHORS or p.startswith("kvformat")))
        res = Result(p, btb, ratio, cpu_tier_gb if blockwise else 0.0)
        if blockwise:
            replay_blocks(trace, times, budget, size, res, tick, p, cpu_cap, cpu_touches_disk)
        elif p.partition(":")[0] in ANCHORS and p != "lru":
            replay_blocks(trace, times, budget, size, res, tick, p)
        elif p.startswith("kvformat"):
            sub = None
            if root:
                sub = os.path.join(root, f"{p.replace(':', '-')}-{btb}" + (f"-r{ratio}" if ratio != 1 else ""))
            replay_index(trace, budget, size, res, policy=p, root=sub, scale=scale, hdr=hdr, keep=keep, tick=tick)
        elif p == "lru":
            replay_lru(trace, budget, size, res, tick)
        elif p == "lru-oracle-admission":
            replay_lru(trace, budget, size, res, tick, nxt)
        elif p == "vllm-fs-replicated":
            replay_vllm_fs(trace, budget, row, res, tick)
        elif p == "vllm-fs-per-worker-tp8":
            replay_vllm_fs(trace, budget, 8 * row, res, tick)
        elif p == "optimal":
            replay_optimal(trace, budget, size, res, tick, nxt)
        else:
            raise SystemExit(f"unknown policy {p!r}; expected one of {POLICIES}")
        rows.append(res.row(duration))
    if progress:
        sys.stderr.write(f"\r{' ' * 60}\r")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    opt = {(r["codec_ratio"], r["budget_tb"]): r["token_hit_ratio"] for r in rows if r["policy"] == "optimal"}
    tp8 = {r["budget_tb"]: r["token_hit_ratio"] for r in rows if r["policy"] == "vllm-fs-per-worker-tp8"}
    lines = [f"{'policy':<24}{'codec':>6}{'cpu GB':>7}{'budget TB':>10}{'hit ratio':>11}{'cpu hit':>9}"
             f"{'x optimal':>10}{'x tp8 fs':>9}{'written TB':>11}{'DWPD':>8}{'read TB':>9}{'evictions':>10}"]
    for r in rows:
        h = r["token_hit_ratio"]
        o, t = opt.get((r["codec_ratio"], r["budget_tb"])), tp8.get(r["budget_tb"])
        lines.append(f"{r['policy']:<24}{r['codec_ratio']:>6g}{r['cpu_tier_gb']:>7g}{r['budget_tb']:>10g}{h:>11.4f}"
                     f"{r['cpu_hit_ratio']:>9.4f}{(f'{h / o:.3f}' if o else '-'):>10}"
                     f"{(f'{h / t:.2f}' if t else '-'):>9}{r['bytes_written'] / TB:>11.2f}"
                     f"{r['drive_writes_per_day']:>8.1f}{r['bytes_read'] / TB:>9.2f}{r['evictions']:>10}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib, which is not installed (pip install matplotlib): no plot drawn",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
    for p, ratio in dict.fromkeys((r["policy"], r["codec_ratio"]) for r in rows):
        pts = sorted((r["budget_tb"], r["token_hit_ratio"]) for r in rows
                     if r["policy"] == p and r["codec_ratio"] == ratio)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                linestyle="-" if ratio == 1 else "--", label=p if ratio == 1 else f"{p} (codec {ratio:g}x)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("disk budget (TB)")
    ax.set_ylabel("token hit ratio")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "traces"
                                           / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--model", default="deepseek-v3", choices=sorted(MODELS))
    ap.add_argument("--budget-tb", default="0.5,1,2,4")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    ap.add_argument("--root", help="also write/unlink/read real files here for the kvformat policies")
    ap.add_argument("--scale", type=int, default=4096, help="payload bytes divided by this on disk (with --root)")
    ap.add_argument("--keep-files", action="store_true", help="leave the files under --root (tests)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--codec-ratio", default="1", help="payload compression ratios, comma-separated (1: no codec)")
    ap.add_argument("--cpu-tier-gb", type=float, default=0.0,
                    help="put vLLM's CPU tier (LRU, GB of payload) in front of the disk tier, write-through")
    ap.add_argument("--cpu-hits-touch-disk", action="store_true",
                    help="with --cpu-tier-gb: a CPU hit also refreshes the block's recency in the disk tier")
    a = ap.parse_args(argv)
    trace = load_trace(a.trace)
    times = load_times(a.trace)
    if a.limit:
        trace, times = trace[: a.limit], times[: a.limit]
    budgets = [float(x) for x in a.budget_tb.split(",")]
    ratios = [float(x) for x in a.codec_ratio.split(",")]
    if any(r < 1 for r in ratios):
        raise SystemExit(f"--codec-ratio: expected ratios >= 1, got {a.codec_ratio}")
    t0 = time.monotonic()
    rows = run(trace, a.model, budgets, a.policies.split(","), a.root, a.scale, not a.no_progress, a.keep_files,
               times, ratios, a.cpu_tier_gb, a.cpu_hits_touch_disk)
    wall = time.monotonic() - t0
    if a.json:
        print(json.dumps(rows))
    else:
        print(table(rows))
        span = (times[-1] - times[0]) / 3600 if times else 0.0
        print(f"{len(trace)} requests over {span:.2f} h (DWPD scales to 24 h), {len(budgets)} budgets, "
              f"{wall:.1f} s, load {os.getloadavg()[0]:.1f}")
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
