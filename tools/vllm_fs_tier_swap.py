"""pytest plugin: vLLM's own fs-tier tests (``tests/v1/kv_offload/tiering/test_fs_tier.py``) run on KVFormatTier.

Loaded only by ``tools/vllm_fs_tier_tests.sh`` (``-p vllm_fs_tier_swap``), never by the main suite: it replaces
``vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager`` for the whole process, so the test module's
``FileSystemTierManager`` and the factory's ``"fs"`` type both build a KVFormatTier.

The swap (:class:`FsTierAsKVFormat`) takes the fs tier's constructor arguments and gives KVFormatTier what a
real deployment gives it. The test's spec is a MagicMock with no KV-cache groups; the swap keeps its parallel
config, row layout and KV-event flag and builds vLLM's real objects around them: an ``OffloadingConfig`` with
one MLA group, a ``TieringOffloadingSpec`` and a ``KVCacheConfig`` of ``MLAAttentionSpec`` layers whose slot is
exactly the test's 2 MiB row (64 layers x 16 tokens x 512 x float32), so every byte the test compares is a
byte the tier stores. It also names the fs tier's internals the tests read by what holds the same thing here:

* ``file_mapper.get_file_name(key)`` / ``base_path``: the key's ``.kvf`` file and its namespace directory;
* ``_lookup_manager``: the tier's ``AsyncLookupManager`` (the same vLLM class the fs tier uses);
* ``_pool._load_q`` / ``_store_q`` / ``_threads``: the I/O pool's two queues and its threads;
* ``_store_jobs``: store results the tier still holds after ``get_finished_jobs`` took them (none, when it
  keeps no per-job state; the tests check exactly that);
* ``_use_o_direct``: whether the store opens payload reads with O_DIRECT.

Every other difference is in :data:`DIFFERENCES`: one row per test, "xfail" (it runs and must fail, strictly,
for the reason given) or "deselect" (not a test of a tier, or a variant that runs no other code here). The
same rows are the table in docs/vllm.md ("vLLM's own fs-tier tests"); the run fails if the two disagree, if a
row names no collected test, or if any test skips.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

import vllm.v1.kv_offload.tiering.fs.manager as fs_manager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx
from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvformat.vllm import KVFormatTier

_TOKENS, _WIDTH, _DTYPE = 16, 512, torch.float32  # one layer's page: 16 x 512 x 4 B = 32 KiB

# test name -> (kind, reason). The reasons are the docs' table rows, word for word.
DIFFERENCES: dict[str, tuple[str, str]] = {
    "test_wait_idle_blocks_until_tasks_complete": (
        "deselect", "tests vLLM's `DualQueueThreadPool` class on its own; no tier is built"),
    "test_batch_lookup_c_extension": (
        "deselect", "tests vLLM's `fs_io_C.batch_lookup` C function on its own; no tier is built"),
    "test_failed_load_corrects_verdict_and_removes_corrupt_file": (
        "xfail", "its load job runs for request `test` (`make_job`), its lookups for another request. A failed "
                 "load is a miss at once for the request that ran it; the other request, whose HIT came from "
                 "the tier's index (no probe cached), probes again: RETRY, then MISS (the file is quarantined). "
                 "The fs tier flips the probe result that request still holds to MISS"),
    "test_batched_partial_load_failure_keeps_loaded_blocks": (
        "xfail", "the same: the corrupt last chunk is RETRY, then MISS, for the request that did not run the "
                 "load; the two chunks before it load and are reported in `successful_keys`, as the test wants"),
    "test_batched_load_first_block_fails_marks_whole_batch": (
        "xfail", "a job's chunks load independently (in parallel), so the chunks after a bad first one still "
                 "load and are reported in `successful_keys`; vLLM's contract allows any subset, and the "
                 "scheduler's prefix stops at the first miss"),
    "test_failed_load_after_abort_does_not_break_newer_probe": (
        "xfail", "deletes a stored file behind the tier's back and expects the next lookup to start a probe "
                 "(RETRY); KVFormatTier answers a file in its index at once (HIT) and drops it from the index "
                 "when the load finds it gone"),
    "test_mixed_job_results_emit_event_only_for_successful_job": (
        "xfail", "fails a store by replacing the fs tier's `batch_store_block`, which KVFormatTier never "
                 "calls, so both stores succeed; the contract on KVFormatTier's own write path: "
                 "tests/test_tier_store_events.py"),
    "test_partially_failed_store_emits_no_event": (
        "xfail", "the same injection. KVFormatTier also differs: a store job announces each chunk now on "
                 "storage, so a partly failed job has an event for its stored chunks (the fs tier writes a job "
                 "as one batch and announces none); tests/test_tier_store_events.py"),
}
# Parameters that choose between vLLM's own I/O backends: KVFormatTier has one I/O path, run by the other value.
PARAM_DESELECT: dict[tuple[str, Any], str] = {
    ("use_c_ext", True): "selects vLLM's C I/O extension over its Python fallback; KVFormatTier has one I/O path, "
                         "run by the `use_c_ext=False` variant",
}
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "vllm.md")
DOC_HEADING = "## vLLM's own fs-tier tests"


class _FileMapper:
    """The fs tier's ``file_mapper`` as KVFormatTier names files: ``<root>/<namespace>/<h[:2]>/<h[2:4]>/<h>.kvf``."""

    def __init__(self, tier: "FsTierAsKVFormat") -> None:
        self._tier = tier
        self.base_path = os.path.join(tier.store.root, tier.namespace)

    def get_file_name(self, key: Any) -> str:
        eng = self._tier.engines[get_offload_group_idx(key)]
        return os.path.join(self._tier.store.root, eng.relpath(get_offload_block_hash(key).hex()))


def _real_spec(mock_spec: Any, row_bytes: int) -> tuple[TieringOffloadingSpec, KVCacheConfig]:
    """vLLM's spec and KV-cache config of an MLA deployment whose slot is ``row_bytes``, keeping the test's
    parallel config, row layout and KV-event flag."""
    page = _TOKENS * _WIDTH * torch.tensor([], dtype=_DTYPE).element_size()
    if row_bytes % page:
        raise ValueError(f"row of {row_bytes} bytes is not a whole number of {page}-byte MLA pages")
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(row_bytes // page))
    base = mock_spec.config
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(_TOKENS, names, 0),), worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=base.enable_kv_cache_events,
        extra_config={"cpu_bytes_to_use": 1 << 30, "secondary_tiers": []}, engine_id=base.engine_id,
        model=base.model, cache=OffloadingCacheConfig(tokens_per_hash=base.cache.tokens_per_hash,
                                                      blocks_per_chunk=base.cache.blocks_per_chunk),
        parallel=base.parallel, replicated_layout=base.replicated_layout)
    spec = TieringOffloadingSpec(cfg)
    mla = MLAAttentionSpec(block_size=_TOKENS, num_kv_heads=1, max_tp_shards=1, head_size=_WIDTH, dtype=_DTYPE)
    kc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(names), mla)],
                       kv_tp_replicas=max(1, base.parallel.tp_size))
    return spec, kc


class FsTierAsKVFormat(KVFormatTier):
    """KVFormatTier behind the fs tier's constructor (``root_dir``, ``n_read_threads``, ``n_write_threads``)."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, root_dir: str,
                 n_read_threads: int = 16, n_write_threads: int = 16, enable_kv_events: bool = False,
                 locality: str | None = None, backpressure_detector: Any = None) -> None:
        # A local named kv_cache_config: the tier finds vLLM's KV-cache config in its caller's frames, as it
        # does inside vLLM's connector (kvformat.vllm._facts._vllm_context).
        spec, kv_cache_config = _real_spec(offloading_spec, (primary_kv_view.strides or (0,))[0])
        super().__init__(spec, primary_kv_view, tier_type, root=root_dir, read_threads=n_read_threads,
                         write_threads=n_write_threads, enable_kv_events=enable_kv_events, locality=locality,
                         backpressure_detector=backpressure_detector)
        if self.facts.source != "vLLM KV-cache config" or not self.facts.replicated_kv_known:
            raise AssertionError(f"the tier did not take the MLA KV-cache config ({self.facts.source})")
        self.file_mapper = _FileMapper(self)
        self._lookup_manager = self._lookups
        self._pool._load_q = self._pool._loads  # type: ignore[attr-defined]  # the same deques, not copies
        self._pool._store_q = self._pool._stores  # type: ignore[attr-defined]

    @property
    def _store_jobs(self) -> dict[int, Any]:
        return dict(enumerate(self._jobs._store_outcomes))

    @property
    def _use_o_direct(self) -> bool:
        return bool(self.store.o_direct != "off")  # type: ignore[attr-defined]


fs_manager.FileSystemTierManager = FsTierAsKVFormat


def _doc_rows() -> dict[str, tuple[str, str]]:
    """The docs' table: ``| `test id` | kind | reason |`` rows under :data:`DOC_HEADING`."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    start = text.find(DOC_HEADING)
    if start < 0:
        return {}
    end = text.find("\n## ", start + 1)
    rows = {}
    for m in re.finditer(r"^\| `([^`]+)` \| (\w+) \| (.*) \|$", text[start:end if end > 0 else None], re.M):
        rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def _expected_doc_rows() -> dict[str, tuple[str, str]]:
    rows = {name: kind_reason for name, kind_reason in DIFFERENCES.items()}
    for (param, value), reason in PARAM_DESELECT.items():
        rows[f"[{param}={value}]"] = ("deselect", reason)
    return rows


_COUNTS: dict[str, int] = {}


@pytest.hookimpl(trylast=True)  # after -k / -m: the counts are of what runs
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    if os.environ.get("KVFORMAT_FS_TIER_ALL") == "1":  # every test, unmarked: to re-check the differences
        _COUNTS.update(collected=len(items), deselected=0, run=len(items))
        return
    problems = []
    doc, want = _doc_rows(), _expected_doc_rows()
    problems += [f"docs/vllm.md '{DOC_HEADING}' row `{n}` is {doc.get(n)}, tools/vllm_fs_tier_swap.py has {want.get(n)}"
                 for n in sorted(set(doc) | set(want)) if doc.get(n) != want.get(n)]
    names = {item.originalname for item in items}
    problems += [f"no collected test is named {n} (stale row)" for n in DIFFERENCES if n not in names]
    keep, drop = [], []
    for item in items:
        kind, reason = DIFFERENCES.get(item.originalname, ("run", ""))
        params = getattr(getattr(item, "callspec", None), "params", {})
        for (param, value), why in PARAM_DESELECT.items():
            if params.get(param, object()) is value:
                kind, reason = "deselect", why
        if kind == "deselect":
            drop.append(item)
            continue
        if kind == "xfail":
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True, raises=AssertionError))
        keep.append(item)
    if problems:
        raise pytest.UsageError("; ".join(problems))
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    _COUNTS.update(collected=len(keep) + len(drop), deselected=len(drop), run=len(keep))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _COUNTS["skipped"] = _COUNTS.get("skipped", 0) + 1  # a skip here is a test that did not run: it fails


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    n = {k: len(terminalreporter.stats.get(k, [])) for k in ("passed", "failed", "xfailed", "xpassed", "skipped",
                                                             "error")}
    terminalreporter.write_line(
        f"vllm-fs-tier-tests: vLLM's test_fs_tier.py on KVFormatTier: {_COUNTS.get('collected', 0)} collected, "
        f"{_COUNTS.get('run', 0)} run: {n['passed']} passed, {n['xfailed']} xfailed (listed differences), "
        f"{n['failed']} failed, {n['xpassed']} xpassed, {n['skipped']} skipped, {n['error']} errors; "
        f"{_COUNTS.get('deselected', 0)} deselected (listed)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _COUNTS.get("skipped") and session.exitstatus == 0:
        session.exitstatus = 1  # no test may skip silently
