"""``kvformat compact`` on hand-built legacy trees: layouts, replica checks, resume, hints, refusals."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import kvformat as K
from kvformat.cli import main
from kvformat import BlockKey
from kvformat.format._paths import NAMESPACE_FILE
from kvformat.errors import LegacyLayoutError
from kvformat.legacy import find_namespaces, infer_row
from kvformat.storage import open_store

from legacy_trees import PAD_BYTE, build, config_dir, payload


def _outputs(dst: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _d, files in os.walk(dst):
        for n in files:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, dst)] = open(p, "rb").read()
    return out


def _read_back(dst: str, tree) -> dict[str, bytes]:
    store = open_store(dst)
    got = {}
    for e in store.list():
        hdr = store.read_header(e.relpath)
        buf = bytearray(hdr.raw_bytes)
        store.read_into(e.relpath, buf)
        got[hdr.key.hash] = bytes(buf)
    return got


def _json_run(argv: list[str], capsys) -> tuple[int, dict]:
    rc = main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tp,replicated,bpf,n_layers", [
    (2, False, 1, 4), (4, False, 4, 4), (8, False, 1, 3), (1, True, 1, 4), (4, True, 4, 3), (2, False, 4, 27),
])
def test_compact_layouts_bytes_equal(tmp_path, capsys, tp, replicated, bpf, n_layers):
    t = build(str(tmp_path / "src"), tp=tp, replicated=replicated, bpf=bpf, n_layers=n_layers, n_files=5)
    rc, rep = _json_run(["compact", t.root, str(tmp_path / "dst")], capsys)
    assert rc == 0 and rep["converted"] == 5 and rep["failed"] == 0
    ns = rep["namespaces"][0]
    assert ns["row"] == ("replicated" if replicated else "per_worker")
    assert ns["slots"] == (1 if replicated else tp) and ns["padding"] == t.row_bytes - t.slot_bytes * t.copies
    assert _read_back(str(tmp_path / "dst"), t) == t.payloads
    # padding never reaches the payload; the output holds one slot, not tp of them
    assert rep["bytes_after"] == 5 * (4096 + t.slot_bytes) and rep["bytes_before"] == 5 * t.row_bytes


def test_tp_sizes_share_one_namespace(tmp_path, capsys):
    a = build(str(tmp_path / "src"), tp=8, salt="a")
    b = build(str(tmp_path / "src"), tp=2, salt="b")
    c = build(str(tmp_path / "src"), tp=1, replicated=True, salt="c")
    rc, rep = _json_run(["compact", a.root, str(tmp_path / "dst")], capsys)
    assert rc == 0 and rep["converted"] == 18
    assert len({n["namespace"] for n in rep["namespaces"]}) == 1
    store = open_store(str(tmp_path / "dst"))
    assert len(store.namespaces()) == 1
    assert _read_back(str(tmp_path / "dst"), a) == {**a.payloads, **b.payloads, **c.payloads}
    tps = {store.read_header(e.relpath).provenance.tp for e in store.list()}
    assert tps == {8, 2, 1}


def test_tampered_replica_refused_rest_converted(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=4, n_files=6)
    bad_hash = sorted(t.paths)[2]
    good = t.payloads[bad_hash]
    slots = [good, good, bytearray(good), good]
    slots[2][1000] ^= 0x01
    with open(t.paths[bad_hash], "wb") as f:
        f.write(t.row(good, [bytes(s) for s in slots]))
    rc, rep = _json_run(["compact", t.root, str(tmp_path / "dst")], capsys)
    assert rc == 1 and rep["converted"] == 5 and rep["failed"] == 1
    assert rep["failures"][0]["path"] == t.paths[bad_hash] and rep["failures"][0]["reason"] == "ReplicaMismatchError"
    assert os.path.exists(t.paths[bad_hash])  # source kept
    got = _read_back(str(tmp_path / "dst"), t)
    assert bad_hash not in got and len(got) == 5
    assert all(got[h] == t.payloads[h] for h in got)
    # the human output names the file too
    rc = main(["compact", "-q", t.root, str(tmp_path / "dst2")])
    out = capsys.readouterr()
    assert rc == 1 and t.paths[bad_hash] in out.err and "failed 1" in out.out


def test_rerun_skips_valid_outputs_and_repairs_bad_ones(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=2, n_files=4)
    dst = str(tmp_path / "dst")
    assert main(["compact", "-q", t.root, dst]) == 0
    first = _outputs(dst)
    capsys.readouterr()
    some = next(p for p in first if p.endswith(".kvf"))
    mtime = os.stat(os.path.join(dst, some)).st_mtime_ns
    os.utime(os.path.join(dst, some), (1, 1))  # as if killed between the rename and the utime
    rc, rep = _json_run(["compact", t.root, dst], capsys)
    assert rc == 0 and rep["converted"] == 0 and rep["skipped"] == 4 and rep["bytes_read"] == 0
    assert os.stat(os.path.join(dst, some)).st_mtime_ns == mtime
    victim = next(p for p in first if p.endswith(".kvf"))
    with open(os.path.join(dst, victim), "r+b") as f:  # a damaged header is not "valid": rewritten
        f.seek(40)
        f.write(b"#")
    rc, rep = _json_run(["compact", t.root, dst], capsys)
    assert rc == 0 and rep["converted"] == 1 and rep["skipped"] == 3
    assert _outputs(dst) == first


def test_kill9_midway_then_rerun_gives_same_tree(tmp_path):
    t = build(str(tmp_path / "src"), tp=8, n_layers=8, n_files=400)
    clean, resumed = str(tmp_path / "clean"), str(tmp_path / "resumed")
    assert main(["compact", "-q", t.root, clean]) == 0
    cmd = [sys.executable, "-c", "import sys; from kvformat.cli import main; sys.exit(main(sys.argv[1:]))",
           "compact", "-q", t.root, resumed]
    # --fsync makes each file cost a disk flush, so the kill lands mid-run; the bytes do not depend on it
    proc = subprocess.Popen(cmd + ["--fsync"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    n = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        n = sum(len([f for f in fs if f.endswith(".kvf")]) for _d, _s, fs in os.walk(resumed))
        if n >= 20:
            break
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n = sum(len([f for f in fs if f.endswith(".kvf")]) for _d, _s, fs in os.walk(resumed))
    assert 0 < n < 400, f"kill landed outside the run ({n} outputs)"
    assert subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    a, b = _outputs(clean), _outputs(resumed)
    assert sorted(a) == sorted(b) and a == b
    for rel in a:  # LRU clock carried over from the sources, identically
        assert os.stat(os.path.join(clean, rel)).st_mtime_ns == os.stat(os.path.join(resumed, rel)).st_mtime_ns or \
            rel.endswith(NAMESPACE_FILE)


def test_jobs_and_dry_run(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=4, n_files=8)
    dst = str(tmp_path / "dst")
    rc, rep = _json_run(["compact", "--dry-run", t.root, dst], capsys)
    assert rc == 0 and len(rep["would_write"]) == 8 and not os.path.exists(dst)
    assert rep["bytes_saved"] == 8 * (t.row_bytes - 4096 - t.slot_bytes)
    rc = main(["compact", "--dry-run", t.root, dst])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("would write ") == 8 and "saved" in out
    rc, rep = _json_run(["compact", "--jobs", "3", t.root, dst], capsys)
    assert rc == 0 and rep["converted"] == 8 and rep["jobs"] == 3
    assert _read_back(dst, t) == t.payloads


def test_delete_source_only_after_verified_output(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=2, n_files=5)
    bad_hash = sorted(t.paths)[0]
    p = t.payloads[bad_hash]
    with open(t.paths[bad_hash], "wb") as f:
        f.write(t.row(p, [p, payload("other", len(p))]))
    rc, rep = _json_run(["compact", "--delete-source", t.root, str(tmp_path / "dst")], capsys)
    assert rc == 1 and rep["converted"] == 4 and rep["deleted_sources"] == 4
    left = [h for h, path in t.paths.items() if os.path.exists(path)]
    assert left == [bad_hash]
    assert os.path.exists(os.path.join(config_dir(t), "config.json"))


def test_ignores_symlinks_leaving_src_and_misfit_sizes(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=2, n_files=3)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(t.row(payload("x", t.slot_bytes)))
    some = os.path.dirname(next(iter(t.paths.values())))
    h = "ab" * 32
    link_dir = os.path.join(os.path.dirname(os.path.dirname(some)), h[:3], f"{h[3:5]}_g0")
    os.makedirs(link_dir)
    os.symlink(outside, os.path.join(link_dir, f"{h}.bin"))
    h2 = "cd" * 32
    d2 = os.path.join(os.path.dirname(os.path.dirname(some)), h2[:3], f"{h2[3:5]}_g0")
    os.makedirs(d2)
    with open(os.path.join(d2, f"{h2}.bin"), "wb") as f:
        f.write(b"\0" * 4096)  # fits no row of this namespace
    rc, rep = _json_run(["compact", t.root, str(tmp_path / "dst")], capsys)
    assert rc == 0 and rep["converted"] == 3 and rep["ignored"] == 2
    why = {os.path.basename(i["path"]): i["why"] for i in rep["ignored_paths"]}
    assert "leaves the source root" in why[f"{h}.bin"] and "fits no row" in why[f"{h2}.bin"]


def test_ambiguous_page_needs_hint(tmp_path, capsys):
    # 3 layers x 16 tokens x 512 bf16 = 49,152 B slot at TP=1 replicated: 49,152 is 4096-aligned, so every page
    # from 1,312 to 1,365 x 16 fits; 576 is not among them and nothing breaks the tie.
    t = build(str(tmp_path / "src"), tp=1, replicated=True, n_layers=3, width=512, n_files=2)
    rc = main(["compact", "-q", t.root, str(tmp_path / "dst")])
    err = capsys.readouterr().err + ""
    assert rc == 2
    rc, rep = _json_run(["compact", t.root, str(tmp_path / "dst")], capsys)
    assert rc == 2 and "--page-bytes" in rep["layout_errors"][0] and rep["converted"] == 0
    rc, rep = _json_run(["compact", "--page-bytes", str(16 * 512 * 2), t.root, str(tmp_path / "dst")], capsys)
    assert rc == 0 and rep["converted"] == 2
    assert _read_back(str(tmp_path / "dst"), t) == t.payloads
    rc, rep = _json_run(["compact", "--page-bytes", "1000", t.root, str(tmp_path / "dst3")], capsys)
    assert rc == 2 and "--page-bytes 1000" in rep["layout_errors"][0]
    del err


def test_padded_row_prefers_known_mla_width(tmp_path):
    t = build(str(tmp_path / "src"), tp=1, replicated=True, n_layers=27, n_files=1)
    ns = find_namespaces(t.root)[0]
    row = infer_row(ns, 0, t.row_bytes)
    assert row.page_bytes == 16 * 576 * 2 and row.padding == 2048 and row.row_bytes == 499_712


def test_pipeline_parallel_refused(tmp_path, capsys):
    t = build(str(tmp_path / "src"), tp=2, pp=2, n_files=2)
    with pytest.raises(LegacyLayoutError, match="pipeline-parallel rows"):
        infer_row(find_namespaces(t.root)[0], 0, t.row_bytes)
    rc, rep = _json_run(["compact", t.root, str(tmp_path / "dst")], capsys)
    assert rc == 2 and "pipeline-parallel" in rep["layout_errors"][0] and rep["converted"] == 0


def test_padding_bytes_never_in_output(tmp_path):
    t = build(str(tmp_path / "src"), tp=2, n_layers=27, n_files=2)
    assert main(["compact", "-q", t.root, str(tmp_path / "dst")]) == 0
    for rel, data in _outputs(str(tmp_path / "dst")).items():
        if rel.endswith(".kvf"):
            hdr = K.read_header(os.path.join(tmp_path, "dst", rel))
            assert hdr.raw_bytes == t.slot_bytes and len(data) == hdr.data_offset + t.slot_bytes
            assert data[-16:] != bytes([PAD_BYTE]) * 16


def test_not_a_legacy_root_is_usage_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["compact", str(tmp_path / "empty"), str(tmp_path / "dst")]) == 2
    assert "not a vLLM fs-tier root" in capsys.readouterr().err
    assert main(["compact", str(tmp_path / "missing"), str(tmp_path / "dst")]) == 2
    assert main(["compact", "--jobs", "0", str(tmp_path / "empty"), str(tmp_path / "dst")]) == 2


def test_output_keys_and_namespace_doc(tmp_path):
    t = build(str(tmp_path / "src"), tp=4, bpf=4, n_files=2)
    dst = str(tmp_path / "dst")
    assert main(["compact", "-q", t.root, dst]) == 0
    store = open_store(dst)
    (ns,) = store.namespaces()
    doc = json.loads(store.read_bytes(f"{ns}/{NAMESPACE_FILE}"))
    assert doc["namespace"] == ns and doc["identity"]["blocks_per_chunk"] == 4
    for h, p in t.payloads.items():
        e = next(e for e in store.list() if e.relpath.endswith(f"{h}.kvf"))
        hdr = store.read_header(e.relpath)
        assert hdr.key == BlockKey(h, 0) and hdr.provenance.row == "per_worker" and hdr.provenance.tp == 4
        assert hdr.provenance.created == int(os.stat(t.paths[h]).st_mtime)
        assert hashlib.sha256(p).digest()  # payload checked in test_compact_layouts_bytes_equal


def test_canonical_rows_refused(tmp_path, capsys):
    from kvformat.legacy import legacy_fields, write_legacy_row

    f = legacy_fields("m/x", tokens_per_hash=16, blocks_per_file=1, dtype="bfloat16",
                      kv_cache_groups=[{"tokens_per_block": 16, "layer_names": ["a", "b"]}], replicated=True,
                      canonical_format="v1-nhd")
    write_legacy_row(str(tmp_path / "src"), f, "ab" * 32, bytes(40960))
    rc, rep = _json_run(["compact", str(tmp_path / "src"), str(tmp_path / "dst")], capsys)
    assert rc == 2 and "canonical rows (v1-nhd) are not supported" in rep["layout_errors"][0]
    assert rep["converted"] == 0 and os.path.exists(os.path.join(tmp_path, "src"))


def test_progress_bar_on_a_terminal_quiet_in_pipes(tmp_path):
    from cli_helpers import CODE, cli_on_pty

    t = build(str(tmp_path / "src"), tp=2, n_files=30)
    rc, out, err = cli_on_pty(["compact", t.root, str(tmp_path / "a")])
    assert rc == 0 and b"converted 30" in out
    assert b"\rcompact [" in err and b"30/30" in err and err.count(b"\r") >= 2
    r = subprocess.run([sys.executable, "-c", CODE, "compact", t.root, str(tmp_path / "b")], capture_output=True)
    assert r.returncode == 0 and r.stderr == b"" and b"converted 30" in r.stdout  # quiet in pipes


def test_cached_sources_are_mapped_uncached_ones_read(tmp_path, capsys):
    from kvformat.legacy._convert import _map_if_cached

    t = build(str(tmp_path / "src"), tp=4, n_files=4)
    cold = sorted(t.paths.values())[:2]
    for p in t.paths.values():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # clean pages, so DONTNEED can drop them
            if p in cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                os.read(fd, t.row_bytes)
            mm = _map_if_cached(fd, t.row_bytes)
            assert (mm is None) == (p in cold)
            if mm is not None:
                mm.close()
        finally:
            os.close(fd)
    for p in cold:  # evict again (the probe above read nothing, but be sure)
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    rc, rep = _json_run(["compact", t.root, str(tmp_path / "dst")], capsys)
    assert rc == 0 and rep["converted"] == 4
    assert _read_back(str(tmp_path / "dst"), t) == t.payloads
