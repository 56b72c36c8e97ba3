"""Issue 31 item 6: on a sealed root the coordination records (journals, state, leases) carry a MAC under the
deployment key, so a co-tenant without the key can at worst remove or garble whole files, never steer the evictor.
Each test is the attack, on a real root with real files: engines holding the key (SharedBound with the MAC of a
real Keyring) and a keyless co-tenant writing into ``.kvformat/``. The records it plants are the ones an unsealed
root acts on (tests/test_shared_control.py shows those are applied there, within their limits)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from test_shared_control import FILE, MAX, Engine, _kvf_bytes, _plant, _serving, pump, site  # noqa: F401

from kvformat.cache.shared import ENGINES_DIR, LEASE_DIR, STATE_FILE
from kvformat.cache.shared._checks import MAX_GEN
from kvformat.cache.shared import ControlMac
from kvformat.errors import ControlRecordError
from kvformat.format._seal import Keyring
from treediff import changes, snapshot as _tree

KEY = os.urandom(32)


def _mac(*secrets: bytes) -> ControlMac:
    return ControlMac.of(Keyring.of(list(secrets or (KEY,))))


def _sealed(root: str, n: int = 2) -> list[Engine]:
    engines = [Engine(root, mac=_mac())]
    engines[0].sb.tick()
    assert engines[0].sb.is_evictor
    engines += [Engine(root, mac=_mac()) for _ in range(n - 1)]
    pump(engines, 3, store=False)
    assert [e.sb.is_evictor for e in engines] == [True] + [False] * (n - 1)
    return engines


def test_records_verify_only_at_their_path_and_under_a_held_key() -> None:
    m = _mac()
    rec = m.seal(STATE_FILE, b'{"gen":1}')
    assert m.open(STATE_FILE, rec) == b'{"gen":1}'
    for path, raw, mac in [(f"{ENGINES_DIR}/x.json", rec, m),  # moved to another file
                           (STATE_FILE, rec.replace(b'"gen":1', b'"gen":2'), m),  # body altered
                           (STATE_FILE, b'{"gen":1}', m),  # no MAC
                           (STATE_FILE, rec, _mac(os.urandom(32)))]:  # another deployment's key
        try:
            mac.open(path, raw)
        except ControlRecordError as e:
            assert e.why == "mac"
        else:
            raise AssertionError(f"verified: {path} {raw!r}")
    rotated = _mac(os.urandom(32), KEY)  # a new write key, the old one still held: the old records verify
    assert rotated.open(STATE_FILE, rec) == b'{"gen":1}'


def test_a_keyless_journal_cannot_steer_the_evictor(site: tuple[str, Path]) -> None:
    """A keyless co-tenant's journal claims every file of the cache was just read (so the evictor would keep
    them and evict newer ones) and names huge files: on a sealed root it is not merged at all."""
    root, sentinel = site
    before = _tree(sentinel)
    engines = _sealed(root)
    pump(engines, 10)
    files = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*.kvf"))
    recs = [[i + 1, "r", rel, FILE] for i, rel in enumerate(files)] + [[len(files) + 1, "w", "ns/h/0.kvf", MAX]]
    _plant(root, f"{ENGINES_DIR}/evil.json", {"id": "evil", "beat": 1, "ack": None, "records": recs})
    pump(engines, 3, store=False)
    a = engines[0].sb
    assert a.root_view()["control_rejected"].get("mac", 0) >= 1
    assert "evil" not in (a.holding.views if a.holding else {})
    assert a.root_view()["control_rejected"].get("size", 0) == 0  # never parsed: its records are not looked at
    _serving(engines)
    assert _kvf_bytes(root) <= MAX
    assert not changes(before, _tree(sentinel)), changes(before, _tree(sentinel))


def test_a_forged_state_dooms_nothing_and_grants_nothing(site: tuple[str, Path]) -> None:
    root, _ = site
    engines = _sealed(root)
    pump(engines, 10)
    files = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*.kvf"))
    follower = engines[1].sb
    state = json.loads(Path(root, STATE_FILE).read_bytes().rsplit(b"\nkvf-mac ", 1)[0])
    forged = dict(state, seq=state["seq"] + 1000, allowance=1 << 40, doomed=[[rel, 0] for rel in files])
    _plant(root, STATE_FILE, json.dumps(forged).encode() + b"\nkvf-mac " + b"0" * 16 + b" " + b"0" * 64 + b"\n")
    engines[1].sb.tick()  # the follower reads the forged state before the evictor rewrites it
    assert follower.root_view()["control_rejected"].get("mac", 0) >= 1
    assert all(follower.may_read(rel) for rel in files), "a forged state doomed files"
    assert follower.may_write(MAX + FILE) is not None, "a forged grant lifted the bound"
    _serving(engines)
    assert _kvf_bytes(root) <= MAX


def test_a_planted_lease_neither_deposes_the_evictor_nor_blocks_a_take_over(site: tuple[str, Path]) -> None:
    """A keyless lease at a newer generation would make the evictor step down; one at the last generation
    (999999999999) would leave the root without an evictor for good. Sealed, neither is a lease."""
    root, _ = site
    engines = _sealed(root)
    for gen in (engines[0].sb.holding.gen + 1, MAX_GEN):  # type: ignore[union-attr]
        _plant(root, f"{LEASE_DIR}/{gen:012d}", {"owner": "evil", "host": "x", "pid": 1})
    pump(engines, 5)
    assert engines[0].sb.is_evictor and not engines[1].sb.is_evictor
    engines[0].sb.close()  # the evictor leaves: the follower takes over past the planted names
    e1 = engines[1]
    for _ in range(30):
        e1.sb.tick()
        if e1.sb.is_evictor:
            break
    assert e1.sb.is_evictor
    _serving([e1])
    assert _kvf_bytes(root) <= MAX


def test_an_engine_without_the_key_is_a_co_tenant_not_a_peer(site: tuple[str, Path]) -> None:
    """An engine of the same root configured without the deployment key (a clear deployment, or one holding
    another key) joins nothing: its journal and lease are rejected, the sealed engines keep their one evictor."""
    root, _ = site
    engines = _sealed(root)
    stranger = Engine(root, mac=_mac(os.urandom(32)))
    pump(engines + [stranger], 5, store=False)
    assert engines[0].sb.is_evictor
    assert engines[0].sb.root_view()["control_rejected"].get("mac", 0) >= 1
    _serving(engines)
    assert _kvf_bytes(root) <= MAX
