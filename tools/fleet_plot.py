#!/usr/bin/env python
"""Draws a fleet run (tests/e2e/fleet.py's fleet.json): each server's share of prompt blocks served from cache
(its HTTP answers' cached_tokens, a rolling window of 20 requests) and the root's .kvf bytes against time, with the
bound and the faults marked. Needs matplotlib (not a kvformat dependency).

Usage: python tools/fleet_plot.py WORK/fleet.json OUT.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.load(open(src))
    t0 = d["t0_wall"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, colour in (("A", "tab:blue"), ("B", "tab:orange")):
        rs = [r for r in d["results"] if r["server"] == name and r.get("ok") and r["tag"] == "replay"]
        xs, ys, window = [], [], []
        for r in rs:
            window.append((r.get("cached_blocks", 0), r["blocks"]))
            window = window[-20:]
            xs.append(r["t"] - t0 + r["s"])
            ys.append(sum(c for c, _ in window) / max(1, sum(b for _, b in window)))
        tp = d["tp"][name]
        ax1.plot(xs, ys, color=colour, label=f"server {name} (TP={tp})")
    ax1.set_ylabel("prompt blocks cached\n(rolling 20 requests)")
    ax1.legend(loc="upper left")
    ts = [t for t, _ in d["samples"]]
    bs = [b / 2**20 for _, b in d["samples"]]
    ax2.plot(ts, bs, color="tab:green", label="root .kvf bytes (sampled every second)")
    ax2.axhline(d["max_bytes"] / 2**20, color="tab:red", linestyle="--", label="max_bytes")
    ax2.set_ylabel("MiB")
    ax2.set_xlabel("seconds since the servers were started")
    ax2.legend(loc="lower right")
    for f in d["faults"]:
        if "t" in f:
            for ax in (ax1, ax2):
                ax.axvline(f["t"], color="grey", linestyle=":")
            ax1.annotate(f["fault"], (f["t"], 0.95), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                         va="top", ha="right")
    fig.suptitle("kvformat fleet: two vLLM API servers on one bounded root (tools/fleet.sh)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
