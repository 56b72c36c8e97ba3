"""Mutation run over the MUST checks of spec/FORMAT.md: remove one check at a time, run the tests, record.

Mutants (each applied alone, in a temporary copy of the tree, never in the working tree):

* every ``raise`` statement that carries an ``F-x.y`` comment in kvformat/format/: _header.py,
  _header_json.py, _block.py, _consts.py, _spec.py, _read.py, _fused.py, _codec.py becomes ``pass`` (the check is
  gone, the code goes on);
* every ``if`` whose condition line carries an ``F-x.y`` comment gets the condition ``False``;
* hand-written mutants for checks that are not a single raise: the version regex (F-4.2), the stored
  data checksum (F-5.2), the zero-on-failure code (F-5.5, both call sites and ``invalidate``) and the
  O_DIRECT branch of ``FileSource.readinto``;
* the side paths of spec/GUARANTEES.md: the quarantine's identity checks (G-5.5: local pre- and
  post-rename checks, the tier's, verify's and the remote verify's use of them, S3's conditions, the
  content check of other remote backends, the identity each reader attaches), the fused read's zero-fill
  on every exception (G-1.2), the destination/source distinction (G-1.6), the failed-eviction accounting
  (G-5.6) and the fallback's checksum-position check (G-1.7). These run only the tests named with them;
* ``--set move``: the token-movement code (issue 20): the page sub-layouts' arithmetic, the run builder, the
  DCP token map and its refusal in the tier's plans, the staging part copies, and compact's interleave,
  partition and platform checks; each mutant runs only the tests that exercise it.

A mutant is *killed* when at least one selected test fails (pytest ``-x``: it stops at the first
failure, so killed mutants are quick); it *survives* when every test passes
(``EQUIVALENT`` lists the survivors shown equivalent, with why). Tests per mutant:
``--tests`` (default: the format tests, which cover every F-check in a few seconds) plus, for
_read.py / _fused.py mutants, the file-path tests. Prints a markdown table; ``--out`` also writes it to a file.

    python tools/mutate.py                    # all mutants (~3 s to ~20 s each)
    python tools/mutate.py --only F-5.5 odirect --out /tmp/mutants.md
    python tools/mutate.py --set move          # the token-movement mutants (issue 20)
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [f"kvformat/format/{m}.py" for m in ("_header", "_header_json", "_block", "_consts", "_spec", "_read", "_fused",
                                             "_codec")]
IO_FILES = ("kvformat/format/_read.py", "kvformat/format/_fused.py")  # the file paths: their mutants also run IO_TESTS
FID = re.compile(r"#.*?\b(F-\d+\.\d+)")
DEFAULT_TESTS = ["tests/test_vectors.py", "tests/test_format.py", "tests/test_mutants.py"]
IO_TESTS = ["tests/test_untrusted.py", "tests/test_native_io.py"]  # the file paths, the fused ones included


@dataclass
class Mutant:
    """One edit of one file: ``old`` (exact text, unique in the file) becomes ``new``."""

    mid: str
    must: str
    path: str
    line: int
    old: str
    new: str
    what: str
    tests: tuple[str, ...] = ()  # when set, the tests this mutant runs (instead of --tests)


def _fid_lines(src: str) -> dict[int, str]:
    out = {}
    for i, text in enumerate(src.splitlines(), 1):
        m = FID.search(text)
        if m:
            out[i] = m.group(1)
    return out


def auto_mutants(path: str) -> list[Mutant]:
    """``raise`` -> ``pass`` and ``if cond:`` -> ``if False:`` for statements carrying an F-id comment."""
    src = open(os.path.join(ROOT, path)).read()
    lines = src.splitlines(keepends=True)
    fids = _fid_lines(src)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    out: list[Mutant] = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Raise):
            span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            must = next((fids[i] for i in span if i in fids), None)
            if must is None:
                continue
            a = offsets[node.lineno - 1] + node.col_offset
            b = offsets[(node.end_lineno or node.lineno) - 1] + (node.end_col_offset or 0)
            out.append(Mutant("", must, path, node.lineno, src[a:b], "pass", "raise -> pass"))
        elif isinstance(node, ast.If) and node.test.lineno in fids:
            a = offsets[node.test.lineno - 1] + node.test.col_offset
            b = offsets[(node.test.end_lineno or node.test.lineno) - 1] + (node.test.end_col_offset or 0)
            out.append(Mutant("", fids[node.test.lineno], path, node.lineno, src[a:b], "False", "if cond -> if False"))
    return out


HAND = [
    # (must, path, old, new, what)
    ("F-4.2", "kvformat/format/_header.py", r'rb"(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})"',
     r'rb"([0-9]{1,4})\.([0-9]{1,4})"', "version regex accepts leading zeros"),
    ("F-5.2", "kvformat/format/_block.py", "    if actual != hdr.data_xxh3:\n        raise ChecksumError(\"data\"",
     "    if False:\n        raise ChecksumError(\"data\"", "stored-data checksum not compared"),
    ("F-5.2", "kvformat/format/_block.py", "    if len(data) != hdr.data_bytes:\n        raise TruncatedError(\"data\"",
     "    if False:\n        raise TruncatedError(\"data\"", "stored-data length not compared"),
    ("F-5.5", "kvformat/format/_block.py", "        if out is not None:\n            invalidate(out)\n",
     "        pass\n", "verify_data does not zero the destination"),
    ("F-5.5", "kvformat/format/_block.py",
     "    out[:] = bytes(len(out)) if len(out) < (1 << 16) else memoryview(bytearray(len(out)))",
     "    pass", "invalidate() is a no-op"),
    ("F-5.5", "kvformat/format/_read.py", "        invalidate(dst)  # F-5.5: never leave partly read",
     "        pass  # F-5.5: never leave partly read", "the read pipeline does not zero on failure"),
    ("odirect", "kvformat/format/_read.py",
     "        if not self.o_direct:\n            return _read_exact(self.fd, dst, offset)",
     "        if True:\n            return _read_exact(self.fd, dst, offset)", "the O_DIRECT branch never runs"),
]

SIDE = "tests/test_races_and_faults.py"
# The side paths (G-x.y of spec/GUARANTEES.md): (must, path, old, new, what, tests run).
SIDE_HAND = [
    ("G-5.5", "kvformat/storage/_local.py", "            elif not file_id.same_file(at):",
     "            elif False:", "quarantine: no identity check before the rename", (SIDE,)),
    ("G-5.5", "kvformat/storage/_local.py", "        if file_id.same_file(os.lstat(aside)):",
     "        if True:", "quarantine: no identity check of the file renamed aside", (SIDE,)),
    ("G-5.5", "kvformat/storage/_local.py", "        return self._move_if_same(s, d, file_id)",
     "        return self._move(src, dst, None)", "quarantine: local moves by name", (SIDE,)),
    ("G-5.5", "kvformat/cache/_rows.py", "            q = self.store.quarantine_read(rel, err)",
     "            q = Quarantined(\"moved\", self.store.quarantine(rel, reason))", "tier: quarantine by name",
     (SIDE,)),
    ("G-5.5", "kvformat/cache/_rows.py", "        if q.outcome == REPLACED:", "        if False:",
     "tier: a replaced file's entry is dropped and reported removed", (SIDE,)),
    ("G-5.5", "kvformat/cli/_verify.py", "                q = LocalStore(root).quarantine_read(rel, bad)",
     "                q = LocalStore(root)._quarantine(rel, bad.reason, None)", "verify: quarantine by name", (SIDE,)),
    ("G-5.5", "kvformat/cli/_remote.py", "                q = store.quarantine_read(rel, bad_err)",
     "                q = store._quarantine(rel, bad_err.reason, None)", "remote verify: quarantine by name", (SIDE,)),
    ("G-5.5", "kvformat/storage/_s3.py", "    if copied != etag:", "    if False:",
     "S3: the copy of another object is kept (and the delete unconditional)", (SIDE,),
     ("        await fs._call_s3(\"delete_object\", Bucket=sb, Key=sk, IfMatch=etag)",
      "        await fs._call_s3(\"delete_object\", Bucket=sb, Key=sk)")),
    ("G-5.5", "kvformat/storage/_fsspec.py", "        return bool(xxh3_64(cur) == file_id.digest)",
     "        return True", "remote without ETag: no content check", (SIDE,)),
    ("G-5.5", "kvformat/format/_read.py", "        _tag(exc, self.ident)\n", "        pass\n",
     "a FileSource's errors name no file", (SIDE,)),
    ("G-5.5", "kvformat/format/_fused.py", "            e.file_id = FileId.of_stat(st)",
     "            pass", "the fused read's errors name no file", (SIDE,)),
    ("G-1.2", "kvformat/format/_fused.py", "            invalidate(dst[:raw])  # F-5.5: an OSError part-way",
     "            pass  # F-5.5: an OSError part-way", "fused read: no zero-fill on an OSError",
     ("tests/test_native_io.py", SIDE)),
    ("G-1.2", "kvformat/format/_fused.py", "        touched = True\n        try:\n            hgot, dgot, digest",
     "        touched = False\n        try:\n            hgot, dgot, digest",
     "fused read: the destination counts as written only after the read returns", ("tests/test_native_io.py", SIDE)),
    ("G-1.6", "kvformat/cache/_rows.py", "        if chunk_id < 0 or base + self.copies * self.slot > len(self.flat):",
     "        if False:", "tier: no chunk range check", (SIDE,)),
    ("G-1.6", "kvformat/format/_read.py", "        if expect is not None:  # the file is what the caller expects",
     "        if False:  # the file is what the caller expects", "a short destination blames the file", (SIDE,)),
    ("G-1.6", "kvformat/errors.py", "class DestinationError(ValueError):",
     "class DestinationError(KVFormatError, ValueError):", "a destination error is a bad-file error", (SIDE,)),
    ("G-5.6", "kvformat/cache/_rows.py",
     "            self.index.keep([(rel, size) for rel, size in victims if rel not in done])",
     "            self.index.forget(rel for rel, _ in victims if rel not in done)",
     "eviction: a victim whose delete failed is forgotten", (SIDE,)),
    ("G-5.6", "kvformat/cache/_lru.py", "                if rel in self._pins or rel == keep or rel in self._stuck:",
     "                if rel in self._pins or rel == keep:", "eviction: a stuck file is picked first again", (SIDE,)),
    ("G-1.7", "kvformat/format/_native.py", "    if (n < 16 or dxxh3_pos < 0",
     "    if False and (n < 16 or dxxh3_pos < 0", "fallback pwrite_hash: no position check",
     ("tests/test_native.py::test_native_bounds_checks_do_not_overflow",)),
]


# Token movement (issue 20): where a token's bytes sit inside a page and where DCP puts them. Each runs only the
# tests that exercise it (the oracle's pages come from tests/vllm_writers.py's on-disk cache after one run).
SUBLAYOUT = "kvformat/layout/_sublayout.py"
MOVE_TESTS = ["tests/test_sublayout.py"]
LEGACY_TESTS = ["tests/test_parallel.py::test_compact_of_a_dcp_tree_requires_the_interleave",
                "tests/test_parallel.py::test_compact_pp_layers_must_add_up_to_the_writers_layers",
                "tests/test_parallel.py::test_legacy_pp_tree_compacts_and_loads_at_tp8"]
STAGING_TESTS = ["tests/test_staging_parallel.py"]
MOVE = [
    # (tag, path, old, new, what, tests)
    ("move", SUBLAYOUT, "scale = (base + tile * _INDEXER_KEY + tt * _INDEXER_SCALE, _INDEXER_SCALE)",
     "scale = (base + tile * _INDEXER_KEY + t * _INDEXER_SCALE, _INDEXER_SCALE)",
     "split: scales indexed by the page's token, not the kernel block's", MOVE_TESTS),
    ("move", SUBLAYOUT, "row = base + (tt // _TILE) * _TILE * _INDEXER_KEY + (tt % _TILE) * _TILE",
     "row = base + (tt // _TILE) * _TILE * _INDEXER_KEY + (tt % _TILE) * _INDEXER_KEY",
     "shuffle16: a token's keys as a row inside its tile", MOVE_TESTS),
    ("move", SUBLAYOUT, "return tuple((row + k * _TILE * _TILE, _TILE) for k",
     "return tuple((row + k * _TILE, _TILE) for k", "shuffle16: 16-byte head tiles adjacent", MOVE_TESTS),
    ("move", SUBLAYOUT, "        return SubLayout(SHUFFLE16, token_bytes, enc, 0, _SRC_SHUFFLE)",
     "        return SubLayout(SPLIT, token_bytes, enc, 0, _SRC_SHUFFLE)", "ROCm indexer pages taken as CUDA's",
     MOVE_TESTS),
    ("move", SUBLAYOUT, "    if tokens % 64:\n        return None", "    if False:\n        return None",
     "CUDA indexer pages of any block size described", MOVE_TESTS),
    ("move", SUBLAYOUT, "SubLayout(SPLIT, token_bytes, enc, 64 if tokens != 64 else 0, _SRC_SPLIT)",
     "SubLayout(SPLIT, token_bytes, enc, 0, _SRC_SPLIT)", "CUDA's 64-token kernel blocks ignored", MOVE_TESTS),
    ("move", SUBLAYOUT, "        n = min(a[i][1] - ai, b[j][1] - bj)", "        n = a[i][1] - ai",
     "a token cut only where the source cuts it", MOVE_TESTS),
    ("move", SUBLAYOUT, "if cnt > 1 and so == s0 + cnt * ss and do == d0 + cnt * ds:",
     "if cnt > 1 and so == s0 + cnt * ss:", "strided runs fold without checking the destination stride",
     MOVE_TESTS),
    ("move", SUBLAYOUT, "if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:",
     "if out and out[-1][0] + out[-1][2] == so:", "pieces merge without checking the destination",
     MOVE_TESTS),
    ("move", SUBLAYOUT, "if len(dst_token) != src_tokens or len(set(dst_token)) != src_tokens or",
     "if len(dst_token) != src_tokens or", "a token map that repeats a position accepted", MOVE_TESTS),
    ("move", SUBLAYOUT, 'if role == "dsa_indexer" or sub.encoding != default:', "if sub.encoding != default:",
     "the indexer's form pin (and the DSA namespace move) dropped", MOVE_TESTS),
    ("move", "kvformat/layout/_types.py", "tokens == logical and local.name == canon.name and",
     "tokens == logical and", "a page whose order is not the file's copied whole", MOVE_TESTS),
    ("move", "kvformat/layout/_rules.py", "loc is not None and can is not None and loc.name != can.name}",
     "False}", "worker pages never reordered into the file's order", MOVE_TESTS),
    ("move", "kvformat/layout/_parallel.py", "tmap = tuple(cp_canonical_token(t, cp_rank, cp, inter)",
     "tmap = tuple(cp_canonical_token(t, cp_rank, cp, 1)", "DCP ignores the interleave", MOVE_TESTS),
    ("move", "kvformat/layout/_parallel.py", "        if cp > 1 and forms[n][0] is None:",
     "        if False:", "DCP over an undescribed page order not refused", MOVE_TESTS),
    ("move", "kvformat/staging/_parts.py", "tmap = tuple(cp_canonical_token(t, part % dcp, dcp, inter)",
     "tmap = tuple(cp_canonical_token(t, 0, dcp, inter)", "staging: every DCP rank's tokens at rank 0's places",
     STAGING_TESTS),
    ("move", "kvformat/legacy/_rows.py", "    if par[\"dcp\"] > 1 and cp_interleave is None:",
     "    if False:", "compact: a DCP tree's interleave defaults to 1", LEGACY_TESTS),
    ("move", "kvformat/legacy/_rows.py", "                if buf[first + lo:first + lo + n] == bytes(n):",
     "                if False:", "compact: a partition claiming layers the writer lacks accepted", LEGACY_TESTS),
    ("move", "kvformat/legacy/_rows.py", "    if platform is None and any(platform_dependent(",
     "    if False and any(platform_dependent(", "compact: fp8 / indexer trees need no platform", LEGACY_TESTS),
]

# Survivors shown equivalent (no input can tell them apart from the original), keyed by file and the
# mutated statement's first line. Reported as "equivalent", not as survivors.
EQUIVALENT = {
    ("kvformat/format/_header_json.py", 'raise SchemaError("tensors", f"tensors hold {data_bytes} bytes, the layout '
                            '{layout.payload_bytes}")'):
        "the layout is built from the same tensor table: F-4.7 ties each tensor's bytes to its shape, F-4.8 "
        "tiles them from 0, F-4.9 fixes the first dimension, so the totals cannot differ",
    ("kvformat/format/_block.py", "if out is not None:"):
        "every caller that passes an out zeroes it itself on any failure (read_payload_from's and decode's "
        "except clauses, both pinned by their own mutants), so verify_data's zeroing is a second one",
    ("kvformat/format/_read.py", 'raise TruncatedError("header", end, size)'):
        "decode_header raises the same TruncatedError('header', end, size) on the short buffer; the only "
        "difference is one read of at most MAX_HEADER_BYTES (F-8.1 is checked first)",
}


def all_mutants(which: str = "format") -> list[Mutant]:
    muts: list[Mutant] = []
    hand: list[tuple[Any, ...]] = []
    if which in ("format", "all"):
        for p in FILES:
            muts += auto_mutants(p)
        hand += [*HAND, *SIDE_HAND]
    if which in ("move", "all"):
        hand += MOVE
    for must, path, old, new, what, *more in hand:
        src = open(os.path.join(ROOT, path)).read()
        tests: tuple[str, ...] = tuple(more[0]) if more else ()
        if len(more) > 1:  # a second edit in the same file, applied with the first: one span from one to the other
            old2, new2 = more[1]
            a, b = src.find(old), src.find(old2)
            if src.count(old) == 1 and src.count(old2) == 1 and a < b:
                new = new + src[a + len(old):b] + new2
                old = src[a:b + len(old2)]
        if src.count(old) != 1:
            print(f"warning: hand mutant {must} ({what}) does not apply to {path}: the code moved", file=sys.stderr)
            continue
        muts.append(Mutant("", must, path, src[:src.index(old)].count("\n") + 1, old, new, what, tests))
    for i, m in enumerate(muts, 1):
        m.mid = f"M{i:02d}"
    return muts


def apply(tree: str, m: Mutant) -> str:
    p = os.path.join(tree, m.path)
    src = open(p).read()
    lines = src.splitlines(keepends=True)
    a = sum(len(x) for x in lines[:m.line - 1])  # edit at the recorded line: the old text may repeat
    i = src.index(m.old, a)
    mutated = src[:i] + m.new + src[i + len(m.old):]
    ast.parse(mutated)  # a mutant must still compile, or the run would count a syntax error as a kill
    with open(p, "w") as f:
        f.write(mutated)
    return src


def preload() -> None:
    """Import the heavy dependencies once; each mutant's test run is a fork that inherits them.

    kvformat itself is never imported here, so every child imports the mutated copy fresh.
    """
    import hypothesis  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import safetensors  # noqa: F401
    import torch  # noqa: F401
    import xxhash  # noqa: F401
    import zstandard  # noqa: F401


def run_tests(tree: str, tests: list[str], timeout: float) -> tuple[bool, str, float]:
    """Run ``tests`` against ``tree`` in a forked child (pytest -x). Returns (killed, first failure, seconds)."""
    t0 = time.monotonic()
    log = os.path.join(tree, ".mutate.log")
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(tree)
            sys.path.insert(0, tree)
            os.environ.update(KVFORMAT_ALLOW_SKIPS="1", PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=tree)
            signal.alarm(int(timeout))  # a mutant that hangs a test dies here (default SIGALRM action)
            import pytest

            rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests])
        except BaseException:  # noqa: BLE001 - any crash of the run counts as a failing test
            rc = 99
        os._exit(int(rc))
    _, status = os.waitpid(pid, 0)
    out = open(log).read()
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    if os.WIFSIGNALED(status):
        return True, f"signal {os.WTERMSIG(status)} (timeout or crash)", time.monotonic() - t0
    rc = os.WEXITSTATUS(status)
    last = out.strip().splitlines()[-1][:80] if out.strip() else ""
    return rc != 0, (failed[0] if failed else last), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    ap.add_argument("--only", nargs="+", help="run the mutants whose MUST id or id is listed")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--set", choices=("format", "move", "all"), default="format",
                    help="format: the MUST checks (default); move: the token-movement code (issue 20); all: both")
    ap.add_argument("--out", help="also write the markdown table here")
    a = ap.parse_args(argv)
    muts = all_mutants(a.set)
    if a.only:
        muts = [m for m in muts if m.must in a.only or m.mid in a.only]
    if a.list:
        for m in muts:
            print(f"{m.mid} {m.must:7} {m.path}:{m.line} {m.what}: {m.old.splitlines()[0].strip()[:70]}")
        return 0
    preload()
    tree = tempfile.mkdtemp(prefix="kvformat_mutate_")
    try:
        for d in ("kvformat", "tests", "spec", "tools"):
            shutil.copytree(os.path.join(ROOT, d), os.path.join(tree, d),
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for base in sorted({tuple(m.tests) or tuple(a.tests) for m in muts}):
            base_ok, why, _ = run_tests(tree, list(base), a.timeout)
            if base_ok:
                print(f"the unmutated tree fails its tests ({why}): fix that first", file=sys.stderr)
                return 2
        rows: list[tuple[Mutant, bool | None, str, float]] = []
        t_all = time.monotonic()
        for m in muts:
            original = apply(tree, m)
            try:
                tests = list(m.tests) or a.tests + (IO_TESTS if m.path in IO_FILES else [])
                tests = [t for t in tests if os.path.exists(os.path.join(tree, t.split("::")[0]))]
                killed, by, dt = run_tests(tree, tests, a.timeout)
            finally:
                with open(os.path.join(tree, m.path), "w") as f:
                    f.write(original)
            eq = EQUIVALENT.get((m.path, m.old.splitlines()[0].strip()))
            if not killed and eq:
                killed, by = None, f"equivalent: {eq}"
            rows.append((m, killed, by, dt))
            state = "killed  " if killed else ("equiv.  " if killed is None else "SURVIVED")
            print(f"{m.mid} {m.must:7} {state} {dt:5.1f}s {m.path}:{m.line} {by}", file=sys.stderr, flush=True)
        total = time.monotonic() - t_all
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    survived = [r for r in rows if r[1] is False]
    equivalent = [r for r in rows if r[1] is None]
    lines = [f"Mutation run: {len(rows)} mutants, {len(rows) - len(survived) - len(equivalent)} killed, "
             f"{len(equivalent)} equivalent, {len(survived)} survived ({total:.0f} s)", "",
             "| id | MUST | where | mutation | result | first failing test |", "|---|---|---|---|---|---|"]
    for m, killed, by, _ in rows:
        result = "killed" if killed else ("equivalent" if killed is None else "**survived**")
        note = by if killed is not False else ""
        lines.append(f"| {m.mid} | {m.must} | `{m.path}:{m.line}` | {m.what} | {result} | {note} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
