"""A live fleet on one bounded kvformat root (issue 43): two vLLM OpenAI API servers at the same time, A at TP=2
and B at TP=1, configured as docs/vllm.md tells a user (its --kv-transfer-config, root and bound replaced), a
real HTTP client (the `openai` package) replaying a slice of the Mooncake conversation trace with several requests
in flight, faults while they run, and every figure read from the servers (their HTTP answers and /metrics) or the
root's files, never from kvformat's code.

Trace scaling: each 512-token block of the trace is one vLLM block of 16 tokens here (the tiny model's
max_model_len is 512): hash id h becomes 16 words drawn by random.Random(h), so equal ids give equal prefixes;
a request keeps its first 30 hash ids (480 tokens, room for 2 output tokens). A seeded coin sends each request to
A or B, so about half of all reuse crosses deployments. The trace's timestamps are compressed away: requests go
out in trace order as fast as the in-flight limit allows.

Faults: kill -9 of A's whole process tree mid-replay (requests routed to A while it is down are counted as failed
by design) and A restarted on the same root; B reaches the root through a FUSE mount (tests/hangfs.py) on which
the payload reads of one prompt's files are made to hang; one byte flipped in a stored file that B then loads.
The root's .kvf bytes are sampled every second. The last line printed is one JSON object; exit 0 only if every
check held (1: a check failed; 2: the servers could not be started here).

With --moosefs the root is a MooseFS file system (tools/dfs_up.sh: master, one chunkserver, two client mounts):
A reaches it through client mount 0, B through client mount 1 with the hang layer on top, as two hosts would.
The hung read stays the FUSE layer's, not a stopped chunkserver: with one chunkserver a SIGSTOP stops every
engine's I/O, A's stores included, so "the other server keeps storing and evicting" could not hold by design
(tools/dfs_check.sh stops and kills the chunkserver under two engines, without servers).

Usage: python tests/e2e/fleet.py [--requests N] [--work DIR] [--tier fs] [--moosefs]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from run_e2e import doc_tiering_config, flip_byte, quarantined_files, safetensors_data_start  # noqa: E402
from tiny_model import write_model  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 16
MAX_IDS = 30
DEADLINE_S = 5.0  # read_deadline_s of both servers
_NUDGES = itertools.count(5 * 10**9)  # block ids of landed()'s one-block prompts, used by nothing else
GRANT_WAIT_S = 3.0  # a store past its grant waits this long for the next before the bound refuses it (_bound.py)
TIER = "KVFormatTier"


def trace_slice(n: int, every: int = 40) -> list[list[int]]:
    """The first ``n`` requests, in trace order, of the conversations whose second block id is a multiple of
    ``every``: whole conversations over the trace's hour (the first 300 requests of the trace share little but
    its first block: their follow-up turns come minutes later), compressed into the run."""
    out = []
    with open(TRACE) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            if len(ids) > 1 and ids[1] % every == 0:
                out.append(ids[:MAX_IDS])
                if len(out) == n:
                    break
    return out


def tokens(ids: list[int]) -> list[int]:
    """The prompt of a request as token ids (words w0..w1999 are ids 4..2003 of the tiny model's vocabulary). Sent
    as ids: vLLM's server bounds a text prompt by characters (5 per token), which these words exceed."""
    out = []
    for h in ids:
        rnd = random.Random(h)
        out += [4 + rnd.randrange(2000) for _ in range(BLOCK)]
    return out


class Server:
    def __init__(self, name: str, tp: int, port: int, model: Path, ktc: dict[str, Any], work: Path,
                 cores: str) -> None:
        self.name, self.tp, self.port, self.model = name, tp, port, model
        self.ktc, self.work, self.cores = ktc, work, cores
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.work / f"{self.name}.{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        env = dict(os.environ, PYTHONPATH=str(HERE / "shim"), KVFORMAT_E2E_SHIM="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=self.cores)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               "--tensor-parallel-size", str(self.tp), "--dtype", "float32", "--max-model-len", "512",
               "--block-size", str(BLOCK), "--enforce-eager", "--max-num-seqs", "4", "--seed", "0",
               "--attention-backend", "CPU_MLA", "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(self.ktc)]
        if self.tp > 1:
            cmd += ["--distributed-executor-backend", "mp"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_up(self, timeout: float = 600) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            if self.healthy():
                return True
            time.sleep(1)
        return False

    def kill9(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the whole tree: API server, engine core, workers
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill9()

    def metrics(self) -> dict[str, float]:
        """This server's Prometheus counters of the tiering and kvformat series, summed over their labels but
        the tier's (``name{tier}``); {} if the server does not answer. A scrape that times out is tried again
        (three tries of 20 s): in the CI run at 671d1f3 a scrape of B after the hang failed (most likely its 10 s
        timeout on a starved server) and the hang phase's first try read B's counters as 0 (a delta of -33)."""
        for attempt in range(3):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=20) as r:
                    text = r.read().decode()
                break
            except OSError as e:
                timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
                if not timed_out or attempt == 2:  # refused (a server that is down) is final at once
                    return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            wanted = "kv_offload" in line or "kvformat" in line or "prefix_cache" in line
            if line.startswith("#") or "_created" in line or not wanted:
                continue
            m = re.match(r"([A-Za-z_:]+)(\{[^}]*\})?\s+([-0-9.eE+]+|NaN)$", line)
            if not m:
                continue
            tier = re.search(r'tier="([^"]*)"', m.group(2) or "")
            key = m.group(1) + (f"{{{tier.group(1)}}}" if tier else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
        return out

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.work.glob(f"{self.name}.*.log")))


def tier_metric(m: dict[str, float], name: str, tier: str = TIER) -> float:
    """Series ``name`` of the tier whose label contains ``tier`` ("KVFormatTier"; ":fs" for vLLM's own)."""
    return sum(v for k, v in m.items() if k.startswith(name) and tier in k)


def kvf_bytes(root: Path) -> int:
    total = 0
    for p in root.rglob("*.kvf"):
        if ".quarantine" in p.parts:
            continue
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def writer_tp(path: Path) -> int | None:
    """The TP size a file's header names as its writer's (provenance), read as plain safetensors JSON."""
    try:
        _, hdr = safetensors_data_start(path)
    except (OSError, ValueError):
        return None
    meta = hdr.get("__metadata__", {})
    for k, v in meta.items():
        if "prov" in k or k.endswith(".tp"):
            try:
                doc = json.loads(v) if v.startswith("{") else {"tp": v}
                return int(doc.get("tp"))
            except (ValueError, TypeError):
                continue
    return None


class Client:
    """The HTTP side: one OpenAI client per server, per-request outcomes, and which blocks each server saw."""

    def __init__(self, servers: dict[str, Server]) -> None:
        import httpx
        from openai import DefaultHttpxClient, OpenAI

        self.servers = servers
        # No retries (a failure is counted, not hidden) and no kept-alive connections: a request sent on a pooled
        # connection the server is closing at that moment fails with "Connection error." (seen once in 300),
        # which says nothing about the server.
        self.api = {n: OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none", max_retries=0, timeout=120,
                              http_client=DefaultHttpxClient(limits=httpx.Limits(max_keepalive_connections=0)))
                    for n, s in servers.items()}
        self.seen: dict[str, set[int]] = {n: set() for n in servers}
        self.lock = threading.Lock()
        self.results: list[dict[str, Any]] = []

    def send(self, where: str, ids: list[int], tag: str = "replay", i: int = -1, max_tokens: int = 2,
             salt: str | None = None) -> dict[str, Any]:
        t0 = time.monotonic()
        rec: dict[str, Any] = {"server": where, "blocks": len(ids), "tag": tag, "t": time.time(), "i": i}
        extra = {"cache_salt": salt} if salt is not None else None
        try:
            r = self.api[where].completions.create(model="tiny", prompt=tokens(ids), max_tokens=max_tokens,
                                                   temperature=0.0, extra_body=extra)
            details = getattr(r.usage, "prompt_tokens_details", None)
            cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
            rec.update(ok=True, cached_blocks=cached // BLOCK, text=r.choices[0].text)
        except Exception as e:  # an HTTP error or a refused connection (the server is down)
            rec.update(ok=False, error=type(e).__name__, message=str(e)[:200])
        rec["s"] = time.monotonic() - t0
        with self.lock:
            if rec["ok"]:
                other = next(n for n in self.servers if n != where)
                cached = ids[:rec["cached_blocks"]]
                rec["cached_ids"] = cached
                # a cached block this server never saw can only have come from the shared root, written by the other
                rec["cross_blocks"] = sum(1 for h in cached if h not in self.seen[where] and h in self.seen[other])
                self.seen[where].update(ids)
            self.results.append(rec)
        return rec


def cpu_tier_chunks(log_text: str) -> int:
    """The primary CPU tier's size in chunks, from the server's own start-up line."""
    m = re.search(r"primary tier \(lru, (\d+) chunks\)", log_text)
    if not m:
        raise RuntimeError("the server did not log its primary tier's size")
    return int(m.group(1))


def replay_offline(res: list[dict[str, Any]], reqs: list[list[int]], root_files: int | None,
                   restart_after: float | None, cpu_chunks: int, refuse: float = 0.0, seed: int = 0,
                   shared: bool = True) -> int:
    """The same requests, in the order the servers answered them, through vLLM's tiering as these servers run
    it, with the capacity replay's plain LRU (tools/capacity_policies.py, bench_capacity's ``lru`` row) as the
    root: the chunks the root would serve. vllm-cpu turns the prefix cache off for MLA (their logs: "forcing
    chunked prefill and prefix caching to be disabled"), so every reused block comes through the offloading
    tiers: the server's CPU tier first (an LRU of ``cpu_chunks``), then the root (``root_files`` chunks; None:
    unbounded, vLLM's fs tier), a root hit promoted into the CPU tier, every computed block written through to
    both. ``refuse``: the share of root stores the servers' bound refused (their ``store_failures``), refused
    here at random (``seed``). ``restart_after``: the wall time of the kill, after which A's CPU tier is empty.
    ``shared`` False: each server has a root of its own (vLLM's fs tier names files by TP rank and layout, so
    servers of different TP sizes share none). The servers' root evicts with the tier's default order
    (``eviction="ghost-slru"``), this replay's with plain LRU, a reference written outside kvformat: so the
    ratio of the two also carries the difference between the orders (a few per cent either way on the Mooncake
    traces, docs/benchmarks/capacity.md)."""
    sys.path.insert(0, str(REPO / "tools"))
    from capacity_policies import LRU

    rnd = random.Random(seed)
    cap = root_files if root_files is not None else 1 << 62
    one = LRU(cap)
    disks = {"A": one, "B": one} if shared else {"A": LRU(cap), "B": LRU(cap)}
    cpu = {"A": LRU(cpu_chunks), "B": LRU(cpu_chunks)}
    served, restarted = 0, False
    for r in sorted((r for r in res if r["ok"] and r["tag"] == "replay"), key=lambda r: r["t"] + r["s"]):
        if restart_after is not None and not restarted and r["server"] == "A" and r["t"] > restart_after:
            cpu["A"], restarted = LRU(cpu_chunks), True
        mine, disk = cpu[r["server"]], disks[r["server"]]
        ids = reqs[r["i"]]
        k = 0
        for b in ids:
            if b in mine:
                mine.hit(b)
            elif b in disk:
                disk.hit(b)
                mine.insert(b)
                served += 1
            else:
                break
            k += 1
        for b in ids[k:]:
            mine.insert(b)
            if b in disk:
                disk.rewrite(b)
            elif rnd.random() >= refuse:
                disk.insert(b)
    return served


def replay_report(res: list[dict[str, Any]], reqs: list[list[int]], root_files: int | None,
                  restart_after: float | None, cpu_chunks: int, m: dict[str, dict[str, float]],
                  label: str, engine: float, shared: bool = True) -> dict[str, Any]:
    """The offline replay beside the servers' own count of chunks served by the root: once admitting every
    store, once refusing the share of stores the servers' /metrics say their bound refused (median of 5 seeds;
    A's counters cover its second life only)."""
    refused = sum(tier_metric(m[n], "vllm:kv_offload_kvformat_store_failures_total", label) for n in m)
    written = sum(tier_metric(m[n], "vllm:kv_offload_kvformat_files_written_total", label) for n in m)
    share = refused / (refused + written) if refused + written else 0.0
    plain = replay_offline(res, reqs, root_files, restart_after, cpu_chunks, shared=shared)
    runs = sorted(replay_offline(res, reqs, root_files, restart_after, cpu_chunks, share, s, shared)
                  for s in range(5))
    return {"replay_root_blocks": plain, "replay_cpu_tier_chunks": cpu_chunks,
            "store_refused_share": round(share, 3), "replay_root_blocks_refusing": runs[2],
            "engine_over_replay": round(engine / plain, 3) if plain else None,
            "engine_over_replay_refusing": round(engine / runs[2], 3) if runs[2] else None}


def new_files(root: Path, before: set[Path]) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvf") if p not in before and ".quarantine" not in p.parts)


def corrupt_phase(client: Client, a: Server, b: Server, root: Path, out: dict[str, Any], checks: dict[str, Any],
                  t_start: float) -> dict[str, Any]:
    """A prompt A stores; one byte of one of its files flipped; B, which never saw the prompt, asks for it."""
    probe = [10**9 + i for i in range(8)]
    before = set(root.rglob("*.kvf"))
    assert client.send("A", probe, "corrupt-store", max_tokens=16)["ok"]
    new = landed(client, root, before, len(probe), "corrupt")
    target = new[len(new) // 2] if new else None
    qa = len(quarantined_files(root))
    mb0 = b.metrics()
    if target is not None:
        start, _ = safetensors_data_start(target)
        flip_byte(target, start + 100)
    r = client.send("B", probe, "corrupt-load")
    time.sleep(2)
    quarantined = len(quarantined_files(root)) - qa
    mb1 = b.metrics()
    out["corrupt_phase_B_metrics"] = {k: mb1[k] - mb0.get(k, 0.0) for k in mb1 if mb1[k] != mb0.get(k, 0.0)}
    name = target.name if target is not None else "(no file)"
    logged = sum(1 for line in b.log_text().splitlines() if name in line)  # a line names it twice (its new place)
    checks["corrupt_answered_and_quarantined_once"] = target is not None and r["ok"] and quarantined == 1
    checks["corrupt_logged_once"] = logged == 1
    client.send("B", probe, "corrupt-restore")  # B's miss recomputed the chunk; its store writes a good file
    time.sleep(3)
    checks["corrupt_rewritten_good"] = target is not None and target.exists() and writer_tp(target) is not None
    return {"fault": "flipped byte", "t": round(time.monotonic() - t_start, 1), "file": name, "answered": r["ok"],
            "cached_blocks_of_8": r.get("cached_blocks"), "quarantined": quarantined, "log_lines": logged}


HELDOUT = 8  # prompts
HELDOUT_TOKENS = 16  # greedy output tokens each: 30 blocks of 16 prompt tokens + 16 <= max_model_len 512
# Blocks per held-out prompt: under one engine's write allowance (max_bytes / 16 = 25 chunk files here), so one
# prompt's stores fit one grant of the evictor. With 30 (fleet9) A's stores went 25 written, 5 refused by the bound
# each time (store_failures_by_reason{bound}), in whatever order its write threads took them: where the refused
# ones held the prompt's first block, B could load nothing of it (4 of 8 prompts).
HELDOUT_BLOCKS = 16


def settle(root: Path, quiet_s: float = 2.0, timeout: float = 30.0) -> None:
    """Wait until no .kvf file has appeared on the root for ``quiet_s`` (stores reach it off the request path)."""
    end, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < end:
        n = sum(1 for _ in root.rglob("*.kvf"))
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)


def landed(client: Client, root: Path, before: set[Path], blocks: int, tag: str,
           timeout: float = 60.0) -> list[Path]:
    """The files new since ``before`` once A's store of a ``blocks``-block prompt is on the root. vLLM creates
    the store jobs of a finished request's last blocks "on the next schedule step" (its offloading scheduler's
    ``request_finished``), and its tiering manager's cascades wait for steps too: with no request after it they
    wait. (The 4 of 8 files seen at cbd31a1 were the evictor deleting A's newest files, fixed in dd09d22 and
    20a3b05; the wait is kept for the step rule, which vLLM's source states.) So while files are missing A answers
    one-block nudges, each at most one file of its own: ``blocks`` + nudges new files hold every block's. Stops
    at ``timeout`` (a store the bound refused never lands) with what is there."""
    end = time.monotonic() + timeout
    for n in range(100):
        settle(root, quiet_s=GRANT_WAIT_S + 1)  # a store past its grant waits before it lands or is refused
        new = new_files(root, before)
        if len(new) >= blocks + n or time.monotonic() > end:
            return new
        client.send("A", [next(_NUDGES)], "nudge-" + tag, max_tokens=1)
    return new_files(root, before)


def heldout_phase(client: Client, a_server: Server, root: Path, out: dict[str, Any], checks: dict[str, Any],
                  against: Path | None) -> None:
    """Prompts no request used: A answers each first (its KV goes to the root), then B answers it twice, one at a
    time (no batching): once with A's KV from the root (a cross-TP load) and once with a fresh ``cache_salt``, so
    vLLM recomputes every block from the model's weights; the answers are compared (reported). With ``against``
    (another run's fleet.json, e.g. the same fleet on vLLM's own fs tier) B's answers must also equal that run's.
    A prompt some of whose stores A's bound refused (A's own ``store_failures`` counter moved meanwhile) is
    reported, not held to the load check: the refused chunk may be its first."""
    rows = []

    def refusals() -> float:
        return tier_metric(a_server.metrics(), "vllm:kv_offload_kvformat_store_failures_total")

    for j in range(HELDOUT):
        ids = [4 * 10**9 + 100 * j + i for i in range(HELDOUT_BLOCKS)]
        before = refusals()
        a = client.send("A", ids, "heldout-store", max_tokens=HELDOUT_TOKENS)
        settle(root)  # A's store reaches the root off the request path (2 s was too short on the CI machine)
        settled = time.monotonic()
        loaded = client.send("B", ids, "heldout-load", max_tokens=HELDOUT_TOKENS)
        fresh = client.send("B", ids, "heldout-recompute", max_tokens=HELDOUT_TOKENS, salt=f"heldout-{j}")
        # A store past its grant waits up to three intervals (3 s) before it is refused: read A's counter after
        time.sleep(max(0.0, settled + 4.0 - time.monotonic()))
        refused = refusals() - before
        rows.append({"j": j, "A": a.get("text"), "B_loaded": loaded.get("text"), "B_recomputed": fresh.get("text"),
                     "B_cached_blocks": loaded.get("cached_blocks", 0), "B_cross_blocks": loaded.get("cross_blocks", 0),
                     "recomputed_cached_blocks": fresh.get("cached_blocks", 0), "A_stores_refused": refused})
    out["heldout"] = rows
    whole = [r for r in rows if r["A_stores_refused"] == 0]
    out["heldout_stored_whole"] = len(whole)
    # Every prompt A stored whole is loaded whole by B from A's files; most must be stored whole (the bound
    # refusing all of them would be a failure of its own).
    checks["heldout_loaded_from_the_root"] = (len(whole) >= HELDOUT // 2
                                              and all(r["B_cross_blocks"] == HELDOUT_BLOCKS for r in whole))
    checks["heldout_recomputed_from_weights"] = all(r["recomputed_cached_blocks"] == 0 for r in rows)
    # Reported, not a check: the KV B loads was computed by A at TP=2 (another float summation order than B's
    # TP=1 recomputation), and the tiny random model's logits are nearly tied, so greedy answers may part after a
    # few tokens (3 of 8 did in fleet7). The bytes themselves are checked against the weights by tools/e2e.sh.
    out["heldout_equal"] = sum(r["B_loaded"] is not None and r["B_loaded"] == r["B_recomputed"] for r in rows)
    out["heldout_same_first_tokens"] = [_common_words(r["B_loaded"], r["B_recomputed"]) for r in rows]
    if against is not None:
        theirs = {r["j"]: r["B_loaded"] for r in json.loads(against.read_text()).get("heldout", [])}
        out["heldout_equal_to_against"] = sum(theirs.get(r["j"]) == r["B_loaded"] for r in rows)
        checks["heldout_equals_the_other_run"] = out["heldout_equal_to_against"] == len(rows)


def _common_words(a: str | None, b: str | None) -> int:
    """How many leading output words two answers share."""
    n = 0
    for x, y in zip((a or "").split(), (b or "").split()):
        if x != y:
            break
        n += 1
    return n


def hang_phase(client: Client, a: Server, b: Server, root: Path, ctl: Path, out: dict[str, Any],
               checks: dict[str, Any], t_start: float) -> dict[str, Any]:
    """A prompt A stores; the payload reads of its files on B's mount made to hang; B asks for it while A keeps
    serving prompts of its own that make it store and evict.

    A try in which B's view of the shared root was not current (B's own stale_view_misses counter moved and no load
    reached the deadline) never read the hung files: B answered misses without reading, as it must while it cannot
    see the evictor. That try is reported and another one, with another prompt, is made (two fresh-clone CI runs
    at 4adbffe and 5af5006 had such a try: B answered in 15.9 s / 10.8 s, 0 deadline misses). So is a try whose
    servers' counters could not be read (``metrics_read`` false): its deltas say nothing; and one in which A's bound
    refused some of the prompt's stores (A's store_failures moved): the refused chunk may be its first, and then B
    reads none of the rest. (CI at 01d0777 had 1 of 8 files on the root, B answering in 0.22 s with 0 deadline
    misses: not a refusal but the evictor deleting A's newest files, fixed in dd09d22 and 20a3b05.)
    Every try must have been answered by B; the counters' checks are made on the tries whose counters were read,
    the last among them."""
    tries: list[dict[str, Any]] = []
    for attempt in range(3):
        r = hang_try(client, a, b, root, ctl, t_start, attempt)
        tries.append(r)
        if r["metrics_read"] and (r["B_load_deadline_misses"] >= 1
                                  or not (r["B_stale_view_misses"] or r["A_stores_refused"])):
            break
    last = tries[-1]
    read = [t for t in tries if t["metrics_read"]]
    checks["hung_read_answered_as_a_miss"] = (all(t["B_answered"] for t in tries) and last["metrics_read"]
                                             and last["B_load_deadline_misses"] >= 1)
    checks["others_stored_and_evicted_during_hang"] = all(t["A_answered_during"] == 6 for t in tries) and bool(read) \
        and all(t["A_evictions_during"] > 0 and t["A_files_written_during"] > 0 for t in read)
    return {**last, "tries": tries}


def hang_try(client: Client, a: Server, b: Server, root: Path, ctl: Path, t_start: float,
             attempt: int) -> dict[str, Any]:
    probe = [2 * 10**9 + 1000 * attempt + i for i in range(8)]
    before = set(root.rglob("*.kvf"))
    refused0 = tier_metric(a.metrics(), "vllm:kv_offload_kvformat_store_failures_total")
    assert client.send("A", probe, "hang-store", max_tokens=16)["ok"]
    # Every file of the prompt must be on the hung list (a fixed 3 s wait listed 1 of 8 at 01d0777: the evictor bug)
    new = landed(client, root, before, len(probe), f"hang{attempt}")
    refused = tier_metric(a.metrics(), "vllm:kv_offload_kvformat_store_failures_total") - refused0
    ctl.write_text("".join(p.name + "\n" for p in new))
    ma0, mb0 = a.metrics(), b.metrics()
    t_hang = time.monotonic()
    hung: dict[str, Any] = {}
    th = threading.Thread(target=lambda: hung.update(client.send("B", probe, "hang-load")))
    th.start()
    side = [client.send("A", [3 * 10**9 + 10**6 * attempt + 100 * j + i for i in range(MAX_IDS)], "during-hang")
            for j in range(6)]
    th.join(120)
    ma1, mb1 = a.metrics(), b.metrics()
    ctl.write_text("")

    def delta(m0: dict[str, float], m1: dict[str, float], name: str) -> float:
        return tier_metric(m1, name) - tier_metric(m0, name)

    return {"fault": "hung read on B", "t": round(t_hang - t_start, 1), "files": len(new), "A_stores_refused": refused,
         "metrics_read": all(bool(m) for m in (ma0, mb0, ma1, mb1)),
         "B_answered": bool(hung.get("ok", False)), "B_answer_s": round(hung.get("s", -1), 2),
         "B_load_deadline_misses": delta(mb0, mb1, "vllm:kv_offload_kvformat_load_deadline_misses"),
         "B_stale_view_misses": delta(mb0, mb1, "vllm:kv_offload_kvformat_stale_view_misses"),
         "A_answered_during": sum(x["ok"] for x in side),
         "A_evictions_during": delta(ma0, ma1, "vllm:kv_offload_kvformat_evictions"),
         "A_files_written_during": delta(ma0, ma1, "vllm:kv_offload_kvformat_files_written"), "deadline_s": DEADLINE_S,
         # the evictor's order decides how long a just-stored file stays (eviction="ghost-slru")
         "protected_share": {n: tier_metric(m, "vllm:kv_offload_kvformat_protected_share") for n, m in (("A", ma0), ("B", mb0))}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--work", default=None)
    ap.add_argument("--max-files", type=int, default=400, help="max_bytes of the root, in chunk files")
    ap.add_argument("--tier", choices=("kvformat", "fs"), default="kvformat",
                    help="fs: the same fleet and client on vLLM's own fs tier (one shared root_dir), no faults")
    ap.add_argument("--against", default=None,
                    help="another run's fleet.json (e.g. --tier fs): B's held-out answers must equal its")
    ap.add_argument("--moosefs", action="store_true",
                    help="the root on MooseFS (tools/dfs_up.sh), A and B each on its own client mount")
    args = ap.parse_args()
    # A timeout's SIGTERM must still stop the servers (their own sessions) and unmount: through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    work = Path(args.work or f"/tmp/kvf-fleet-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    t_start, t0_wall = time.monotonic(), time.time()
    model = write_model(work / "model") if not (work / "model" / "config.json").exists() else work / "model"
    root, mnt, ctl = work / "root", work / "mnt", work / "hang.list"
    b_source = root  # what B's hang layer passes through to
    if args.moosefs:
        up = subprocess.run(["bash", str(REPO / "tools" / "dfs_up.sh"), "2"], capture_output=True, text=True,
                            env={**os.environ, "KVF_DFS_NICE": "0"})  # dfs_up.sh: -19 starved the kernel here
        if up.returncode != 0:
            print(json.dumps({"not_run": f"MooseFS did not start (tools/dfs_up.sh rc={up.returncode})",
                              "stderr": up.stderr[-500:]}))
            return 2
        mounts = up.stdout.split()
        root, b_source = Path(mounts[0]) / "fleet", Path(mounts[1]) / "fleet"
    root.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    ctl.write_text("")
    hangfs = subprocess.Popen([sys.executable, str(REPO / "tests" / "hangfs.py"), str(b_source), str(mnt), str(ctl)],
                              stdout=open(work / "hangfs.log", "w"), stderr=subprocess.STDOUT)
    for _ in range(100):
        if os.path.ismount(mnt):
            break
        time.sleep(0.2)
    else:
        print(json.dumps({"not_run": "the FUSE mount for B did not come up"}))
        return 2
    # one chunk file: 2 layers x 16 tokens x 576 fp32 + its 4096-byte header region
    file_bytes = 2 * BLOCK * 576 * 4 + 4096
    bound = args.max_files * file_bytes

    def ktc(r: Path) -> dict[str, Any]:
        doc = doc_tiering_config(r)
        doc["kv_connector_extra_config"]["cpu_bytes_to_use"] = 8 << 20  # small: reuse must reach the root
        extra = doc["kv_connector_extra_config"]
        if args.tier == "fs":  # vLLM's own tier in place of ours, on the same directory for both servers
            extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(root)}]
            return doc
        [t] = [t for t in extra["secondary_tiers"] if t["type"] == TIER]
        t.update(max_bytes=bound, read_deadline_s=DEADLINE_S)
        return doc

    a = Server("A", 2, 18431, model, ktc(root), work, "0|1")
    b = Server("B", 1, 18432, model, ktc(mnt), work, "1")
    servers = {"A": a, "B": b}
    faults_on = args.tier == "kvformat"
    tier_label = TIER if faults_on else ":fs"
    checks: dict[str, Any] = {}
    out: dict[str, Any] = {"tier": args.tier, "fs": "moosefs" if args.moosefs else "local", "servers": 2,
                           "tp": {"A": 2, "B": 1}, "max_bytes": bound}
    samples: list[tuple[float, int]] = []
    listing_errors: list[str] = []
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.wait(1.0):
            try:
                samples.append((time.monotonic() - t_start, kvf_bytes(root)))
            except OSError as e:  # the root unreadable (EIO on a starved MooseFS mount): a gap, not a pass
                listing_errors.append(f"{time.monotonic() - t_start:.0f}s {e}")

    try:
        a.start()
        b.start()
        if not (a.wait_up() and b.wait_up()):
            print(json.dumps({"not_run": "a server did not start", "logs": str(work)}))
            return 2
        out["startup_s"] = round(time.monotonic() - t_start, 1)
        threading.Thread(target=sample, daemon=True).start()
        client = Client(servers)
        reqs = trace_slice(args.requests)
        coin = random.Random(43)
        route = ["A" if coin.random() < 0.5 else "B" for _ in reqs]
        kill_at, restart_at = int(len(reqs) * 0.4), int(len(reqs) * 0.6)
        t_kill_wall = 0.0
        before_kill: set[int] = set()
        faults: list[dict[str, Any]] = []
        with ThreadPoolExecutor(args.in_flight) as pool:
            futs = []
            for i, (ids, where) in enumerate(zip(reqs, route)):
                if faults_on and i == kill_at:
                    for f in futs:
                        f.result()
                    before_kill = set(client.seen["A"])
                    t_kill, t_kill_wall = time.monotonic(), time.time()
                    a.kill9()
                    faults.append({"fault": "kill -9 A", "t": round(t_kill - t_start, 1), "at_request": i})
                if faults_on and i == restart_at:
                    a.start()
                    up = a.wait_up()
                    faults.append({"fault": "A restarted", "t": round(time.monotonic() - t_start, 1), "up": up})
                futs.append(pool.submit(client.send, where, ids, "replay", i))
            for f in futs:
                f.result()
        res = client.results
        out["requests"] = len(res)
        out["answered"] = sum(r["ok"] for r in res)
        down = [r for r in res if r["server"] == "A" and not r["ok"]]
        out["failed_by_design"] = len(down)
        out["failed_other"] = sum(1 for r in res if not r["ok"] and r["server"] == "B")
        checks["B_answered_every_request"] = out["failed_other"] == 0
        refused = ("APIConnectionError", "APITimeoutError")
        checks["A_failed_only_while_down"] = bool(down) == faults_on and all(r.get("error") in refused for r in down)
        out["cross_blocks"] = {n: sum(r.get("cross_blocks", 0) for r in res if r["server"] == n and r["ok"])
                               for n in servers}
        checks["cross_hits_both_ways"] = all(v > 0 for v in out["cross_blocks"].values())
        if faults_on:
            # After the restart A's caches were empty: what it found cached of blocks it had computed before the
            # kill came from files it wrote then, on the root.
            after = [r for r in res if r["server"] == "A" and r["ok"] and r["t"] > t_kill_wall]
            out["A_requests_after_restart"] = len(after)
            out["A_rejoin_hits_on_own_files"] = sum(sum(1 for h in r["cached_ids"] if h in before_kill)
                                                    for r in after)
            checks["A_rejoined_with_hits_on_its_files"] = out["A_rejoin_hits_on_own_files"] > 0
        m = {n: s.metrics() for n, s in servers.items()}
        out["tier_chunk_hits"] = {n: tier_metric(m[n], "vllm:kv_offload_tiering_chunk_hits", tier_label)
                                  for n in servers}
        out["tier_chunk_queries"] = {n: tier_metric(m[n], "vllm:kv_offload_tiering_chunk_queries", tier_label)
                                     for n in servers}
        checks["tier_hits_on_both"] = all(v > 0 for v in out["tier_chunk_hits"].values())
        engine = sum(out["tier_chunk_hits"].values())
        out.update(replay_report(res, reqs, args.max_files if faults_on else None, t_kill_wall if faults_on else None,
                                 cpu_tier_chunks(b.log_text()), m, tier_label, engine, shared=faults_on))
        # A chunk hit is one lookup that found the chunk, not a load: a request looked up again (its promotion
        # failed to get CPU blocks, it was preempted) counts its hits again. vLLM's bytes read from the tier count
        # each chunk brought in once per load.
        chunk_payload = 2 * BLOCK * 576 * 4
        out["tier_chunks_read"] = {n: tier_metric(m[n], "vllm:kv_offload_tiering_read_bytes", tier_label)
                                   / chunk_payload for n in servers}
        read = sum(out["tier_chunks_read"].values())
        out["engine_read_over_replay"] = round(read / out["replay_root_blocks"], 3) if out["replay_root_blocks"] \
            else None
        out["promotion_failures"] = {n: tier_metric(m[n], "vllm:kv_offload_tiering_promotion_job_failures", tier_label)
                                     + tier_metric(m[n], "vllm:kv_offload_tiering_promotion_allocation_failures",
                                                   tier_label) for n in servers}
        if faults_on:
            checks["B_took_the_evictor_role"] = "this engine is now the evictor" in b.log_text()
            # the files on the root and their writers, from the headers
            tps: dict[str, int] = {}
            for p in root.rglob("*.kvf"):
                if ".quarantine" not in p.parts:
                    tp = writer_tp(p)
                    tps[str(tp)] = tps.get(str(tp), 0) + 1
            out["files_by_writer_tp"] = tps
            checks["files_of_both_writers"] = set(tps) >= {"1", "2"}
        else:
            out["root_bytes_unbounded"] = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        heldout_phase(client, a, root, out, checks, Path(args.against) if args.against else None)
        settle(root)  # the corrupt phase picks the files new after its own store: none of these may still land
        if faults_on:
            faults.append(corrupt_phase(client, a, b, root, out, checks, t_start))
            faults.append(hang_phase(client, a, b, root, ctl, out, checks, t_start))
        out["faults"] = faults
        stop_sampling.set()
        peak = max((s for _, s in samples), default=0)
        out["root_bytes_max"] = peak
        out["root_bytes_bound_plus_one_chunk_per_writer"] = bound + 2 * file_bytes
        if faults_on:  # a second the root could not be listed is a second the bound was not seen to hold
            checks["bound_held"] = peak <= bound + 2 * file_bytes and not listing_errors
        out["samples"] = len(samples)
        out["root_listing_errors"] = listing_errors[:5] + ([f"... {len(listing_errors)} in all"]
                                                             if len(listing_errors) > 5 else [])
    finally:
        stop_sampling.set()
        for s in servers.values():
            s.stop()
        ctl.write_text("")
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        hangfs.terminate()
        if args.moosefs:
            subprocess.run(["bash", str(REPO / "tools" / "dfs_down.sh")], capture_output=True)
    out["checks"] = checks
    out["ok"] = bool(checks) and all(checks.values())
    out["seconds"] = round(time.monotonic() - t_start, 1)
    (work / "fleet.json").write_text(json.dumps({**out, "t0_wall": t0_wall, "results": client.results,
                                                     "samples": samples}))
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
