"""CPU seconds to refuse the fuzz loop's 1 MB shape-list header (tools/fuzz.py ``long_shape``), per source tree.

Each tree (a checkout of kvformat: this one by default, e.g. an export of another commit with its extension
built) runs in its own child process, rounds interleaved so that a loaded machine's drift hits every tree
alike; the table gives the median and range of CPU seconds (getrusage of the child) and the ratio to the
first tree. G-1.4 (spec/GUARANTEES.md): the work is linear in the file size.

    python tools/bench_header.py --tree /tmp/main-export --tree . --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import resource, sys
import kvformat as K  # the tree's (PYTHONPATH), imported before fuzz.py puts this checkout on sys.path
sys.path.insert(0, {tools!r})
import fuzz
assert K.__file__.startswith({tree!r}), K.__file__
s = fuzz.make_seeds(0)[0]
data = fuzz.long_shape(s)
r0 = resource.getrusage(resource.RUSAGE_SELF)
try:
    K.decode(data, out=bytearray(len(s.payload)))
    what = "accepted"
except K.KVFormatError as e:
    what = type(e).__name__ + " on " + str(getattr(e, "field", ""))
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, len(data), what, sep="\\t")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", help="a kvformat source tree (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    trees = [os.path.abspath(t) for t in (a.tree or [ROOT])]
    got: dict[str, list[float]] = {t: [] for t in trees}
    what: dict[str, str] = {}
    for _ in range(a.rounds):
        for t in trees:
            env = dict(os.environ, PYTHONPATH=t)
            code = CHILD.format(tools=os.path.join(ROOT, "tools"), tree=t)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                                 cwd=t).stdout.split("\t")
            got[t].append(float(out[0]))
            what[t] = f"{int(out[1]):,} bytes, {out[2].strip()}"
    base = statistics.median(got[trees[0]])
    print("| tree | CPU s median | min-max | ratio to the first | outcome |\n|---|---|---|---|---|")
    for t in trees:
        med = statistics.median(got[t])
        print(f"| {t} | {med:.4f} | {min(got[t]):.4f}-{max(got[t]):.4f} | {med / base:.4g} | {what[t]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
