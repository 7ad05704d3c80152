"""What a relayed engine answer says about its timing and size: the first generated token and the
output token count, read from the bytes as they pass (no I/O, no clock: the caller times).

**First token.** An event (SSE ``data:`` line) carries generated content when any choice has a
non-empty ``delta.content``, ``delta.reasoning_content`` / ``delta.reasoning``,
``delta.tool_calls``, ``delta.function_call``, ``text`` (completions), ``token_ids``, or
``logprobs`` with entries (a token that decoded to no text yet); for SGLang's native
``/generate`` stream, a non-empty ``text`` or ``output_ids``, or ``meta_info.completion_tokens``
above 0. Role-only chunks (``delta: {role: assistant}``, with or without ``content: ""``), empty
deltas, finish-reason-only chunks, usage-only chunks (``choices: []``), error events and
``[DONE]`` carry none. Engines differ in when they send the role chunk: vLLM
(``chat_completion/serving.py``, ``first_iteration``) and SGLang (``serving_chat.py``,
``is_firsts``) send it with the first engine output, transformers' server
(``transformers/cli/serving/chat_completion.py``, ``sse_gen``) before prefill starts, so timing
the first byte measured the queueing delay, not prefill (issue 30: 10-20x too low).

**Output tokens.** ``usage.completion_tokens`` (SGLang ``/generate``: ``meta_info.completion_tokens``)
of the last event that has one among the last :data:`MAX_TRAILING_EVENTS` (vLLM and SGLang send
a usage chunk with ``stream_options.include_usage``; transformers' server always sends usage with
its finish chunk), else counted: the ``data:`` events from the first content event on, less the
trailing events without content (finish-only, usage-only, ``[DONE]``). The count is one per
content event: exact for engines that stream one token per event (vLLM's and SGLang's default),
low when an engine merges tokens into one event. Neither depends on ``[DONE]``, which
transformers' server never sends.

Cost: events are JSON-parsed only until the first content event, and at most
:data:`MAX_TRAILING_EVENTS` at the end; in between a chunk costs two byte searches.
"""

from __future__ import annotations

import collections
import json
import re
from typing import Any

MAX_HEAD_BYTES = 1 << 20
"""Bytes of stream held while looking for the first content event; past that the stream is taken
as content from there on (an engine that sends a megabyte of non-content events is not timed)."""
MAX_TRAILING_EVENTS = 16
"""Events parsed at the end of a stream, last first, for usage and trailing non-content events."""
TAIL_BYTES = 16_384
"""At least this many of the stream's last bytes are kept for the end-of-stream parse."""

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})')


def _non_empty(v: Any) -> bool:
    return bool(v) if isinstance(v, (str, list, dict)) else False


def _choice_has_content(c: Any) -> bool:
    if not isinstance(c, dict):
        return False
    delta = c.get("delta")
    if isinstance(delta, dict):
        for key in ("content", "reasoning_content", "reasoning", "tool_calls", "function_call", "token_ids"):
            if _non_empty(delta.get(key)):
                return True
    if _non_empty(c.get("text")) or _non_empty(c.get("token_ids")):
        return True
    lp = c.get("logprobs")
    if isinstance(lp, dict) and (_non_empty(lp.get("content")) or _non_empty(lp.get("tokens"))):
        return True
    return False


def event_has_content(obj: Any) -> bool:
    """Whether one decoded SSE event (or a whole non-streamed answer's ``choices``) carries
    generated content (module docstring)."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    if isinstance(choices, list):
        return any(_choice_has_content(c) for c in choices)
    if "error" in obj:
        return False
    # SGLang's /generate stream: {"text", "output_ids", "meta_info": {...}}
    if _non_empty(obj.get("text")) or _non_empty(obj.get("output_ids")):
        return True
    meta = obj.get("meta_info")
    n = meta.get("completion_tokens") if isinstance(meta, dict) else None
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def _data_payload(line: bytes) -> bytes | None:
    """The payload of an SSE ``data:`` line (``None`` for other lines)."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


def _decode(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return None


def completion_tokens_in(body: bytes) -> int | None:
    """``usage.completion_tokens`` (or ``meta_info.completion_tokens``) of a whole JSON answer: the
    last ``"completion_tokens": N`` in it, ``None`` if there is none."""
    last = None
    for m in _COMPLETION_TOKENS.finditer(body):
        last = m
    return None if last is None else int(last.group(1))


def cached_tokens_in(body: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (or SGLang's ``meta_info.cached_tokens``) of a
    whole JSON answer: the last ``"cached_tokens": N`` in it, ``None`` if there is none."""
    last = None
    for m in _CACHED_TOKENS.finditer(body):
        last = m
    return None if last is None else int(last.group(1))


def _set_cached(obj: Any, n: int) -> bool:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") == n:
        return False
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": n}
    return True


def with_cached_tokens(data: bytes, n: int, sse: bool) -> bytes:
    """``data`` with ``usage.prompt_tokens_details.cached_tokens`` set to ``n`` wherever a
    ``usage`` object is: in a JSON answer (``sse`` false) or in the ``data:`` lines of whole SSE
    lines (``sse`` true; other lines unchanged). PD mode reports the prefill leg's prefix-cache hit
    this way (issue 22: the decode engine reports 0). Unparseable parts are left as they are."""
    if not sse:
        obj = _decode(data)
        return json.dumps(obj).encode() if _set_cached(obj, n) else data
    out = []
    changed = False
    for line in data.split(b"\n"):
        if line.startswith(b"data:") and b'"usage"' in line:
            obj = _decode(line[5:].strip())
            if _set_cached(obj, n):
                line = b"data: " + json.dumps(obj).encode()
                changed = True
        out.append(line)
    return b"\n".join(out) if changed else data


class StreamMeter:
    """Reads one SSE answer as it is relayed (module docstring).

    Feed every chunk, in order, to :meth:`feed`; it returns ``True`` for the chunk that holds the
    first content event (once). After the stream ended, :meth:`output_tokens` gives the count.
    """

    __slots__ = ("content_seen", "_head", "_pre_events", "_events", "_edge", "_tail", "_tail_len",
                 "_dropped")

    def __init__(self) -> None:
        self.content_seen = False
        self._head = b""  # incomplete last line while looking for the first content event
        self._pre_events = 0  # data events before the first content event
        self._events = 0  # data events in the whole stream
        self._edge = b"\n"  # the stream's last bytes so far (up to 5)
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_len = 0
        self._dropped = False  # a chunk left the kept tail

    def feed(self, chunk: bytes) -> bool:
        """Account for the next chunk of the stream; ``True`` if the first content event is in it."""
        if not chunk:
            return False
        # "\ndata:" within the chunk, and across its start (the stream's start counts as a newline)
        edge = self._edge + chunk[:5]
        self._events += chunk.count(b"\ndata:") + edge.count(b"\ndata:")
        self._edge = chunk[-5:] if len(chunk) >= 5 else edge[-5:]
        self._tail.append(chunk)
        self._tail_len += len(chunk)
        while self._tail_len - len(self._tail[0]) >= TAIL_BYTES:
            self._tail_len -= len(self._tail.popleft())
            self._dropped = True
        if self.content_seen:
            return False
        return self._scan(chunk)

    def _scan(self, chunk: bytes) -> bool:
        data = self._head + chunk if self._head else chunk
        cut = data.rfind(b"\n") + 1
        self._head = data[cut:]
        for line in data[:cut].split(b"\n"):
            payload = _data_payload(line.rstrip(b"\r"))
            if payload is None:
                continue
            if payload != b"[DONE]" and event_has_content(_decode(payload)):
                self.content_seen = True
                self._head = b""
                return True
            self._pre_events += 1
        if len(self._head) > MAX_HEAD_BYTES:  # one endless line: give up looking
            self.content_seen = True
            self._head = b""
            return True
        return False

    def output_tokens(self) -> int:
        """Output tokens of the ended stream: the last ``usage.completion_tokens``, else the count of
        content events (module docstring); 0 when no content event came."""
        if not self.content_seen:
            return 0
        parts: list[bytes] = []  # the last chunks, enough for MAX_TRAILING_EVENTS events
        seen = 0
        for c in reversed(self._tail):
            parts.append(c)
            seen += c.count(b"data:")
            if seen > MAX_TRAILING_EVENTS:
                break
        lines = b"".join(reversed(parts)).split(b"\n")
        if self._dropped or len(parts) < len(self._tail):  # the kept bytes may start inside a line
            lines = lines[1:]
        trailing = 0
        parsed = 0
        counting = True
        usage_tokens: int | None = None
        for line in reversed(lines):
            payload = _data_payload(line.rstrip(b"\r"))
            if payload is None:
                continue
            parsed += 1
            if parsed > MAX_TRAILING_EVENTS:
                break
            obj = None if payload == b"[DONE]" else _decode(payload)
            if usage_tokens is None and isinstance(obj, dict):
                usage = obj.get("usage")
                if not isinstance(usage, dict):  # SGLang's /generate: meta_info.completion_tokens
                    usage = obj.get("meta_info")
                n = usage.get("completion_tokens") if isinstance(usage, dict) else None
                if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                    usage_tokens = n
            if counting:
                if event_has_content(obj):
                    counting = False
                else:
                    trailing += 1
            if usage_tokens is not None and not counting:
                break
        if usage_tokens is not None:
            return usage_tokens
        # the first content event itself is never trailing: at least one token
        return max(self._events - self._pre_events - trailing, 1)
