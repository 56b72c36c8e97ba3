"""kvformat.staging.xxh3_64_device and xxh3_64_gathered (issue 47) against python-xxhash, the oracle.

The kernels run here in Triton's interpreter on CPU tensors: the same kernel source a GPU compiles, so a
length class that is wrong on the device is wrong here. One test also compiles both kernels for an H100
(sm_90, through ptxas) without a GPU, so the compiled path's types and constants are checked on every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import xxhash

from kvformat.errors import StagingError
from kvformat.staging import xxh3_64_device, xxh3_64_gathered

ROOT = Path(__file__).resolve().parents[1]
STRIPE, BLOCK = 64, 1024


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _want(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.numpy().tobytes())


# Every short-input class (0, 1-3, 4-8, 9-16, 17-128, 129-240) and each of its edges; then the long loop:
# one stripe over 240, around every stripe and block edge (full last block, 1 byte into the next, a
# partial last stripe), and a length whose last block has 15 full stripes.
SHORT = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 143, 144,
         159, 160, 200, 239, 240]
LONG = [241, 255, 256, 257, 319, 320, 321, BLOCK - 1, BLOCK, BLOCK + 1, BLOCK + STRIPE - 1, BLOCK + STRIPE,
        BLOCK + STRIPE + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1, 8 * BLOCK + 1, 9 * BLOCK + 33,
        16 * BLOCK + 15 * STRIPE + 7, 17 * BLOCK]


@pytest.mark.parametrize("n", SHORT + LONG)
def test_every_length_class_equals_xxhash(n: int) -> None:
    t = _rand(n, n)
    assert xxh3_64_device(t) == _want(t)


def test_a_few_mib_of_random_bytes_equal_xxhash() -> None:
    # 2 MiB + 37: 2048 full blocks folded in the unrolled loop, a tail block and a partial last stripe.
    t = _rand((2 << 20) + 37, 7)
    assert xxh3_64_device(t) == _want(t)


def test_uniform_bytes_and_any_shape() -> None:
    for fill in (0, 0xFF):
        t = torch.full((3 * BLOCK + 5,), fill, dtype=torch.uint8)
        assert xxh3_64_device(t) == _want(t)
    t = _rand(6 * 700, 3).view(6, 700)  # a contiguous 2-D tensor: its bytes in memory order
    assert xxh3_64_device(t) == _want(t)


def test_one_flipped_bit_changes_the_digest_at_every_position_class() -> None:
    t = _rand(5 * BLOCK + 100, 11)
    base = xxh3_64_device(t)
    for pos in (0, BLOCK - 1, 4 * BLOCK + 3, t.numel() - 1):  # full blocks, partial block, last stripe
        u = t.clone()
        u[pos] ^= 0x10
        assert xxh3_64_device(u) == _want(u) != base


def test_refuses_what_it_cannot_hash_as_bytes() -> None:
    with pytest.raises(StagingError, match="contiguous torch.uint8"):
        xxh3_64_device(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(StagingError, match="contiguous torch.uint8"):
        xxh3_64_device(_rand(64, 1).view(8, 8).t())


def _pages(n_layers: int, num_blocks: int, page: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_blocks, page + 16 * i), dtype=torch.uint8, generator=g)
            for i in range(n_layers)]


@pytest.mark.parametrize("ids,bpc", [([7, 2, 9, 0], 4), ([3, 4, 5, 6], 4), ([11, 1], 4), ([5], 1)])
def test_gathered_equals_xxhash_of_the_chunk_in_file_order(ids: list[int], bpc: int) -> None:
    pages = _pages(3, 12, 400, 5)  # pages of 400, 416, 432 bytes: blocks straddle 1 KiB boundaries
    # The file's data region, built here from the spec's rule: per layer, blocks_per_chunk pages, block j at
    # j * page, zero past a short chunk's blocks.
    want = b"".join(b"".join(p[b].numpy().tobytes() for b in ids) + bytes(int(p.shape[1]) * (bpc - len(ids)))
                    for p in pages)
    assert xxh3_64_gathered(pages, ids, bpc) == xxhash.xxh3_64_intdigest(want)
    buf = torch.full((len(want) + 100,), 0xAA, dtype=torch.uint8)  # a caller's larger, dirty buffer
    assert xxh3_64_gathered(pages, ids, bpc, buffer=buf) == xxhash.xxh3_64_intdigest(want)


def test_gathered_sees_a_byte_changed_where_it_landed() -> None:
    pages = _pages(2, 8, 512, 9)
    ids = [6, 1, 4]
    before = xxh3_64_gathered(pages, ids, 4)
    pages[1][4, 100] ^= 1
    assert xxh3_64_gathered(pages, ids, 4) != before
    pages[1][4, 100] ^= 1
    pages[0][0, 0] ^= 1  # a block outside the chunk changes nothing
    assert xxh3_64_gathered(pages, ids, 4) == before


def test_gathered_refuses_bad_ids_and_buffers() -> None:
    pages = _pages(2, 8, 512, 1)
    for ids in ([], [8], [0, 1, 2, 3, 4]):
        with pytest.raises(StagingError):
            xxh3_64_gathered(pages, ids, 4)
    with pytest.raises(StagingError, match="buffer"):
        xxh3_64_gathered(pages, [0], 4, buffer=torch.empty(10, dtype=torch.uint8))


def test_both_kernels_compile_for_an_h100_without_a_gpu() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvformat.staging import _xxh3_device as X

    k = X._build(False)
    target = GPUTarget("cuda", 90, 32)
    sig = {"src": "*u8", "n_stripes": "i64", "n_rows": "i64", "sec": "*i64", "out": "*u64", "ROWS": "constexpr"}
    stripes = triton.compile(ASTSource(k.stripes, sig, constexprs={"ROWS": X._DEVICE_ROWS}), target=target)
    sig = {"src": "*u8", "n": "i64", "n_full": "i64", "n_main": "i64", "parts": "*u64", "sec": "*i64",
           "out": "*u64", "UNROLL": "constexpr"}
    final = triton.compile(ASTSource(k.final, sig, constexprs={"UNROLL": X._UNROLL}), target=target)
    for c in (stripes, final):  # ptxas ran: machine code for sm_90 exists
        assert c.asm["cubin"] and ".target sm_90" in c.asm["ptx"]


def test_hashes_from_several_threads_at_once_are_each_right() -> None:
    # Loads verify on I/O threads; the interpreter's patching of triton.language must not interleave.
    ts = [_rand(3 * BLOCK + 17 * k, k) for k in range(4)]
    got: dict[int, int] = {}

    def run(k: int) -> None:
        got[k] = xxh3_64_device(ts[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert got == {k: _want(t) for k, t in enumerate(ts)}


def test_works_when_triton_itself_was_imported_in_interpreter_mode() -> None:
    # TRITON_INTERPRET=1 before Triton's import makes triton.language's own jit functions interpreted too; the
    # module must hash right in that process as well as in this one (where it is unset).
    code = ("import torch, xxhash\n"
            "from kvformat.staging import xxh3_64_device\n"
            "g = torch.Generator().manual_seed(4)\n"
            "for n in (0, 3, 8, 16, 100, 240, 241, 5000):\n"
            "    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)\n"
            "    assert xxh3_64_device(t) == xxhash.xxh3_64_intdigest(t.numpy().tobytes()), n\n"
            "import triton.language as tl\n"
            "print(type(tl.standard._sum_combine).__name__)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                       cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "InterpretedFunction"  # the process really was in interpreter mode
