"""Chained KV-cache block hashes (pure functions, no I/O).

A prompt is cut into fixed-size blocks, as a paged KV cache stores it, and each block gets a
64-bit hash that covers the block's content *and its parent's hash*::

    hash_0 = XXH3_64(parent.to_bytes(8, "little") + content_0)       # parent = ROOT_HASH or given
    hash_i = XXH3_64(hash_{i-1}.to_bytes(8, "little") + content_i)

So a hash names the whole prefix up to and including its block: equal hashes at the same
position mean equal prefixes (up to 64-bit collisions), and a change in block ``j`` changes
every hash from ``j`` on. A prefix index can therefore store plain hashes and match a new
request's blocks front to back until the first miss.

This is the scheme of vLLM's automatic prefix caching (a block's hash covers the parent hash and
the block's token ids; only full blocks are cached) and of NVIDIA Dynamo's KV router, which uses
XXH3-64 block hashes over little-endian token bytes. Hashes here are not byte-compatible with
either engine (their seeds and serialisation differ); they are only ever compared with hashes
produced by this module.

All hashes are Python ``int`` in ``[0, 2**64)``. The three functions share the same root
(:data:`ROOT_HASH`) and are not domain-separated: do not mix token-hashed, id-chained and
text-hashed prompts in one index.
"""

from __future__ import annotations

import struct
from collections.abc import Container, Iterable, Sequence
from itertools import takewhile

import numpy as np
import xxhash

__all__ = ["ROOT_HASH", "chain_block_ids", "hash_token_blocks", "text_chunk_hashes"]

ROOT_HASH: int = 0
"""Parent hash used for the first block when ``parent_hash`` is ``None``."""

_U64_LIMIT = 1 << 64
_U32_LIMIT = 1 << 32
_xxh3 = xxhash.xxh3_64_intdigest
_pack_u64x2 = struct.Struct("<QQ").pack


def _root(parent_hash: int | None) -> int:
    """Validate ``parent_hash`` and return the root to chain from."""
    if parent_hash is None:
        return ROOT_HASH
    if isinstance(parent_hash, bool) or not isinstance(parent_hash, (int, np.integer)):
        raise TypeError(f"parent_hash must be an int, got {type(parent_hash).__name__}")
    parent = int(parent_hash)
    if not 0 <= parent < _U64_LIMIT:
        raise ValueError(f"parent_hash must be in [0, 2**64), got {parent}")
    return parent


def _check_block_size(block_size: int, what: str = "block_size") -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"{what} must be >= 1, got {block_size}")
    return int(block_size)


def _as_uint_array(values: Sequence[int] | np.ndarray, limit: int, what: str) -> np.ndarray:
    """``values`` as a 1-D integer array, checked to lie in ``[0, limit)``.

    Raises:
        TypeError: non-integer values (floats, strings, bools).
        ValueError: not 1-D, or a value outside ``[0, limit)``.
    """
    try:
        arr = np.asarray(values)
    except OverflowError as exc:  # a Python int beyond what numpy can hold
        raise ValueError(f"{what} out of range [0, {limit}): {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.uint64)
    if arr.dtype == object:
        # Huge Python ints (>= 2**63 mixed with others) land here; check them exactly.
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in arr):
            raise TypeError(f"{what} must be integers")
        lo, hi = min(arr), max(arr)
    elif arr.dtype.kind in "iu":
        lo, hi = arr.min(), arr.max()
    elif not isinstance(values, np.ndarray) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values
    ):
        # numpy turns a list mixing ints >= 2**63 with smaller ones into float64.
        lo, hi = min(values), max(values)
    else:
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{what} must be in [0, {limit}), got {int(bad)}")
    return arr


def hash_token_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent_hash: int | None = None,
) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of a token sequence.

    Block ``i`` is serialised as its token ids in little-endian ``uint32`` (4 bytes per token,
    so ids up to ``2**32 - 1`` are allowed) and hashed after its parent's 8 little-endian bytes
    (see the module docstring). A trailing partial block is not hashed: it cannot be reused
    from a paged KV cache (vLLM and Dynamo likewise hash only full blocks).

    Args:
        token_ids: prompt token ids, shape ``(n_tokens,)``; list or integer numpy array.
        block_size: tokens per KV block (>= 1).
        parent_hash: hash of the block before ``token_ids[0]`` when continuing a chain, or
            ``None`` to start from :data:`ROOT_HASH`.

    Returns:
        ``n_tokens // block_size`` hashes, each an ``int`` in ``[0, 2**64)``.

    Raises:
        ValueError: a token id < 0 or >= 2**32, ``block_size`` < 1, ``parent_hash`` outside
            ``[0, 2**64)``, or ``token_ids`` not one-dimensional.
        TypeError: non-integer token ids, ``block_size`` or ``parent_hash``.
    """
    block_size = _check_block_size(block_size)
    parent = _root(parent_hash)
    arr = _as_uint_array(token_ids, _U32_LIMIT, "token ids")
    n_blocks = arr.size // block_size
    if n_blocks == 0:
        return []
    data = arr[: n_blocks * block_size].astype("<u4", copy=False).tobytes()
    step = 4 * block_size
    out: list[int] = []
    h = parent
    for off in range(0, n_blocks * step, step):
        h = _xxh3(h.to_bytes(8, "little") + data[off : off + step])
        out.append(h)
    return out


def chain_block_ids(block_ids: Sequence[int] | np.ndarray, parent_hash: int | None = None) -> list[int]:
    """Chain ready-made per-block ids into prefix-identifying hashes.

    For traces that ship one id per KV block instead of token ids (Mooncake's ``hash_ids``, one
    per 512-token block). ``hash_i = XXH3_64(hash_{i-1} as 8 LE bytes + id_i as 8 LE bytes)``,
    so the result names the whole prefix even if a trace reused an id at another position or
    after another parent.

    Args:
        block_ids: per-block ids, shape ``(n_blocks,)``, each an int in ``[0, 2**64)`` (a list,
            ``range`` or integer numpy array).
        parent_hash: hash to chain from, or ``None`` for :data:`ROOT_HASH`.

    Returns:
        ``n_blocks`` hashes (``int`` in ``[0, 2**64)``), one per id.

    Raises:
        ValueError: an id < 0 or >= 2**64, or ``parent_hash`` outside ``[0, 2**64)``.
        TypeError: a non-integer id or ``parent_hash``.
    """
    h = _root(parent_hash)
    out: list[int] = []
    try:
        for bid in block_ids:
            h = _xxh3(_pack_u64x2(h, bid))
            out.append(h)
    except struct.error:
        # struct rejects negatives, ids >= 2**64 and non-integers alike; report which.
        bad = block_ids[len(out)]
        if isinstance(bad, bool) or not isinstance(bad, (int, np.integer)):
            raise TypeError(f"block id at position {len(out)} must be an int, got {type(bad).__name__}") from None
        raise ValueError(f"block id at position {len(out)} must be in [0, 2**64), got {bad}") from None
    return out


def text_chunk_hashes(text: str, chunk_chars: int, parent_hash: int | None = None) -> list[int]:
    """Chained hashes of fixed-size character chunks of raw text (tokenizer-free approximation).

    For a router that sees prompt text but has no tokenizer: chunk ``i`` is
    ``text[i*chunk_chars:(i+1)*chunk_chars]``, encoded as UTF-8 and hashed after its parent's 8
    little-endian bytes. Only full chunks are hashed. Chunk boundaries do not line up with
    the engine's token blocks, so matches are an estimate of the engine's prefix hits
    (``chunk_chars ~ block_size * chars_per_token``, about 4 characters per token for English).

    Args:
        text: the prompt text.
        chunk_chars: characters (Unicode code points) per chunk (>= 1).
        parent_hash: hash to chain from, or ``None`` for :data:`ROOT_HASH`.

    Returns:
        ``len(text) // chunk_chars`` hashes (``int`` in ``[0, 2**64)``).

    Raises:
        ValueError: ``chunk_chars`` < 1 or ``parent_hash`` outside ``[0, 2**64)``.
        TypeError: ``text`` not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    chunk_chars = _check_block_size(chunk_chars, "chunk_chars")
    h = _root(parent_hash)
    out: list[int] = []
    for off in range(0, len(text) - chunk_chars + 1, chunk_chars):
        # surrogatepass: lone surrogates (possible in decoded JSON) must not crash the router.
        h = _xxh3(h.to_bytes(8, "little") + text[off : off + chunk_chars].encode("utf-8", "surrogatepass"))
        out.append(h)
    return out


def leading_held(block_hashes: Iterable[int], held: Container[int]) -> int:
    """How many leading blocks of ``block_hashes`` are in ``held`` (a set, dict or LRU of block
    hashes): the prefix hit of a prompt on one cache. Stops at the first block not held (a later
    block, even if held, cannot be reused without its prefix). C-level iteration."""
    return sum(1 for _ in takewhile(held.__contains__, block_hashes))
