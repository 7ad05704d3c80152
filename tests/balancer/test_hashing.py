"""Tests for balancer.hashing.

Expected hashes are computed independently in the tests by spelling out the byte layout the
module documents (parent as 8 little-endian bytes + payload) and calling xxhash directly.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from balancer.hashing import ROOT_HASH, chain_block_ids, hash_token_blocks, text_chunk_hashes


def xxh(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def le64(x: int) -> bytes:
    return x.to_bytes(8, "little")


# ---------------------------------------------------------------- hash_token_blocks


def test_token_blocks_match_documented_byte_layout() -> None:
    # 2 full blocks of 2 tokens; the 5th token is a partial block and is not hashed.
    tokens = [1, 2, 3, 4, 5]
    h0 = xxh(le64(0) + struct.pack("<2I", 1, 2))
    h1 = xxh(le64(h0) + struct.pack("<2I", 3, 4))
    assert ROOT_HASH == 0
    assert hash_token_blocks(tokens, 2) == [h0, h1]


def test_token_blocks_count_is_full_blocks_only() -> None:
    # n // block_size by hand: 0//4=0, 3//4=0, 4//4=1, 9//4=2, 1000//16=62.
    assert hash_token_blocks([], 4) == []
    assert hash_token_blocks([7, 7, 7], 4) == []
    assert len(hash_token_blocks([7] * 4, 4)) == 1
    assert len(hash_token_blocks(list(range(9)), 4)) == 2
    assert len(hash_token_blocks(np.arange(1000), 16)) == 62


def test_token_blocks_partial_block_ignored() -> None:
    full = hash_token_blocks(list(range(8)), 4)
    assert hash_token_blocks([*range(8), 99, 100, 101], 4) == full
    assert hash_token_blocks([*range(8), 5], 4) == full


def test_token_blocks_chain_property() -> None:
    base = list(range(100, 116))  # 4 blocks of 4
    same_prefix = [*base[:8], 0, 0, 0, 0, 1, 1, 1, 1]  # equal first 2 blocks, different after
    changed_first = [999, *base[1:]]  # only token 0 differs
    a, b, c = (hash_token_blocks(t, 4) for t in (base, same_prefix, changed_first))
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]
    # A change in block 0 changes every later hash, even though blocks 1..3 have equal content.
    assert all(x != y for x, y in zip(a, c, strict=True))
    # Same content at another position is a different hash (the parent differs).
    rep = hash_token_blocks([5, 5, 5, 5, 5, 5, 5, 5], 4)
    assert rep[0] != rep[1]


def test_token_blocks_parent_continues_chain() -> None:
    tokens = list(range(12))
    whole = hash_token_blocks(tokens, 4)
    first = hash_token_blocks(tokens[:4], 4)
    rest = hash_token_blocks(tokens[4:], 4, parent_hash=first[-1])
    assert first + rest == whole
    assert hash_token_blocks(tokens, 4, parent_hash=0) == whole  # None means ROOT_HASH = 0
    assert hash_token_blocks(tokens, 4, parent_hash=1) != whole


def test_token_blocks_accepts_lists_and_integer_arrays_alike() -> None:
    tokens = [0, 1, 2**31, 2**32 - 1, 42, 7]  # ids >= 2**31 are serialised as uint32
    e0 = xxh(le64(0) + struct.pack("<3I", 0, 1, 2**31))
    expected = [e0, xxh(le64(e0) + struct.pack("<3I", 2**32 - 1, 42, 7))]
    for form in (tokens, np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.uint32), tuple(tokens)):
        assert hash_token_blocks(form, 3) == expected


@pytest.mark.parametrize("tokens", [[-1, 2], [2**32], [1, 2**40], [2**63, 1], [2**64]])
def test_token_blocks_out_of_range_raises(tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids must be in"):
        hash_token_blocks(tokens, 1)


def test_token_blocks_bad_arguments() -> None:
    with pytest.raises(TypeError):
        hash_token_blocks([1.5, 2.0], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        hash_token_blocks([[1, 2]], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        hash_token_blocks([1, 2], 0)
    with pytest.raises(ValueError):
        hash_token_blocks([1, 2], 1, parent_hash=-1)
    with pytest.raises(ValueError):
        hash_token_blocks([1, 2], 1, parent_hash=2**64)


@given(
    st.lists(st.integers(0, 50), min_size=0, max_size=40),
    st.lists(st.integers(0, 50), min_size=0, max_size=40),
    st.integers(1, 6),
)
def test_token_blocks_equal_hash_iff_equal_prefix(a: list[int], b: list[int], bs: int) -> None:
    ha, hb = hash_token_blocks(a, bs), hash_token_blocks(b, bs)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (a[: (i + 1) * bs] == b[: (i + 1) * bs])


# ---------------------------------------------------------------- chain_block_ids


def test_chain_block_ids_byte_layout_and_reuse() -> None:
    h0 = xxh(le64(0) + le64(7))
    h1 = xxh(le64(h0) + le64(8))
    assert chain_block_ids([7, 8]) == [h0, h1]
    assert chain_block_ids([]) == []
    # The same id at another position / after another parent gets a different hash.
    assert chain_block_ids([8, 7])[1] != h0
    assert chain_block_ids([9, 8])[1] != h1
    # Continuation and numpy ids.
    assert chain_block_ids([8], parent_hash=h0) == [h1]
    assert chain_block_ids(np.array([7, 8], dtype=np.uint64)) == [h0, h1]
    assert chain_block_ids(range(7, 9)) == [h0, h1]
    assert len(chain_block_ids([2**64 - 1])) == 1


def test_chain_block_ids_errors() -> None:
    with pytest.raises(ValueError, match="position 1"):
        chain_block_ids([0, -1])
    with pytest.raises(ValueError, match="position 0"):
        chain_block_ids([2**64])
    with pytest.raises(TypeError):
        chain_block_ids([0, 1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        chain_block_ids([0], parent_hash="x")  # type: ignore[arg-type]


# ---------------------------------------------------------------- text_chunk_hashes


def test_text_chunk_hashes() -> None:
    h0 = xxh(le64(0) + b"abc")
    h1 = xxh(le64(h0) + "dé€".encode())  # 3 characters, 1 + 2 + 3 = 6 UTF-8 bytes
    assert text_chunk_hashes("abcdé€", 3) == [h0, h1]
    assert text_chunk_hashes("abcdé€xy", 3) == [h0, h1]  # partial chunk "xy" not hashed
    assert text_chunk_hashes("ab", 3) == []
    assert text_chunk_hashes("abcdef", 3)[0] == text_chunk_hashes("abcxyz", 3)[0]
    assert text_chunk_hashes("Xbcdef", 3)[1] != text_chunk_hashes("abcdef", 3)[1]
    assert text_chunk_hashes("def", 3, parent_hash=h0) == text_chunk_hashes("abcdef", 3)[1:]
    with pytest.raises(ValueError):
        text_chunk_hashes("abc", 0)
    with pytest.raises(TypeError):
        text_chunk_hashes(b"abc", 1)  # type: ignore[arg-type]


def test_leading_held_counts_only_the_unbroken_prefix():
    # hand: blocks 0 and 1 held, 2 not, 3 held again -> 2 (block 3 is useless without block 2)
    from balancer.hashing import leading_held
    hs = [10, 11, 12, 13]
    assert leading_held(hs, {10, 11, 13}) == 2
    assert leading_held(hs, {11, 12, 13}) == 0  # the root is missing
    assert leading_held(hs, dict.fromkeys(hs)) == 4 and leading_held([], {10}) == 0
    assert leading_held(iter(hs), {10}) == 1  # any iterable
