"""Large request bodies are parsed, checked and hashed in a worker process, off the event loop.

Parsing a 32 MB token-id prompt, checking it and hashing its blocks is seconds of CPU that, on the
event loop, froze every other client (issue 25 item 2: 3.2-3.4 s for a 32 MB token-id prompt,
1.76 s for a 20 MB ``logit_bias`` map), and the millions of Python objects it made stayed in the
router's heap long after (item 1). A thread does not help: ``json.loads`` holds the GIL
throughout. So a body of at least :data:`OFFLOAD_BODY_BYTES` goes to a worker process
(:class:`BodyOffload`), which does all the work proportional to the body:

* parse it (the same errors as :func:`~balancer.service.request_checks.parse_json_body`), check it
  (:func:`~balancer.service.request_checks.check_request`, the client's request id), extract the
  prompt and hash it (:class:`~balancer.service.prompt.PromptHasher`, with the tokenizer if one is
  configured, from the request's LoRA chain root);
* send back only a *light body*: the top-level members whose JSON text is at most
  :data:`ELIDE_VALUE_BYTES` bytes as values, every larger one as an :class:`Elided` byte span of
  the raw body (the prompt, the messages, a big ``logit_bias``), plus the prompt length, the
  block hashes, the output limit and the client's request id.

The router forwards the raw bytes as before; where it changes top-level fields
(:func:`encode_body`) it copies each elided value's bytes from the raw body, never re-encoding
them. The worker process runs in its own heap (recycled every :data:`TASKS_PER_WORKER` bodies), so
the router's own memory holds just the raw body while the request lasts.

Bodies that are not UTF-8 (UTF-16/32, a BOM: JSON's other legal encodings) come back re-encoded
as UTF-8 (:attr:`Analysis.raw`), so that spans index bytes the router forwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.process
import ctypes
import functools
import gc
import json
import logging
import multiprocessing
import os
import re
import select
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from balancer.service.prompt import TOKEN_ID_LIMIT, PromptError, PromptHasher, extract_prompt, max_output_tokens
from balancer.service.request_checks import check_request, client_request_id, parse_json_body

__all__ = ["ELIDE_VALUE_BYTES", "MALLOC_MMAP_THRESHOLD_BYTES", "MALLOC_TRIM_THRESHOLD_BYTES", "MAX_PENDING", "MAX_TOP_LEVEL_FIELDS", "OFFLOAD_BODY_BYTES", "Analysis",
           "BodyOffload", "Elided", "analyze", "encode_body", "trim_malloc", "tune_malloc"]

log = logging.getLogger("pdlb.service")

OFFLOAD_BODY_BYTES = 256 * 1024
"""Request bodies at least this long (bytes) are parsed in the worker process (a 256 KiB body
parses in about 3 ms on the event loop)."""
ELIDE_VALUE_BYTES = 1024
"""Top-level values whose JSON text is longer than this stay in the raw body (:class:`Elided`)."""
MAX_TOP_LEVEL_FIELDS = 1024
"""Most top-level fields of a request body (OpenAI requests have a few dozen); more is a 400."""
MAX_PENDING = 4
"""Most large bodies parsed or waiting for the worker at once, per router process; more get 503
(``Retry-After: 1``) rather than a queue that grows with the attacker's rate."""
TASKS_PER_WORKER = 64
"""Bodies one worker process parses before it is replaced by a fresh one (its heap returned)."""

MALLOC_MMAP_THRESHOLD_BYTES = 512 * 1024
"""Allocations at least this large get their own memory mapping, returned to the OS when freed
(:func:`tune_malloc`). Above asyncio's 256 KiB socket read: its transports read with
``recv(256 KiB)`` (``max_size``), a fresh bytes object of that size shrunk to what came; under
glibc's default 128 KiB threshold every read was an ``mmap``, a page fault, an ``mremap`` and a
``munmap`` (strace: 3 of each per PD request), 14.5 us per small read against 2.0 us from the heap
(CPU time, this module's tests; 2-core development host). Still far below a large request body
(a 30 MB prompt and its copies are mapped and unmapped as before)."""
MALLOC_TRIM_THRESHOLD_BYTES = 4 * 1024 * 1024
"""Free memory at the top of the heap kept rather than given back (``M_TRIM_THRESHOLD``; glibc's
default 128 KiB). With the larger mmap threshold a freed 256 KiB read buffer lands at the heap's
top; under the default the heap shrank and grew again around every read (two ``brk`` calls)."""


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library of this process (loaded once)."""
    return ctypes.CDLL(None)


def tune_malloc() -> None:
    """Fix glibc's mmap threshold at :data:`MALLOC_MMAP_THRESHOLD_BYTES` and its trim threshold
    at :data:`MALLOC_TRIM_THRESHOLD_BYTES` (``mallopt``; a no-op without glibc). By default glibc
    raises the mmap threshold after a large block is freed, up to 32 MiB, so that later large
    request bodies (a 30 MB prompt, its copies) are carved from the heap and their pages stay
    resident after they are freed (the router's RSS grows by ~65 MB per 30 MB request and stays
    there, issue 25 item 1). With the threshold fixed, every large buffer is unmapped when freed;
    fixed above asyncio's 256 KiB socket reads, those come from the heap (issue 26)."""
    try:
        libc = _libc()
        libc.mallopt(-3, MALLOC_MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD (also stops the dynamic adjustment)
        libc.mallopt(-1, MALLOC_TRIM_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


_WS = re.compile(r"[ \t\n\r]*")
_SCANSTRING = json.decoder.scanstring  # type: ignore[attr-defined]


def _skip(text: str, i: int) -> int:
    """The index of the first non-whitespace character of ``text`` at or after ``i``."""
    m = _WS.match(text, i)
    return i if m is None else m.end()


@dataclass(frozen=True, slots=True)
class Elided:
    """A top-level value left in the raw body: its JSON text is ``raw[start:end]`` (bytes)."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Analysis:
    """What the worker process sends back for a valid body.

    ``body``: the light body (top-level fields; large values :class:`Elided`); ``raw``: the
    UTF-8 re-encoding of a body that was not UTF-8, else ``None`` (the raw body as received);
    ``n_tokens`` (>= 1) and ``hashes``: as :meth:`PromptHasher.hash`; ``max_out``: the output limit
    (:func:`~balancer.service.prompt.max_output_tokens`); ``client_id``: the client's request id
    (:func:`~balancer.service.request_checks.client_request_id`)."""

    body: dict[str, Any]
    raw: bytes | None
    n_tokens: int
    hashes: tuple[int, ...]
    max_out: int
    client_id: str | None
    tokenized: bool  # the prompt was token ids (exact count), not text estimated
    inexact: tuple[str, ...] = ()  # why the prompt's tokens may differ from the engine's (PromptHasher.on_inexact)


COMPACT_IDS_MIN_CHARS = 64 * 1024
"""A prompt of token ids (``prompt``, ``input_ids``) whose JSON text is at least this long is
parsed into one integer array (:func:`_compact_ids`), not a list of Python ints."""
_ID_FIELD = {"completions": "prompt", "generate": "input_ids"}
"""The body field that holds a prompt of token ids, per endpoint."""
_ID_CHARS = b"0123456789, \t\n\r"
_PLACEHOLDER_IDS = [0]
"""What the light body's checks see in place of a compact token-id array (a valid flat array)."""


def _compact_ids(text: str, i: int, ascii_raw: bytes | None = None) -> tuple[np.ndarray, int] | None:
    """The JSON array of token ids at ``text[i]`` (``[``) as an ``int64`` array and the index
    after its ``]`` (``ascii_raw``: ``text``'s bytes if it is ASCII, read instead of encoding a
    slice of ``text``), if it is a flat array of at least :data:`COMPACT_IDS_MIN_CHARS` characters of
    integers in ``[0, 2**32)`` written as JSON writes them; else ``None`` (the caller parses the
    value as usual, and gets the usual error for anything invalid).

    A 32 MB prompt of 3.7M token ids is then one 30 MB array instead of 3.7M Python ints in a
    list (about 150 MB), then a tuple and a list of them (the copies :func:`extract_prompt` and
    :meth:`PromptHasher.hash` make): the body worker's peak memory and CPU per large body drop
    (``bench/body_analysis.py``). Exactly the arrays ``json.loads`` reads as such are taken:
    only digits, commas and JSON's whitespace; as many numbers as commas + 1 (no empty element);
    as many digits as the numbers' decimal forms (no leading zero); every number below ``2**32``."""
    j = text.find("]", i)
    if j < 0 or j - i < max(COMPACT_IDS_MIN_CHARS, ELIDE_VALUE_BYTES + 1):  # always elided from the light body
        return None
    try:
        inner = ascii_raw[i + 1:j] if ascii_raw is not None else text[i + 1:j].encode("ascii")
    except UnicodeEncodeError:
        return None
    if inner.translate(None, _ID_CHARS):  # anything else: a nested array, a sign, a float, a string
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ids = np.fromstring(inner, dtype=np.int64, sep=",")  # (with count= it reads past a bad end)
    except (ValueError, DeprecationWarning):  # an empty element, digits split by whitespace
        return None
    if ids.size == 0 or ids.size != inner.count(b",") + 1 or ids.min() < 0 or ids.max() >= TOKEN_ID_LIMIT:
        return None  # (numbers beyond int64 come back clamped, so >= 2**32 too)
    digits = len(inner) - sum(inner.count(c) for c in (b",", b" ", b"\t", b"\n", b"\r"))
    if digits != ids.size + sum(int(np.count_nonzero(ids >= 10 ** k)) for k in range(1, 10)):  # ids < 10**10
        return None  # a leading zero ("007"), which JSON does not allow
    return ids, j + 1


def _members(text: str, ids_field: str | None = None, ascii_raw: bytes | None = None
             ) -> tuple[dict[str, Any], dict[str, tuple[int, int]], np.ndarray | None] | None:
    """The top-level object of ``text``, each member's value span (character offsets) and the
    token ids of member ``ids_field`` if :func:`_compact_ids` read them (the object then holds
    :data:`_PLACEHOLDER_IDS` for it), or ``None`` if ``text`` is not a well-formed JSON object (the
    caller gets the error from :func:`parse_json_body`). Duplicate keys keep the last value, as
    ``json.loads`` does. ``ascii_raw``: as :func:`_compact_ids`."""
    scan = _SCANNER
    compact: np.ndarray | None = None
    i = _skip(text, 0)
    if text[i:i + 1] != "{":
        return None
    i = _skip(text, i + 1)
    body: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    if text[i:i + 1] == "}":
        i += 1
    else:
        while True:
            if text[i:i + 1] != '"':
                return None
            key, i = _SCANSTRING(text, i + 1, True)
            i = _skip(text, i)
            if text[i:i + 1] != ":":
                return None
            i = _skip(text, i + 1)
            got = _compact_ids(text, i, ascii_raw) if key == ids_field and text[i:i + 1] == "[" else None
            if got is not None:
                compact, end = got
                value = list(_PLACEHOLDER_IDS)
            else:
                try:
                    value, end = scan(text, i)
                except StopIteration:
                    return None
                if key == ids_field:  # a later duplicate replaces an earlier compact array
                    compact = None
            body[key] = value
            spans[key] = (i, end)
            if len(body) > MAX_TOP_LEVEL_FIELDS:
                raise PromptError(f"the JSON body has more than {MAX_TOP_LEVEL_FIELDS} top-level fields")
            i = _skip(text, end)
            c = text[i:i + 1]
            i = _skip(text, i + 1)
            if c == "}":
                break
            if c != ",":
                return None
    if _skip(text, i) != len(text):
        return None
    return body, spans, compact


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


_SCANNER = json.scanner.make_scanner(json.JSONDecoder(parse_constant=_reject_constant))  # type: ignore[attr-defined]


def _byte_spans(text: str, spans: dict[str, tuple[int, int]], ascii_only: bool) -> dict[str, tuple[int, int]]:
    """Character spans -> UTF-8 byte spans of ``text`` (in one pass over it)."""
    if ascii_only:
        return spans
    out: dict[str, tuple[int, int]] = {}
    pos_c = pos_b = 0
    for key, (s, e) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        pos_b += len(text[pos_c:s].encode("utf-8", "surrogatepass"))
        start = pos_b
        pos_b += len(text[s:e].encode("utf-8", "surrogatepass"))
        pos_c = e
        out[key] = (start, pos_b)
    return out


_HASHER: PromptHasher | None = None
_LORA_ROOTS: dict[str, int] = {}


def exit_with(pid: int) -> None:
    """End this process (``os._exit(0)``) as soon as process ``pid`` has ended: a daemon thread
    waits on a pidfd of it (Linux 5.3+; elsewhere it checks every second), so a body worker does
    not outlive its router process when that one is killed with SIGKILL. The worker's parent is
    the fork server, not the router, and the worker holds the fork server's "alive" pipe, so
    without this neither ever saw EOF (issue 25 review finding F7). ``pid`` already gone: exits now."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd_open (not Linux, an old kernel, seccomp)
        fd = None

    def watch() -> None:
        if fd is not None:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not poller.poll():  # a pidfd becomes readable when its process ends
                pass
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:  # another user's process: ours ended and its pid was reused
                    break
        os._exit(0)

    threading.Thread(target=watch, name="pdlb-exit-with-router", daemon=True).start()


def _init_worker(block_size: int, chars_per_token: float, tokenizer_path: str | None, lora_adapters: list[str],
                 chat_engine: str = "vllm", router_pid: int | None = None) -> None:
    global _HASHER, _LORA_ROOTS
    from balancer.kv_translate import chain_root

    if router_pid is not None:
        exit_with(router_pid)
    tune_malloc()
    _HASHER = PromptHasher(block_size, chars_per_token, tokenizer_path, engine=chat_engine)
    _LORA_ROOTS = {name: chain_root(name) for name in lora_adapters}


def analyze(raw: bytes, endpoint: str, header_request_id: str | None, max_tokens_limit: int,
            default_max_tokens: int, hasher: PromptHasher | None = None,
            lora_roots: dict[str, int] | None = None) -> Analysis | str:
    """Parse, check and hash one request body (in the worker process; pure, callable anywhere).

    Args:
        raw: the body as received.
        endpoint: ``"completions"``, ``"chat"`` or ``"generate"``.
        header_request_id: the ``X-Request-Id`` header, if any.
        max_tokens_limit, default_max_tokens: the service's settings of those names.
        hasher, lora_roots: the prompt hasher and the LoRA chain roots (default: the worker's).

    Returns:
        The :class:`Analysis`, or the message of the 400 answer (invalid JSON, a check failed).
    """
    hasher = hasher if hasher is not None else _HASHER
    roots = lora_roots if lora_roots is not None else _LORA_ROOTS
    assert hasher is not None, "the worker process was not initialised"
    try:
        try:
            text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as parse_json_body decodes
            parsed = _members(text, _ID_FIELD.get(endpoint), raw if raw.isascii() else None)
        except PromptError:
            raise
        except (ValueError, UnicodeDecodeError):
            parsed = None
        except RecursionError:
            return "invalid JSON body: the JSON body is nested too deeply"
        if parsed is None:  # not a well-formed object: the error json.loads gives, as on the event loop
            try:
                doc = parse_json_body(raw)
            except (ValueError, UnicodeDecodeError) as e:
                return f"invalid JSON body: {str(e)[:200]}"
            return "the JSON body must be an object" if not isinstance(doc, dict) else "invalid JSON body"
        body, spans, compact = parsed
        check_request(endpoint, body, max_tokens_limit)
        client_id = client_request_id(body, {"X-Request-Id": header_request_id} if header_request_id is not None else {})
        prompt = extract_prompt(endpoint, body)
        max_out = max_output_tokens(endpoint, body, default_max_tokens)
        model = body.get("model")
        inexact: list[str] = []
        saved, hasher.on_inexact = hasher.on_inexact, inexact.append  # reported by the router (Analysis.inexact)
        try:
            root = roots.get(model) if isinstance(model, str) else None
            if compact is not None and prompt.token_ids is not None:  # the prompt is the compact array
                n_tokens, hashes = hasher.hash_token_ids(compact, root)
            else:
                n_tokens, hashes = hasher.hash(prompt, root)
        finally:
            hasher.on_inexact = saved
    except PromptError as e:
        return str(e)
    new_raw = None
    utf8 = text.encode("utf-8", "surrogatepass") if len(text) != len(raw) or not raw.isascii() else raw
    if utf8 != raw:  # UTF-16/32: the router forwards (and spans index) the UTF-8 re-encoding
        new_raw = utf8
    bspans = _byte_spans(text, spans, raw.isascii())
    light = {k: (Elided(*bspans[k]) if bspans[k][1] - bspans[k][0] > ELIDE_VALUE_BYTES else v) for k, v in body.items()}
    return Analysis(light, new_raw, n_tokens, tuple(hashes), max_out, client_id, prompt.token_ids is not None,
                    tuple(inexact))


def _analyze_in_worker(*args: Any) -> Analysis | str:
    try:
        return analyze(*args)
    finally:  # the body's objects are garbage now: give their memory back to the OS
        gc.collect()
        trim_malloc()


def trim_malloc() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``; elsewhere a no-op)."""
    try:
        _libc().malloc_trim(0)  # glibc; elsewhere a no-op
    except (OSError, AttributeError):
        pass


def encode_body(body: dict[str, Any], raw: bytes | None) -> bytes:
    """The JSON encoding of ``body`` for an upstream leg, copying each :class:`Elided` value's
    bytes from ``raw`` (the body the light body was made from). Without elided values it is
    ``json.dumps(body)``."""
    if raw is None or not any(type(v) is Elided for v in body.values()):
        return json.dumps(body).encode()
    view = memoryview(raw)
    parts: list[bytes | memoryview] = []
    for k, v in body.items():
        parts += (b", " if parts else b"{", json.dumps(k).encode(), b": ",
                  view[v.start:v.end] if type(v) is Elided else json.dumps(v).encode())
    parts.append(b"}")
    return b"".join(parts)  # one copy of the large values, straight from raw


def _ignore(fut: concurrent.futures.Future) -> None:
    fut.exception() if not fut.cancelled() else None  # retrieved: no "never retrieved" warning


class BodyOffload:
    """The worker process of one router process: :meth:`analyze` runs :func:`analyze` there.

    Started at the first large body (a fresh interpreter from a fork server, a second or so, in a
    thread: the event loop goes on), replaced every :data:`TASKS_PER_WORKER` bodies; at most
    :data:`MAX_PENDING` bodies at once (:meth:`analyze` returns ``None`` beyond: the caller
    answers 503).

    Args:
        block_size, chars_per_token, tokenizer_path, lora_adapters, max_tokens_limit,
            default_max_tokens, chat_engine: the service's settings of those names.
    """

    def __init__(self, block_size: int, chars_per_token: float, tokenizer_path: str | None,
                 lora_adapters: list[str], max_tokens_limit: int, default_max_tokens: int,
                 chat_engine: str = "vllm") -> None:
        self._init_args = (block_size, chars_per_token, tokenizer_path, list(lora_adapters), chat_engine)
        self._limits = (max_tokens_limit, default_max_tokens)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._starting: asyncio.Future | None = None
        self.pending = 0

    def _start(self) -> concurrent.futures.ProcessPoolExecutor:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["balancer.service.body_offload"])
        pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=ctx, initializer=_init_worker, initargs=(*self._init_args, os.getpid()),
            max_tasks_per_child=TASKS_PER_WORKER)
        pool.submit(int).result()  # the worker is up (imports, tokenizer) before the first body
        return pool

    async def analyze(self, raw: bytes, endpoint: str, header_request_id: str | None) -> Analysis | str | None:
        """:func:`analyze` of ``raw`` in the worker process; ``None`` when :data:`MAX_PENDING`
        bodies are in progress already or the worker process died meanwhile (the caller answers
        503; the next body starts a new one).

        Raises:
            OSError: the worker process could not be started.
        """
        if self.pending >= MAX_PENDING:
            return None
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            if self._pool is None:
                if self._starting is None:
                    self._starting = loop.run_in_executor(None, self._start)
                try:
                    pool = await asyncio.shield(self._starting)
                except BaseException:
                    if self._starting.done():  # failed: the next body tries again
                        self._starting = None
                    raise
                self._pool = pool
            pool = self._pool
            try:
                return await loop.run_in_executor(pool, _analyze_in_worker, raw, endpoint, header_request_id,
                                                  *self._limits)
            except concurrent.futures.process.BrokenProcessPool:  # the worker died (killed, out of memory)
                log.warning("the body-parsing worker process died: starting a new one for the next large body")
                if self._pool is pool:
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._pool, self._starting = None, None
                return None
        finally:
            self.pending -= 1
            if self._pool is not None:
                # multiprocessing's queue threads keep the last item they sent (the pickled body,
                # ~35 MB for a 32 MB body) and received until the next one: send a tiny one after it
                self._pool.submit(int).add_done_callback(_ignore)

    def pids(self) -> list[int]:
        """Process ids of the worker processes now running (for tests and the soak bench)."""
        procs = getattr(self._pool, "_processes", None) or {}
        return list(procs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
