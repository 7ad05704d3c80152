"""Decoder of the KV-event wire format vLLM and SGLang engines publish over ZMQ (pure, no I/O).

Format (ANCHORS.md, "vLLM KV cache events"; vLLM ``vllm/distributed/kv_events.py``, SGLang
``sglang/srt/disaggregation/kv_events.py``, which publishes the same format):

* A ZMQ PUB message is multipart ``[topic, seq, payload]``: ``seq`` is an 8-byte big-endian
  counter of batches, from 0 per publisher, reset when the engine restarts; DP rank ``r``
  publishes on the configured port + ``r`` (:func:`offset_port`).
* ``payload`` is one msgpack *batch*, in either of two encodings found in the wild:

  - positional (SGLang, vLLM before 2026): ``[ts, events]`` or ``[ts, events, data_parallel_rank]``,
    each event an array whose first item is its tag:
    ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality]``
    (trailing fields with defaults may be left out),
    ``["BlockRemoved", block_hashes, medium, group_idx, locality]``, ``["AllBlocksCleared"]``;
  - maps: ``{"ts", "events", "data_parallel_rank"}``, each event a map with a ``"type"`` key
    (``{"type": "BlockStored", "block_hashes": ..., ...}``); fields left at their defaults may be
    omitted. vLLM 0.33 and SGLang 0.5.23 both send the batch positionally
    (``[ts, events, data_parallel_rank]`` / ``[ts, events, attn_dp_rank]``) and every event as
    such a tagged map (msgspec ``tag=True, omit_defaults=True``); fields this decoder does not
    know (``ownership``, ``session_id``, ``cache_salt``, ...) are ignored.
* ``medium``: vLLM ``"GPU"``, ``"CPU"``, ``"STORAGE"`` (its disk/offload tier, with ``locality``
  ``"LOCAL"``/``"REMOTE"``: a remote one is decoded as ``"STORE"``, the shared store); SGLang
  ``"GPU"``, ``"CPU_PINNED"``, ``"DISK"``, ``"EXTERNAL"`` (:func:`balancer.kv_events.tier_of_medium`
  maps them onto pdlb's tiers).

* Block hashes are the engine's own: 64-bit integers (vLLM's default, the low 64 bits of a
  sha256; SGLang's Python ``hash``, which may be negative) or byte strings (vLLM's 32-byte
  digests). They are opaque keys here; :mod:`balancer.kv_translate` maps them onto pdlb's hashes.
* ``token_ids`` of a ``BlockStored`` are all of its blocks' tokens, concatenated:
  ``len(token_ids) == len(block_hashes) * block_size``. One exception: for a KV cache group that
  is not full attention (``kv_cache_spec_kind`` sliding window incl. ``sliding_window_mla``, Mamba,
  chunked local: :func:`kv_group_class`), vLLM 0.33 (``BlockPool.cache_full_blocks``) leaves the
  group's null blocks, and blocks its hit rule never reads (``block_mask``), out of
  ``block_hashes`` while ``token_ids`` still spans them, so there the tokens may be more whole
  blocks than the hashes (never fewer, never a partial block).

Replay (a ROUTER socket beside the PUB socket): a client sends ``[b"", start_seq]`` (8-byte
big-endian) and receives ``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on,
then ``[b"", seq = -1, b""]`` (:data:`END_OF_REPLAY`; the -1 is signed).

Every malformed input raises :class:`KvWireError` (a ``ValueError``) naming what is wrong; nothing
here trusts a field's type. Decoded objects keep the engine's spelling of each field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = ["END_OF_REPLAY", "EngineAllBlocksCleared", "EngineBatch", "EngineBlockRemoved", "EngineBlockStored",
           "EngineEvent", "EngineHash", "KvWireError", "decode_batch", "decode_seq", "encode_seq",
           "is_full_attention", "kv_group_class", "offset_port"]

#: An engine block hash: an int (vLLM default, SGLang) or bytes (vLLM sha256 digests).
EngineHash = int | bytes

#: The ``seq`` a replay ends with (8 bytes, signed big-endian -1).
END_OF_REPLAY = -1

#: Most events one batch may carry, and most token ids one event may carry: bounds on what a
#: (possibly hostile or corrupted) payload can make the router allocate.
MAX_EVENTS_PER_BATCH = 1_000_000
MAX_TOKENS_PER_EVENT = 16_777_216

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")


def _medium(f: dict[str, Any], where: str) -> str | None:
    """The event's medium, with vLLM's ``locality`` folded in: a lower tier that vLLM marks
    ``"REMOTE"`` (relative to the publisher: a shared pool, vLLM 0.33 ``kv_offload/base.py``
    ``Locality``) is pdlb's shared store (``"STORE"``); ``"LOCAL"`` or unset keeps the medium
    (``"STORAGE"``, vLLM's disk offload tier, is then the replica's own lower tier,
    :func:`balancer.kv_events.tier_of_medium`)."""
    medium = _opt_str(f.get("medium"), f"{where}: medium")
    locality = _opt_str(f.get("locality"), f"{where}: locality")
    if locality is not None and locality.upper() == "REMOTE" and medium is not None and medium.upper() not in ("GPU", "HBM"):
        return "STORE"
    return medium


class KvWireError(ValueError):
    """A KV-event message that does not follow the wire format (the message says which part)."""


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    """The engine cached ``block_hashes`` (consecutive blocks of one sequence), in its hash space.

    Attributes:
        block_hashes: the new blocks' engine hashes, in order.
        parent_block_hash: the engine hash of the block before the first one, ``None`` when the
            first block starts a sequence.
        token_ids: all blocks' token ids, concatenated (``len == len(block_hashes) * block_size``;
            more whole blocks for a group that is not full attention, see the module docstring;
            :func:`decode_batch` refuses any other length, :mod:`balancer.kv_translate` checks
            events built by hand).
        block_size: tokens per engine block.
        lora_id / lora_name: the LoRA adapter the blocks were computed with (``lora_id`` is the
            older spelling); both ``None`` for the base model.
        medium: storage tier (``None`` or ``"GPU"``: HBM; ``"CPU"``; ...).
        extra_keys: one entry per block (``None`` or a tuple: multimodal ids, LoRA name, cache
            salt, ...) that the engine mixed into the block's hash; ``None`` when not sent.
        group_idx / kv_cache_spec_kind / kv_cache_spec_sliding_window: the KV cache group of a
            hybrid model (``None`` when not sent).
    """

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    """The engine evicted ``block_hashes`` from ``medium``."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineAllBlocksCleared:
    """The engine dropped its whole prefix cache."""


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One published batch: wall-clock ``ts`` (seconds, the engine's ``time.time()``), its events,
    and the DP rank that published it (``None`` when the encoding has none, e.g. SGLang's)."""

    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None


#: ``kv_cache_spec_kind`` values (vLLM 0.33 ``KVCacheSpecKind``) by what a prefix hit needs of the group:
#: ``full``: every block of the prefix (full attention, MLA incl. DeepSeek-V4's compressed groups,
#: attention with sinks); ``window``: the blocks of the last sliding window before the hit's end;
#: ``last``: the block (state) that ends the hit (Mamba; chunked local attention, whose chunk size
#: the events do not carry); ``other``: groups that take no part in prefix caching.
KV_GROUP_CLASSES = {
    "full_attention": "full", "mla_attention": "full", "sink_full_attention": "full",
    "sliding_window": "window", "sliding_window_mla": "window",
    "mamba": "last", "chunked_local_attention": "last",
    "encoder_only_attention": "other", "cross_attention": "other", "unknown": "other",
}


def kv_group_class(kind: str | None) -> str:
    """What a prefix hit needs of a KV cache group of ``kv_cache_spec_kind`` ``kind``:
    ``"full"``, ``"window"``, ``"last"`` or ``"other"`` (see :data:`KV_GROUP_CLASSES`; ``None``,
    not sent, is a model with one group, taken as full attention). A kind this table does not
    list is classed by its name: ``sliding`` -> window, else ``full`` -> full, else other.
    Source: vLLM ``v1/core/single_type_kv_cache_manager.py`` (each manager's
    ``find_longest_cache_hit``) and ``v1/kv_cache_interface.py`` (``get_kv_cache_spec_kind``)."""
    if kind is None:
        return "full"
    k = kind.lower()
    got = KV_GROUP_CLASSES.get(k)
    if got is not None:
        return got
    if "sliding" in k:
        return "window"
    return "full" if "full" in k else "other"


def is_full_attention(kind: str | None) -> bool:
    """Whether a ``kv_cache_spec_kind`` names a full-attention KV cache group (``None``: not sent,
    a model with one group, which is full attention; ``mla_attention`` is, ``sliding_window_mla``
    is not: :func:`kv_group_class`)."""
    return kv_group_class(kind) == "full"


# ---------------------------------------------------------------------- sequence numbers
def decode_seq(frame: bytes) -> int:
    """The batch sequence number of an 8-byte big-endian ``seq`` frame (signed: the replay's end
    marker is -1; live numbers are >= 0).

    Raises:
        KvWireError: not 8 bytes.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) != 8:
        raise KvWireError(f"seq frame must be 8 bytes (big-endian), got {len(frame) if hasattr(frame, '__len__') else frame!r}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian frame a replay request carries (``-1`` allowed)."""
    return int(seq).to_bytes(8, "big", signed=True)


def offset_port(endpoint: str, dp_rank: int) -> str:
    """The endpoint DP rank ``dp_rank`` publishes on: ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT+r``
    (as vLLM and SGLang offset it); ``ipc://``/``inproc://`` endpoints get a ``_dp{r}`` suffix.

    Raises:
        ValueError: a ``tcp://`` endpoint without an integer port, or a negative ``dp_rank``.
    """
    if dp_rank < 0:
        raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or base == "tcp":
            raise ValueError(f"KV event endpoint {endpoint!r} has no port (expected tcp://HOST:PORT)")
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


# ---------------------------------------------------------------------- payload
def _hash(v: Any, what: str) -> EngineHash:
    if isinstance(v, bool) or not isinstance(v, (int, bytes)):
        raise KvWireError(f"{what} must be an integer or bytes block hash, got {type(v).__name__}")
    return v


_HASH_TYPES = {int, bytes}


def _hashes(v: Any, what: str) -> tuple[EngineHash, ...]:
    if not isinstance(v, (list, tuple)):
        raise KvWireError(f"{what} must be an array of block hashes, got {type(v).__name__}")
    if not set(map(type, v)) <= _HASH_TYPES:  # one C-level pass; find the culprit only on failure
        for i, h in enumerate(v):
            _hash(h, f"{what}[{i}]")
    return tuple(v)


def _opt_int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise KvWireError(f"{what} must be an integer or nil, got {type(v).__name__}")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        try:
            return v.decode()
        except UnicodeDecodeError:
            raise KvWireError(f"{what} is not UTF-8") from None
    if not isinstance(v, str):
        raise KvWireError(f"{what} must be a string or nil, got {type(v).__name__}")
    return v


def _fields(ev: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """An event's fields by name, from either encoding. Missing trailing fields are absent (their
    defaults apply); fields a newer engine adds beyond ``names`` are ignored."""
    if isinstance(ev, dict):
        return {k: ev[k] for k in names if k in ev}
    return dict(zip(names, ev[1:]))


def _event(ev: Any, where: str) -> EngineEvent:
    if isinstance(ev, dict):
        tag = ev.get("type")
    elif isinstance(ev, (list, tuple)) and ev:
        tag = ev[0]
    else:
        raise KvWireError(f"{where}: an event must be a non-empty array or a map, got {type(ev).__name__}")
    if isinstance(tag, bytes):
        tag = tag.decode(errors="replace")
    if tag == "BlockStored":
        f = _fields(ev, _STORED_FIELDS)
        for need in ("block_hashes", "token_ids", "block_size"):
            if need not in f:
                raise KvWireError(f"{where}: BlockStored without {need}")
        tokens = f["token_ids"]
        if not isinstance(tokens, (list, tuple)):
            raise KvWireError(f"{where}: BlockStored token_ids must be an array, got {type(tokens).__name__}")
        if len(tokens) > MAX_TOKENS_PER_EVENT:
            raise KvWireError(f"{where}: BlockStored carries {len(tokens)} token ids (limit {MAX_TOKENS_PER_EVENT})")
        bs = f["block_size"]
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise KvWireError(f"{where}: BlockStored block_size must be an integer >= 1, got {bs!r}")
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        if extra is not None and not isinstance(extra, (list, tuple)):
            raise KvWireError(f"{where}: BlockStored extra_keys must be an array or nil")
        hashes = _hashes(f["block_hashes"], f"{where}: BlockStored block_hashes")
        kind = _opt_str(f.get("kv_cache_spec_kind"), f"{where}: kv_cache_spec_kind")
        want = len(hashes) * bs
        if len(tokens) != want and (is_full_attention(kind) or len(tokens) < want or len(tokens) % bs):
            more = "" if is_full_attention(kind) else f", or whole blocks more for a {kind} group"
            raise KvWireError(f"{where}: BlockStored has {len(tokens)} token_ids for {len(hashes)} block hashes of "
                              f"block_size {bs} (expected len(block_hashes) * block_size = {want}{more})")
        return EngineBlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else _hash(parent, f"{where}: BlockStored parent_block_hash"),
            token_ids=tokens, block_size=bs,
            lora_id=_opt_int(f.get("lora_id"), f"{where}: lora_id"),
            medium=_medium(f, where),
            lora_name=_opt_str(f.get("lora_name"), f"{where}: lora_name"),
            extra_keys=None if extra is None else tuple(extra),
            group_idx=_opt_int(f.get("group_idx"), f"{where}: group_idx"),
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=_opt_int(f.get("kv_cache_spec_sliding_window"),
                                                  f"{where}: kv_cache_spec_sliding_window"))
    if tag == "BlockRemoved":
        f = _fields(ev, _REMOVED_FIELDS)
        if "block_hashes" not in f:
            raise KvWireError(f"{where}: BlockRemoved without block_hashes")
        return EngineBlockRemoved(_hashes(f["block_hashes"], f"{where}: BlockRemoved block_hashes"),
                                  _medium(f, where),
                                  _opt_int(f.get("group_idx"), f"{where}: group_idx"))
    if tag == "AllBlocksCleared":
        return EngineAllBlocksCleared()
    raise KvWireError(f"{where}: unknown event type {tag!r} (BlockStored, BlockRemoved, AllBlocksCleared)")


def decode_batch(payload: bytes) -> EngineBatch:
    """One msgpack batch payload (either encoding, see the module docstring) as an :class:`EngineBatch`.

    Raises:
        KvWireError: not msgpack, not a batch, an unknown event type, a field of the wrong
            type, or a ``BlockStored`` whose ``token_ids`` are not its blocks' tokens (see the
            module docstring; the message names the event's index and field). The caller counts
            and drops the batch (``pdlb serve``: ``decode_errors`` of the source).
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True,
                              max_array_len=MAX_TOKENS_PER_EVENT)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise KvWireError(f"payload is not msgpack ({type(e).__name__}: {e})") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise KvWireError(f"a batch must be [ts, events(, dp_rank)] or a map with ts/events, got {type(obj).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KvWireError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise KvWireError(f"batch events must be an array, got {type(events).__name__}")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise KvWireError(f"batch has {len(events)} events (limit {MAX_EVENTS_PER_BATCH})")
    return EngineBatch(float(ts), tuple(_event(ev, f"event {i}") for i, ev in enumerate(events)),
                       _opt_int(rank, "batch data_parallel_rank"))
