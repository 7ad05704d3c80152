"""The compiled block hashing (:func:`balancer.kernels.xxh3_token_blocks`, numba's XXH3-64)
against independent references: the xxhash package (xxHash's own C code) on the byte layout
:mod:`balancer.hashing` documents, spelled out here, and the Python loop of
:func:`balancer.hashing.hash_token_blocks` (the kernels turned off) on random prompts.

pdlb's block hashes claim no byte compatibility with vLLM's (seeded sha256 of CBOR) or SGLang's
(module docstring of balancer.hashing), so those engines' hashing is not a reference here; the
format's reference is XXH3-64 itself. About 3 s (plus numba's compile the first time).
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from balancer import hashing, kernels
from balancer.hashing import hash_token_blocks

numba = pytest.importorskip("numba")  # the compiled path exists only with numba (serve/sim/test extras)


@pytest.fixture(autouse=True)
def _compiled_on():
    kernels.use_compiled(True)
    yield
    kernels.use_compiled(True)


def reference_chain(tokens: np.ndarray, block_size: int, parent: int) -> list[int]:
    """The documented layout by hand: parent as 8 little-endian bytes, then the block's token ids
    as little-endian uint32, hashed by the xxhash package's XXH3-64 (seed 0)."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    out, h = [], parent
    for b in range(len(tokens) // block_size):
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + data[4 * block_size * b: 4 * block_size * (b + 1)])
        out.append(h)
    return out


#: block sizes whose inputs (8 + 4 * block_size bytes) hit every XXH3 length class the kernel
#: serves and its edges: 17-128 (3..30), 129-240 (31..58), long (59..): one 1,024-byte block
#: exactly (254), just above (255, 256), two (510, 511, 512 = 2,056 bytes), three (766, 767)
EDGE_BLOCK_SIZES = [3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 16, 17, 22, 23, 24, 25, 29, 30, 31, 32, 33, 57, 58, 59, 60,
                    63, 64, 65, 127, 128, 129, 254, 255, 256, 510, 511, 512, 513, 766, 767, 1024]


@pytest.mark.parametrize("block_size", EDGE_BLOCK_SIZES)
def test_kernel_equals_xxhash_on_every_length_class(block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    for parent in (0, 1, 2**64 - 1, int(rng.integers(0, 2**63)) * 2 + 1):
        n_blocks = int(rng.integers(1, 6))
        tokens = rng.integers(0, 2**32, n_blocks * block_size + int(rng.integers(0, block_size)), dtype=np.uint64)
        tokens[: min(3, len(tokens))] = [0, 2**32 - 1, 1][: min(3, len(tokens))]  # extremes of a uint32
        got = kernels.xxh3_token_blocks(tokens, block_size, parent, n_blocks)
        assert got == reference_chain(tokens[: n_blocks * block_size], block_size, parent), (block_size, parent)
        assert all(type(h) is int for h in got)


def test_public_function_uses_the_kernel_and_matches_xxhash() -> None:
    """hash_token_blocks at pdlb serve's 64-token blocks on a 32k-token prompt: 512 hashes, equal
    to the hand-spelled reference; the compiled call ran (it returns a list, not None)."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 150_000, 32_768)
    assert kernels.xxh3_token_blocks(ids, 64, 0, 512) is not None
    assert hash_token_blocks(ids, 64) == reference_chain(ids, 64, 0)


def python_loop(ids, block_size, parent=None):
    kernels.use_compiled(False)
    try:
        return hash_token_blocks(ids, block_size, parent)
    finally:
        kernels.use_compiled(True)


def test_fuzz_compiled_equals_python_loop_on_random_prompts() -> None:
    """300 random prompts: lengths 0..5,000 tokens, block sizes 1..600 (below 3 and below
    COMPILED_MIN_BLOCKS blocks the Python loop runs on both sides), random parents, as lists and
    as int64 / uint32 / uint64 arrays, vocabularies small and full-width."""
    rng = np.random.default_rng(2026)
    compiled_runs = 0
    for trial in range(300):
        n = int(rng.integers(0, 5_000))
        block_size = int(rng.choice([1, 2, 3, 16, 64, 512, int(rng.integers(1, 600))]))
        high = int(rng.choice([2, 150_000, 2**32]))
        ids = rng.integers(0, high, n, dtype=np.uint64)
        parent = None if trial % 3 == 0 else int(rng.integers(0, 2**63)) * 2 + trial % 2
        kind = trial % 4
        given = ids.tolist() if kind == 0 else ids.astype([np.int64, np.uint32, np.uint64][kind - 1])
        expected = python_loop(given, block_size, parent)
        assert hash_token_blocks(given, block_size, parent) == expected, (trial, n, block_size)
        compiled_runs += block_size >= 3 and n // block_size >= hashing.COMPILED_MIN_BLOCKS
    assert compiled_runs > 100  # most trials exercised the kernel


def test_short_blocks_and_off_switch_take_the_python_loop() -> None:
    assert kernels.xxh3_token_blocks(np.arange(40), 2, 0, 20) is None  # 16-byte inputs: not compiled
    kernels.use_compiled(False)
    try:
        assert kernels.xxh3_token_blocks(np.arange(640), 64, 0, 10) is None
    finally:
        kernels.use_compiled(True)
    ids = np.arange(10)
    assert hash_token_blocks(ids, 2) == reference_chain(ids, 2, 0)


def test_bad_tokens_still_raise_before_hashing() -> None:
    with pytest.raises(ValueError):
        hash_token_blocks(np.array([1, 2, 2**32] * 100), 3)
    with pytest.raises(ValueError):
        hash_token_blocks([-1] + [0] * 299, 3)
    tail = np.zeros(64 * 10 + 5, dtype=np.int64)
    tail[-1] = 2**32  # in the partial last block, which is not hashed: still refused (the Python check's rule)
    with pytest.raises(ValueError):
        hash_token_blocks(tail, 64)
    tail[-1] = -1
    with pytest.raises(ValueError):
        hash_token_blocks(tail, 64)
    tail[-1] = 2**32 - 1
    assert hash_token_blocks(tail, 64) == reference_chain(tail[:640], 64, 0)
