"""Run it as an operator does (issue 21), through vLLM's real tiering manager: unusable roots fail start-up naming
the parameter (or start degraded and recover), a mount that goes away stops the writes instead of filling the disk
underneath, bad parameters are named, failed stores are counted by reason, logs appear under vLLM's own logging
configuration, and two kvformat tiers in one engine are two sets of series in what Prometheus scrapes.
S3 roots (bucket typo, endpoint down, bad credentials): tests/test_operators_s3.py.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

from tmpfs_mount import tmpfs  # noqa: E402
from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload, wait_for  # noqa: E402

from kvformat.errors import RootUnusableError, SchemaError  # noqa: E402
from kvformat.vllm import METRIC_PREFIX  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
N_LAYERS = 3
FILE = N_LAYERS * 16 * 576 * 2 + 4096  # one chunk file of these deployments (payload + 4 KiB header region)


def kvf(root: object, **kw: object) -> dict:
    return kvformat_tier(str(root), read_threads=2, write_threads=2, shared_interval_s=0.1, **kw)


def items_for(dep: Deployment, n: int, salt: str) -> dict:
    return {k: make_payload(k.hex(), dep.slot_bytes) for k in make_keys(n, salt)}


def kvf_files(root: object) -> list[Path]:
    return [p for p in Path(str(root)).rglob("*.kvf") if ".quarantine" not in p.parts]


# -- unusable roots ------------------------------------------------------------------------------------------

def test_root_that_is_a_regular_file_is_named(tmp_path: Path) -> None:
    f = tmp_path / "cache"
    f.write_bytes(b"not a directory")
    with pytest.raises(SchemaError, match=r"^root: .*cache exists and is not a directory") as e:
        Deployment([kvf(f)], n_layers=N_LAYERS)
    assert e.value.field == "root"
    with pytest.raises(RootUnusableError, match=r"^root: .*not a directory") as e2:  # a path through a file
        Deployment([kvf(f / "sub")], n_layers=N_LAYERS)
    assert e2.value.field == "root" and isinstance(e2.value.cause, OSError)


def test_read_only_root_fails_startup_then_degraded_start_recovers(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "size=16m,ro,mode=0755") as root:
        with pytest.raises(RootUnusableError, match="read-only filesystem") as e:
            Deployment([kvf(root)], n_layers=N_LAYERS)
        assert e.value.field == "root" and e.value.step == "write" and "EROFS" not in str(e.value.field)
        with Deployment([kvf(root, start_degraded=True)], n_layers=N_LAYERS) as dep:
            tier = dep.tier()
            c = tier.counters()
            assert c["root_healthy"] == 0 and not tier.wait_ready(0.5)
            items = items_for(dep, 3, "degraded")
            dep.store(items)
            c = tier.counters()
            assert c["files_written"] == 0 and c["store_failures:root_degraded"] == 3
            # The operator fixes the root: the tier probes it again on its own and starts storing.
            subprocess.run(["mount", "-o", "remount,rw", root], check=True)
            assert wait_for(lambda: tier.counters()["root_healthy"] == 1)
            assert tier.wait_ready(20)
            dep.evict_primary()
            dep.store(items)
            dep.evict_primary()
            assert dep.load(list(items)) == items
            assert len(kvf_files(root)) == 3


def test_vanished_mount_stops_writes_and_never_writes_underneath(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "size=16m,mode=0755") as root:
        with Deployment([kvf(root)], n_layers=N_LAYERS) as dep:
            tier = dep.tier()
            first = items_for(dep, 2, "mounted")
            dep.store(first)
            assert tier.counters()["files_written"] == 2
            subprocess.run(["umount", "-l", root], check=True)  # the mount goes away (NFS gone, lazy unmount)
            later = items_for(dep, 4, "unmounted")
            dep.store(later)
            assert wait_for(lambda: tier.counters()["root_healthy"] == 0)
            dep.store(items_for(dep, 2, "still unmounted"))
            c = tier.counters()
            # Nothing was written to the disk under the mount point, and every chunk not stored is counted.
            assert os.listdir(mnt) == [], list(Path(mnt).rglob("*"))
            assert c["files_written"] == 2 and c["store_failures"] == 6, c
            assert c.get("store_failures:ENOENT", 0) + c.get("store_failures:root_lost", 0) == 6, c
            dep.evict_primary()
            assert set(dep.load(list(later)).values()) == {None}  # loads are misses, never from elsewhere


# -- parameters ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field,text", [
    ({"storage_options": {"timeout_s": "abc"}}, "storage_options.timeout_s", "expected a number"),
    ({"storage_options": {"max_retries": -1}}, "storage_options.max_retries", ">= 0"),
    ({"storage_options": {"endpoint": "http://127.0.0.1:1"}}, "storage_options.endpoint", "did you mean 'endpoint_url'"),
    ({"storage_options": {"timeout": 5}}, "storage_options.timeout", "did you mean 'timeout_s'"),
    ({"storage_options": ["x"]}, "storage_options", "expected a dict"),
    ({"max_bytes": "12 apples"}, "max_bytes", "expected a byte count"),
    ({"max_bytes": 500}, "max_bytes", rf"smaller than one chunk file of this deployment \({FILE} bytes"),
    ({"max_bytes": 40 * FILE, "shared_allowance": 100}, "shared_allowance", f"one chunk file \\({FILE} bytes"),
    ({"shared_interval_s": 0}, "shared_interval_s", "expected a number in"),
    ({"start_degraded": "yes"}, "start_degraded", "expected true or false"),
    ({"locality": "MARS"}, "locality", "expected one of LOCAL, REMOTE"),
])
def test_bad_parameters_are_named(tmp_path: Path, kw: dict, field: str, text: str) -> None:
    root = f"s3://kvf-never-contacted/x" if "storage_options" in kw else str(tmp_path / "root")
    with pytest.raises(SchemaError) as e:
        Deployment([kvformat_tier(root, **kw)], n_layers=N_LAYERS)
    assert e.value.field == field and re.search(text, str(e.value)), str(e.value)
    assert str(e.value).startswith(f"{field}: ")


@pytest.mark.parametrize("locality", ["local", ""])
def test_bad_locality_is_refused_as_vllms_own_tiers_refuse_it(tmp_path: Path, locality: str) -> None:
    # vLLM 0.34's fs-tier test expects ValueError matching "Locality"; kvformat's names the parameter too.
    with pytest.raises(ValueError, match="Locality") as e:
        Deployment([kvformat_tier(str(tmp_path / "root"), locality=locality)], n_layers=N_LAYERS)
    assert isinstance(e.value, SchemaError) and e.value.field == "locality"


def test_an_unusable_root_is_an_os_error_as_vllms_contract_says(tmp_path: Path) -> None:
    # vLLM's fs tier raises the OSError of a root it cannot write; callers catching OSError must catch ours.
    with pytest.raises(OSError) as e:
        Deployment([kvformat_tier("/dev/null/invalid_path")], n_layers=N_LAYERS)
    assert isinstance(e.value, RootUnusableError) and e.value.field == "root" and e.value.errno == errno.ENOTDIR


def test_small_max_bytes_is_warned_with_the_chunk_size(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="vllm.kvformat")
    with Deployment([kvf(tmp_path, max_bytes=5 * FILE)], n_layers=N_LAYERS) as dep:
        assert dep.tier().wait_ready(20)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "vllm.kvformat"]
    assert any(f"holds only 5 chunk files of {FILE} bytes" in m for m in warned), warned


# -- failures counted, warnings repeated ---------------------------------------------------------------------

def test_full_disk_store_failures_by_reason_and_a_warning_that_repeats(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="vllm.kvformat")
    with tmpfs(tmp_path / "small", f"size={6 * FILE + 64 * 1024},mode=0755") as root:
        with Deployment([kvf(root)], n_layers=N_LAYERS, num_chunks=32) as dep:
            tier = dep.tier()
            tier.log.interval_s = 0.5  # the default is a minute: a repeat must come within the test
            dep.store(items_for(dep, 12, "full"))
            c = tier.counters()
            assert c["files_written"] >= 3 and c["store_failures:ENOSPC"] == 12 - c["files_written"], c
            first = [r for r in caplog.records if "ENOSPC" in r.getMessage()]
            assert len(first) == 1  # once for the burst, not once per chunk
            time.sleep(0.6)
            dep.store(items_for(dep, 3, "full again"))  # the disk fills again later: reported again
            time.sleep(0.7)  # and what was held back is reported with its count
            failed = tier.counters()["store_failures:ENOSPC"]
            lines = [r.getMessage() for r in caplog.records if "ENOSPC" in r.getMessage()]
            plain = [m for m in lines if "storing a chunk failed" in m]
            counted = sum(int(n) for m in lines for n in re.findall(r"(\d+) more (?:like this|'store:ENOSPC')", m))
            # The first at once, the rest once per interval with their count: every failure accounted for, in a few lines.
            assert plain and len(lines) >= 2 and len(plain) + counted == failed and len(lines) < failed, (failed, lines)
            stats = dep.stats().reduce()
            key = f"{METRIC_PREFIX}store_failures_by_reason:('1:KVFormatTier', 'ENOSPC')"
            assert stats[key] == tier.counters()["store_failures:ENOSPC"], {k: v for k, v in stats.items()
                                                                              if "store_failures" in k}


# -- logs under vLLM's logging configuration -----------------------------------------------------------------

LOG_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # what vLLM's engine-core process does first (v1/engine/core.py)
from pathlib import Path
from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload
root = sys.argv[3]
with Deployment([kvformat_tier(root, read_threads=1, write_threads=1, max_bytes="1GiB", shared_interval_s=0.1)],
                n_layers=3) as dep:
    tier = dep.tier()
    assert tier.wait_ready(30)
    keys = make_keys(3, "logs")
    dep.store({k: make_payload(k.hex(), dep.slot_bytes) for k in keys})
    for p in Path(root).rglob("*.kvf"):  # damage every file: three checksum failures on the loads below
        b = bytearray(p.read_bytes()); b[-1] ^= 1; p.write_bytes(bytes(b))
    dep.evict_primary()
    dep.load(keys)
    time.sleep(0.5)
"""


def test_logs_visible_under_vllms_logging_config(tmp_path: Path) -> None:
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    r = subprocess.run([sys.executable, "-c", LOG_CHILD, ROOT, TESTS, str(root)], capture_output=True, text=True,
                       timeout=300, env={**env, "VLLM_LOGGING_COLOR": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    # vLLM's format: "(<process> pid=<pid>) LEVEL mm-dd hh:mm:ss [file:line] message"
    line = r"\(\S+ pid=\d+\) {level} \d\d-\d\d \d\d:\d\d:\d\d \[(?!_log\.py)[^\]]+\] kvformat tier 1:KVFormatTier: {text}"
    assert re.search(line.format(level="INFO", text=f"starting on {root} \\(local\\)"), out), out[-3000:]
    ready = re.search(line.format(level="INFO", text=r"ready: root (\S+) \(local\), .*max_bytes=1073741824 .*found "
                                  r"\d+ files .*read \+ 1 write threads, verify=True, compression=none"), out)
    assert ready and ready.group(1) == str(root), out[-3000:]
    checksum = re.findall(line.format(level="WARNING", text=".*checksum mismatch.*served as a miss"), out)
    assert len(checksum) == 1, out[-3000:]  # three failures, one line: the repeats wait for the interval


# -- metrics: two kvformat tiers, both scraped ---------------------------------------------------------------

def test_two_kvformat_tiers_metrics_both_scraped(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    nvme, bucket = tmp_path / "nvme", f"memory://kvft-{uuid.uuid4().hex[:8]}/cache"
    tiers = [kvf(nvme, max_bytes=8 * FILE), kvformat_tier(bucket, read_threads=2, write_threads=2)]
    with Deployment(tiers, n_layers=N_LAYERS, num_chunks=8) as dep:
        dep.store(items_for(dep, 5, "two tiers"))  # the local tier keeps 5 files, the second tier too
        dep.store(items_for(dep, 6, "more"))  # past the local bound: evictions on tier 1 only
        stats = dep.stats()
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20, "secondary_tiers": tiers}
    kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    # vLLM's own Prometheus path (the frontend's KVConnectorProm -> OffloadPromMetrics) into a fresh registry.
    # VllmConfig itself cannot be built without an accelerator: only its kv_transfer_config is read here.
    reg = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=reg)  # type: ignore[assignment]
        _counter_cls = functools.partial(Counter, registry=reg)  # type: ignore[assignment]
        _histogram_cls = functools.partial(Histogram, registry=reg)  # type: ignore[assignment]

    prom = Prom(types.SimpleNamespace(kv_transfer_config=kv), ["model_name", "engine"], {0: ["m", "0"]})
    assert prom.prom_metrics is not None
    prom.observe(stats.data, 0)
    text = generate_latest(reg).decode()
    series = dict(re.findall(r'^(vllm:kv_offload_kvformat_\w+\{[^}]*\}) (\S+)$', text, re.M))
    (tmp_path / "scrape.txt").write_text(text)

    def value(name: str, tier: str) -> float:
        key = f'{METRIC_PREFIX}{name}{{engine="0",model_name="m",tier="{tier}"}}'
        if name.endswith("_total"):  # a counter that never moved has no series yet
            return float(series.get(key, 0))
        return float(series[key])

    for name in ("files", "used_bytes", "root_healthy"):
        assert f'{METRIC_PREFIX}{name}{{engine="0",model_name="m",tier="1:KVFormatTier"}}' in series, text[-2000:]
    assert value("files", "1:KVFormatTier") == 8 and value("files", "2:KVFormatTier") == 11
    assert value("used_bytes", "1:KVFormatTier") == 8 * FILE and value("used_bytes", "2:KVFormatTier") == 11 * FILE
    assert value("evictions_total", "1:KVFormatTier") == 3 and value("evictions_total", "2:KVFormatTier") == 0
    assert value("files_written_total", "1:KVFormatTier") == value("files_written_total", "2:KVFormatTier") == 11
    assert value("root_healthy", "1:KVFormatTier") == value("root_healthy", "2:KVFormatTier") == 1
    # The codec each tier writes with, labelled with how it was set (auto: tests/test_auto_compression.py).
    info = {k: float(v) for k, v in series.items() if k.startswith(METRIC_PREFIX + "compression_info{")}
    assert len(info) == 2 and set(info.values()) == {1.0}, info
    assert all('codec="none"' in k and 'mode="fixed"' in k for k in info), info
    print(json.dumps({k: v for k, v in series.items() if "files" in k or "used_bytes" in k}, indent=1))
