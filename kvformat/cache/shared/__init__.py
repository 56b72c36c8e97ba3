"""One ``max_bytes`` for a root that several engines share, on any storage (no engine import, no locks).

Every engine on a bounded root runs a :class:`SharedBound`. The root's coordination lives under
``<root>/.kvformat/`` in small objects that need only what every backend has: an atomic whole-object write
(rename; a PUT), an exclusive create (``link``; a conditional PUT ``If-None-Match: *``), reads, deletes and a
listing of one directory. No POSIX lock is used (they do not work over many NFS setups, nor on object stores).

* **One evictor per root.** ``lease/<generation>`` objects are created exclusively: whoever creates generation
  ``g + 1`` is the evictor from then on, and the holder of ``g`` steps down when it sees ``g + 1``. A candidate
  takes over when the evictor's ``state.json`` has not changed for ``ttl_s`` of the candidate's own clock (no
  clock is compared across hosts), at once when the evictor released the root on shutdown, or when its holder is
  provably dead (a process of this kernel boot and PID namespace that no longer runs).
* **Journals.** Every other engine (a *follower*) rewrites ``engines/<engine id>.json`` each tick: a heartbeat,
  its acknowledgement (below), the bytes it admitted and has not written yet (``reserved``) and the records it has
  not seen merged yet (files it wrote, read, found gone). An engine deletes its journal when it takes the lease; a
  journal merged for the first time may be old (a dead engine's), so the writes it names are indexed only if their
  files are still there. An evictor that loses the lease journals, as a follower, its own writes since the pass
  before its last (a successor's listing may have missed them).
* **The evictor** merges the journals into its own LRU index (the root-wide usage view, refreshed incrementally;
  rebuilt by a scan when it takes over), keeps it under ``max_bytes`` and publishes ``state.json``: the usage,
  each engine's merged record number, each follower's write allowance and the files it *doomed* (chose to evict).
* **Writers respect it.** Each state grants every engine a number of bytes it may write (or have in flight) beyond
  what the evictor has counted: a follower, beyond what was merged from its journal; the evictor, since its pass. Past
  its grant a store fails (reason ``bound``) until the evictor catches up. The evictor picks the grant ``g`` so that
  ``counted + followers' exposure + N * g <= max_bytes``, where ``counted`` is the indexed bytes, the writes in flight
  and the doomed files not yet deleted, and a follower's exposure is the largest grant it may still be using (any
  grant published since the last state it acknowledged; ``allowance``, the largest grant there is, for one that
  acknowledged no state of this evictor), and at least its journal's ``reserved`` up to ``allowance`` (a former
  evictor's stores admitted under its own last grant). Dooming moves bytes from indexed to doomed, so it never makes
  room by itself: deletions do, and grants shrink while they are pending. Each pass dooms files until the indexed
  bytes fit ``target = max(max_bytes - N * allowance, max_bytes // 2)``, which leaves the full allowance once
  deletions are through. So the bytes of ``.kvf`` files under the root never exceed ``max_bytes``, whatever the number
  of engines (exceptions: docs/vllm.md, spec/GUARANTEES.md G-8). An engine alone on its root (no live follower) evicts
  before each write and deletes at once, as an unshared tier does.
* **No deletion under a reader.** A doomed file is deleted only after every live follower has acknowledged a state
  that dooms it *and* finished every read it started before: a follower's acknowledgement is the oldest state
  under which one of its reads is still running. Followers refuse to read doomed files, and read nothing while
  their view of the state is older than ``ttl_s / 2`` (a partitioned engine serves misses, it does not race the
  evictor). An engine stalled longer than ``ttl_s`` (SIGSTOP, a hung mount) loses that protection: its read then
  fails as a miss or completes from the open file, never returns wrong bytes (checksums).
"""

from ._bound import SharedBound
from ._journal import ENGINES_DIR
from ._lease import LEASE_DIR
from ._mac import ControlMac
from ._nobound import NoBound
from ._state import STATE_FILE, default_allowance, grant, shared_target

Bound = SharedBound | NoBound  # what a row engine holds: its root's shared bound, or an unbounded root's stand-in

__all__ = ["ENGINES_DIR", "LEASE_DIR", "STATE_FILE", "Bound", "ControlMac", "NoBound", "SharedBound",
           "default_allowance", "grant", "shared_target"]
