"""Run a function as ``world`` rank processes, as the ranks of one engine on one node: the one harness for
tests, benchmarks and the GPU check of :mod:`kvformat.staging`.

Ranks are forked from a forkserver that preloaded torch (and kvformat.staging) but never touched CUDA:
CUDA-safe like ``spawn``, without importing torch once per rank. Each rank runs ``fn(rank, *args)``
(with ``barrier=`` a barrier shared by the ranks, when asked) and its return value, or its traceback,
goes back to the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any, Callable, Sequence

from ..errors import RankError

__all__ = ["RankError", "rank_context", "run_ranks"]

PRELOAD = ("torch", "numpy", "kvformat.staging")


def _entry(fn: Callable[..., Any], rank: int, q: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
           threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # ranks share the cores: oversubscribed OpenMP pools spin
    try:
        q.put((rank, "ok", fn(rank, *args, **kwargs)))
    except BaseException:  # reported, so the parent never waits for a rank that died
        q.put((rank, "error", traceback.format_exc()))


def rank_context(preload: Sequence[str] = PRELOAD) -> Any:
    """The multiprocessing context the ranks run in (for Events/Barriers a test shares with them)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, barrier: bool = False, timeout_s: float = 90.0,
              on_start: Callable[[list[Any]], None] | None = None, expected: int | None = None,
              threads: int | None = 1, preload: Sequence[str] = PRELOAD) -> dict[int, Any]:
    """Run ``fn(rank, *args)`` in ``world`` processes; returns ``{rank: result}``.

    ``fn`` must be importable by name (a module-level function). ``barrier``: pass ``barrier=`` a
    ``multiprocessing.Barrier(world)``. ``on_start(procs)`` runs once every rank started (e.g. to kill
    one); ``expected`` is how many ranks must report (default all). ``threads``: torch threads per rank
    (None leaves torch's default). Raises RankError for the first rank that failed, TimeoutError
    (``queue.Empty``) when the ranks do not report within ``timeout_s``. Ranks left are killed.
    """
    ctx = rank_context(preload)
    q = ctx.Queue()
    kwargs = {"barrier": ctx.Barrier(world)} if barrier else {}
    procs = [ctx.Process(target=_entry, args=(fn, r, q, args, kwargs, threads), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        if on_start is not None:
            on_start(procs)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        want = world if expected is None else expected
        while len(results) < want:
            rank, status, value = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise RankError(rank, value)
            results[rank] = value
        return results
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
