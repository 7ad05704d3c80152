"""Request forwarding: one client request -> route -> PD legs -> relayed response, with retries.

Flows (ANCHORS.md, "PD request flows"):

* ``sglang``: pick prefill P and decode D; add ``bootstrap_host`` (P's host), ``bootstrap_port``
  (P's configured bootstrap port or null), ``bootstrap_room`` (random 63-bit), ``rid`` and, for
  engines with ``dp_size > 1``, each leg's ``data_parallel_rank``; POST the same body to P and D at
  once; relay D's (streamed) response. If P fails, D is aborted (its connection closed and
  ``/abort_request`` sent) and vice versa.
* ``vllm``: POST to P with ``kv_transfer_params = {do_remote_decode: true, ...}``,
  ``max_tokens = 1``, ``stream = false`` and ``X-Request-Id``; POST the original body plus P's
  returned ``kv_transfer_params`` to D with the same ``X-Request-Id``; relay D.
* ``none`` (or conditional disaggregation chose no prefill): POST to the decode/mixed worker.

Request ids: every attempt sends the engines an id of the router's own (``X-Request-Id`` and, for
SGLang, ``rid``), unique per attempt and per router process, so that no client can name another
client's request (an engine refuses a duplicate id, and the cleanup's ``/abort_request`` would kill
the other request). The client's own id (``rid`` or ``X-Request-Id``, checked by
:func:`balancer.service.request_checks.client_request_id`), or else the first attempt's id, is the
one the client sees: the relayed body has the upstream id replaced by it (SSE line by line, so
no event is held back), and the response carries it in ``X-Request-Id``.

Retries: a failure before any byte reached the client (connect error, a status in
``retry.retry_statuses``, an upstream that vanished before its first byte) is retried with
exponential backoff and jitter on a *new* route (new pair, new room, new request id)
that avoids every worker that failed earlier in the same client request (``Router.route``'s
``exclude_engines``; a pool whose every worker failed is used whole), so a retry does not pick the
same dead worker again while its circuit breaker is still closed.

Failures and circuit breakers: a client request counts at most one failure against each worker,
however many attempts it made. Connect errors, resets, timeouts and 502/503/504/408/429 answers
count at once. A 500 answer counts only if the request then succeeds elsewhere: a second 500 for the
same request (from another worker) means the request itself is at fault (an engine that cannot
parse a field), so it is not retried further, nobody is charged and the engine's answer is relayed.
When an SGLang decode leg fails because its prefill leg failed (both fail, or the decode leg fails
first and its prefill fails within :data:`PREFILL_BLAME_GRACE_S`, or the decode leg answered 502,
as a decode engine does that could not get the KV, and the prefill is still running then: kind
``prefill_stalled``), only the prefill worker is charged.

With a PD protocol and prefill workers registered but none routable (every prefill breaker open or
every prefill worker unhealthy), requests get 503 ("no healthy prefill worker", retried while the
request's time lasts) rather than reaching PD decode engines without bootstrap fields; ``/health``
then answers 503 too. Conditional disaggregation (``pd_min_uncached_tokens``) still serves short
prompts on the decode engine alone, as configured.
With ``first_byte_timeout_s`` set, a leg whose response headers (and, for the streamed decode
leg, first body chunk) do not arrive within that many seconds of sending it is such a failure
too (kind ``first_byte_timeout``): a wedged engine that accepted the connection is retried
elsewhere and trips its circuit breaker instead of holding the request until ``request_timeout_s``.
A prefill leg must also answer in full within ``prefill_timeout_s`` (default 60 s; kind
``prefill_timeout``), so a wedged prefill engine costs a request at most that long by default.
Other 4xx answers are passed through unchanged. Once streaming started, an upstream failure ends
the stream with an SSE ``data: {"error": ...}`` event. The whole request, retries included, is
bounded by ``request_timeout_s`` (504). A client disconnect (handler cancellation or a failed write)
aborts every started leg.

Router hooks: ``route`` at dispatch, ``on_prefill_done`` when P answered, ``on_first_token`` when
D's first event with generated content arrived (streaming; not its first byte: engines send a
role-only chunk first, some before prefill, :mod:`balancer.service.stream_meter`) or at its full
answer, ``on_finished`` in a ``finally`` so load always returns to 0. A stream that ends without
any content event never calls ``on_first_token`` (nor observes TTFT).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from balancer.router import NoReplicaError, RequestTooLargeError, Router
from balancer.service.admission_gate import admission_answer
from balancer.service.body_offload import Analysis, encode_body
from balancer.service.config import ServiceConfig
from balancer.service.deadlines import DeadlineQueue
from balancer.service.lean_front import LeanRequest
from balancer.service.log_limit import RateLimitedLog
from balancer.service.metrics import ServiceMetrics
from balancer.service.prompt import PromptError, PromptHasher, extract_prompt, max_output_tokens
from balancer.service.request_checks import check_request, client_request_id, session_id_of
from balancer.service.stream_meter import StreamMeter, cached_tokens_in, completion_tokens_in, with_cached_tokens
from balancer.service.upstream import UpstreamClient, UpstreamConnectError, UpstreamConnectTimeout, UpstreamResponse
from balancer.service.workers import Worker, WorkerPool
from balancer.types import Request, Route

log = logging.getLogger("pdlb.service")

LegResponse = aiohttp.ClientResponse | UpstreamResponse
"""An engine leg's answer from either upstream client (``upstream_client``: the lean client's
:class:`~balancer.service.upstream.UpstreamResponse` or aiohttp's); the proxy uses what both have:
``status``, ``headers``, ``content_type``, ``read``, ``content.iter_any``, ``release``, ``close``.
Both clients' connection failures are caught as ``(aiohttp.ClientError, OSError)``."""

_FAULTS: contextvars.ContextVar[_RequestFaults | None] = contextvars.ContextVar("pdlb_request_faults", default=None)
"""The current client request's :class:`_RequestFaults` (set by :meth:`Proxy.handle`, added to by
:meth:`Proxy._failed`; legs run in tasks that copy the context, so they share it)."""

TOKENIZE_IN_THREAD_CHARS = 4096
"""Text prompts at least this long (characters) are tokenised in a worker thread."""
MAX_SSE_LINE_BYTES = 4 * 1024 * 1024
"""Longest line of a relayed event stream the router holds back while swapping request ids (an
SSE event with 20 log-probabilities per token is a few KB); a longer one ends the stream with a
502 error event and counts as a failure of the engine (kind ``sse_line_too_long``)."""
PREFILL_BLAME_GRACE_S = 2.0
"""After an SGLang decode leg failed while its prefill leg was still running: how long to wait for
the prefill leg's outcome to decide which worker to charge (a decode leg whose prefill failed
fails too, often first)."""



ID_BYTES = 12
"""Random bytes per request id (96 bits)."""
_ID_BATCH = 256
"""Ids drawn from the OS per ``os.urandom`` call (:func:`random_id_hex`)."""


class _RandomIds:
    """Request ids from the OS's random source, :data:`_ID_BATCH` ids' worth per ``os.urandom``
    call instead of one call (a system call) per id: the same unguessable bytes, each used once.
    A forked child starts with none (``os.register_at_fork``), so no two processes share one."""

    __slots__ = ("buf", "pos")

    def __init__(self) -> None:
        self.buf = b""
        self.pos = 0

    def take(self) -> str:
        pos = self.pos
        if pos + ID_BYTES > len(self.buf):
            self.buf, pos = os.urandom(ID_BYTES * _ID_BATCH), 0
        self.pos = pos + ID_BYTES
        return self.buf[pos:pos + ID_BYTES].hex()

    def drop(self) -> None:
        self.buf, self.pos = b"", 0


_IDS = _RandomIds()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_IDS.drop)


def random_id_hex() -> str:
    """:data:`ID_BYTES` bytes from ``os.urandom`` as 24 hex digits, never the same bytes twice
    (within a process, and across a fork)."""
    return _IDS.take()


@dataclass(slots=True)
class _RequestFaults:
    """Workers that failed during one client request: ``failed`` (kept off its retries) and
    ``charged`` (already counted once against their circuit breakers)."""

    failed: set[str] = field(default_factory=set)
    charged: set[str] = field(default_factory=set)
    #: the current attempt's legs still waiting for their first byte, by URL: charged to their
    #: workers if the request times out meanwhile (a wedged engine that passes health checks)
    waiting: dict[str, Worker] = field(default_factory=dict)


_CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    UpstreamConnectError, UpstreamConnectTimeout, aiohttp.ClientConnectorError, ConnectionRefusedError,
    *((aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()))  # aiohttp >= 3.10
"""Failures to open a connection at all (both upstream clients): the worker is unreachable."""

STREAM_STATUS: web.RequestKey[int] = web.RequestKey("pdlb_stream_status", int)
"""Request key: the status a started stream ended with when it failed (the metrics use it)."""


SERVER_HEADER = "pdlb"
"""The ``Server`` header of every answer (aiohttp's default, ``Python/3.x aiohttp/3.y``, tells
clients the versions running)."""


def error_response(status: int, message: str, etype: str | None = None) -> web.Response:
    """An OpenAI-style error object: ``{"error": {"message", "type", "code"}}``."""
    if etype is None:
        etype = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": etype, "code": status}}, status=status)


MAX_ENGINE_ERROR_CHARS = 4096
"""Most characters of an engine's own error text kept in ``error.engine_error``."""
MAX_ENGINE_ERROR_PARSE_BYTES = 1 << 20
"""An engine error body longer than this is not parsed as JSON (kept as cut text)."""


def engine_error_response(status: int, body: bytes, content_type: str | None, fallback: str) -> web.Response:
    """The client's answer for an engine's error answer, in OpenAI's shape
    ``{"error": {"message", "type", "code"}}`` whatever the engine sent.

    An answer already in that shape (vLLM's) is passed through unchanged. Others are wrapped, the
    engine's original kept in ``error.engine_error`` (parsed JSON, or text cut to
    :data:`MAX_ENGINE_ERROR_CHARS`): FastAPI's ``{"detail": ...}`` (transformers' server), SGLang's
    flat ``{"object": "error", "message", "type", "code"}``, ``{"error": "text"}``, plain text. The
    message is the engine's ``message``/``detail``/``error`` text, else ``fallback``.
    """
    text = body[:MAX_ENGINE_ERROR_PARSE_BYTES].decode("utf-8", "replace")
    try:
        parsed: Any = json.loads(text) if body and len(body) <= MAX_ENGINE_ERROR_PARSE_BYTES else None
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict) and isinstance(
            parsed["error"].get("message"), str):
        return web.Response(status=status, body=body, content_type="application/json")
    message = None
    if isinstance(parsed, dict):
        for key in ("message", "detail", "error"):
            v = parsed.get(key)
            if isinstance(v, str) and v:
                message = v
                break
            if v is not None and key == "detail":  # FastAPI validation errors: a list of objects
                message = json.dumps(v)[:500]
                break
    elif text.strip() and parsed is None:
        message = text.strip()[:500]
    original: Any = parsed if parsed is not None and len(text) <= MAX_ENGINE_ERROR_CHARS else text[:MAX_ENGINE_ERROR_CHARS]
    etype = "invalid_request_error" if status < 500 else "server_error"
    err = {"message": message or fallback, "type": etype, "code": status, "engine_error": original}
    return web.json_response({"error": err}, status=status)


def encode_with(raw: bytes | None, body: dict[str, Any], extra: dict[str, Any]) -> bytes:
    """The JSON encoding of ``{**body, **extra}`` for an upstream leg.

    ``raw`` is the client's own encoding of ``body`` (``None`` if unknown). When it is a UTF-8
    ``{...}`` object text and no key of ``extra`` is in ``body``, the result is ``raw`` with
    ``extra``'s members spliced in before its closing brace (``raw`` itself when ``extra`` is
    empty): the request body passes through without being re-encoded, and the engine parses the
    same object ``json.dumps({**body, **extra})`` would give. Otherwise that ``json.dumps``
    (with a light body's elided values copied from ``raw``: :func:`~balancer.service.body_offload.encode_body`).
    """
    if raw is not None and (not extra or not any(k in body for k in extra)):
        if not extra and raw[-1:] == b"}" and raw[:1] == b"{":  # the usual case, without copies
            return raw
        head = raw.rstrip()
        # a UTF-16/32 or BOM-prefixed body fails one of these checks and is re-encoded instead
        if head.endswith(b"}") and raw.lstrip()[:1] == b"{":
            if not extra:
                return raw
            tail = json.dumps(extra).encode()  # b'{"k": v, ...}'
            return b"".join((memoryview(head)[:-1], b", " if body else b"", tail[1:]))  # one copy of raw
    return encode_body({**body, **extra} if extra else body, raw)


async def _first_done(loop: asyncio.AbstractEventLoop, a: asyncio.Future, b: asyncio.Future | None) -> None:
    """Wait until ``a`` or ``b`` (if not ``None``) is done: ``asyncio.wait((a, b),
    return_when=FIRST_COMPLETED)`` without its sets (the caller looks at the tasks itself).
    Cancelling the caller leaves both running, as ``asyncio.wait`` does."""
    waiter = loop.create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    a.add_done_callback(wake)
    if b is not None:
        b.add_done_callback(wake)
    try:
        await waiter
    finally:
        a.remove_done_callback(wake)
        if b is not None:
            b.remove_done_callback(wake)


class Failure(Exception):
    """An attempt failed before any byte reached the client.

    ``message``: what the client is told; it names workers by role only (:func:`_who`), never by
    URL (engines' addresses are the operator's); ``where``: the URLs of the workers involved, for
    the log (:meth:`Proxy._log_failure`). ``worker``: the worker at fault (``None``: none, e.g. no
    routable worker); ``answered``: it sent an HTTP error answer (``body``), as opposed to failing
    to connect, reset or time out; ``charge``: whether it counts against the worker's breaker at
    once (``"now"``), only if the request later succeeds elsewhere (``"deferred"``), or not (``"no"``).
    """

    def __init__(self, status: int, message: str, retryable: bool, kind: str,
                 body: bytes | None = None, content_type: str | None = None, *,
                 worker: Worker | None = None, charge: str = "no", where: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.retryable, self.kind = status, message, retryable, kind
        self.body, self.content_type = body, content_type
        self.worker, self.charge = worker, charge
        self.where = where or (worker.url if worker is not None else "")
        self.unreachable = False  # kind "connect" because no connection could be opened at all

    def response(self, passthrough: bool = False) -> web.Response:
        """The client's answer: the engine's own 4xx (or, with ``passthrough``, any) error in
        OpenAI's shape (:func:`engine_error_response`), else pdlb's OpenAI-style error object."""
        if self.body is not None and (passthrough or (not self.retryable and 400 <= self.status < 500)):
            return engine_error_response(self.status, self.body, self.content_type, self.message)
        return error_response(self.status, self.message)


def _who(w: Worker) -> str:
    """A worker as client-facing messages name it: by role, never by URL."""
    return "the worker" if w.cfg.role == "mixed" else f"the {w.cfg.role} worker"


@dataclass(slots=True)
class _Ctx:
    request: web.Request
    endpoint: str
    body: dict[str, Any]
    stream: bool
    t0: float
    raw: bytes | None = None  # the client's encoding of body, passed through where unchanged
    resp: web.StreamResponse | None = None
    visible_id: str = ""  # the request id the client sees
    upstream_id: str = ""  # the current attempt's id at the engines
    max_out: int | None = None  # the output-token limit (bounds a non-streamed decode leg)
    session_id: str | None = None  # the session key (X-Session-Id, ...) for Request.session_id


@dataclass
class _Legs:
    """Legs started by one attempt, so they can all be aborted."""

    started: list[tuple[Worker, str]] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    responses: list[LegResponse] = field(default_factory=list)
    done: bool = False
    prefill_failure: BaseException | None = None  # set when the prefill leg failed after decode answered
    #: output tokens of the relayed answer (:mod:`balancer.service.stream_meter`: the engine's
    #: ``usage``, else counted for streams), for the cost model's inter-token latency
    #: (``Router.on_finished``); None: unknown (a failed stream, a JSON answer without usage) or
    #: not needed (no online cost fit)
    output_tokens: int | None = None
    pd: bool = False  # the answer relayed is a PD decode leg's
    #: PD: ``usage.prompt_tokens_details.cached_tokens`` of the prefill leg's answer, reported to
    #: the client instead of the decode leg's (the prefill engine is the one that hit its cache)
    prefill_cached_tokens: int | None = None


def _relayed_headers(resp: LegResponse, default_type: str) -> dict[str, str]:
    """Headers of the decode leg passed to the client: its Content-Type and, since the client
    session does not decompress, its Content-Encoding if any."""
    h = resp.headers
    out = {"Content-Type": h.get("Content-Type", default_type), "Server": SERVER_HEADER}
    enc = h.get("Content-Encoding")
    if enc is not None:
        out["Content-Encoding"] = enc
    return out


class _LineTooLong(Exception):
    """An upstream SSE line grew past :data:`MAX_SSE_LINE_BYTES` without a newline."""


class _SwapLines:
    """A relayed event stream rewritten line by line (the upstream id replaced by the client's, PD
    usage): :meth:`feed` returns the complete lines received so far rewritten, and holds back the
    incomplete last line (the id could be split across chunks). The held bytes are kept as a
    list of chunks, joined once when their line completes, so a line of ``n`` bytes costs O(n)
    whatever its chunking (issue 25 item 6: re-joining per chunk was quadratic), and at most
    :data:`MAX_SSE_LINE_BYTES` are held (:class:`_LineTooLong` beyond)."""

    __slots__ = ("rewrite", "held", "held_bytes")

    def __init__(self, rewrite: Callable[[bytes], bytes]) -> None:
        self.rewrite = rewrite  # whole lines -> what the client gets (the id swapped, usage rewritten)
        self.held: list[bytes] = []
        self.held_bytes = 0

    def feed(self, chunk: bytes) -> bytes:
        cut = chunk.rfind(b"\n") + 1
        if cut == 0:
            self.held_bytes += len(chunk)
            if self.held_bytes > MAX_SSE_LINE_BYTES:
                raise _LineTooLong
            if chunk:
                self.held.append(chunk)
            return b""
        if self.held:
            self.held.append(chunk[:cut])
            out = b"".join(self.held)
        else:
            out = chunk[:cut] if cut < len(chunk) else chunk
        tail = chunk[cut:]
        self.held = [tail] if tail else []
        self.held_bytes = len(tail)
        if self.held_bytes > MAX_SSE_LINE_BYTES:
            raise _LineTooLong
        return self.rewrite(out)

    def rest(self) -> bytes:
        """The held incomplete line, rewritten (the stream ended without its newline)."""
        out = self.rewrite(b"".join(self.held)) if self.held else b""
        self.held, self.held_bytes = [], 0
        return out


FIRST_BYTE_QUEUES = 64
"""Most first-byte deadline queues a proxy keeps (one per streamed / output-limit kind of leg:
:meth:`Proxy._first_byte_queue`)."""


class Proxy:
    """Serves generation requests for one app (see the module docstring)."""

    def __init__(self, cfg: ServiceConfig, router: Router, pool: WorkerPool, metrics: ServiceMetrics,
                 session: aiohttp.ClientSession, hasher: PromptHasher | None = None,
                 upstream: UpstreamClient | None = None) -> None:
        self.cfg = cfg
        self.router = router
        self.pool = pool
        self.metrics = metrics
        self.session = session  # aborts (and the legs, without ``upstream``)
        #: the engine legs' client: the lean one (``upstream_client: lean``; plain-HTTP workers
        #: only, https workers always use the session) or the aiohttp session
        self.client: UpstreamClient | aiohttp.ClientSession = upstream if upstream is not None else session
        self.hasher = hasher or PromptHasher(cfg.router.block_size, cfg.chars_per_token, cfg.tokenizer_path)
        from balancer.kv_translate import chain_root

        #: request "model" -> chain root, for the LoRA adapters named in cfg.lora_adapters
        self._lora_roots = {name: chain_root(name) for name in cfg.lora_adapters}
        self.rng = random.Random(cfg.router.seed)
        # bootstrap rooms must not collide across router processes in front of the same engines: a
        # room generator seeded from the OS (one urandom call at start instead of one per request)
        self._room_rng = random.Random(secrets.randbits(128))
        self._ids = itertools.count()
        self._no_prefill = False  # the last attempt found no routable prefill worker (logged once)
        #: deadline admission (:class:`balancer.service.admission_gate.AdmissionGate`), or None
        self.admission: Any = None
        self.background: set[asyncio.Task] = set()
        #: worker failures that reach clients (their message names no URL): logged with the URLs,
        #: one line per kind per 10 s
        self.failures_log = RateLimitedLog(log, interval_s=10.0)
        # deadlines of one length each, queued without a timer per request (balancer.service.deadlines)
        self._request_deadlines = DeadlineQueue()  # request_timeout_s
        #: a leg's first-byte deadlines, one queue per (stream, max_out): one length each (see
        #: _first_byte_timeout); at most FIRST_BYTE_QUEUES, others share _first_byte_overflow
        self._first_byte_deadlines: dict[tuple[bool, int | None], DeadlineQueue] = {}
        self._first_byte_overflow = DeadlineQueue()  # any order (out of order: a timer of its own)
        self._prefill_deadlines = DeadlineQueue()  # prefill_timeout_s

    # ------------------------------------------------------------------ entry point
    async def handle(self, request: web.Request, endpoint: str, body: dict[str, Any],
                     raw: bytes | None = None, pre: Analysis | None = None) -> web.StreamResponse:
        """Serve one parsed request body on ``endpoint`` (``completions``, ``chat``, ``generate``);
        ``raw`` is the body as the client sent it (forwarded without re-encoding where the legs
        only add fields, see :func:`encode_with`); ``pre``: a large body's analysis from the
        worker process (:mod:`balancer.service.body_offload`; ``body`` is then its light body,
        checked and hashed there)."""
        cfg = self.cfg
        t0 = time.monotonic()
        if pre is not None:
            client_id, max_out, n_tokens, hashes, exact = pre.client_id, pre.max_out, pre.n_tokens, pre.hashes, pre.tokenized
            if pre.inexact:
                self.hasher._note(list(pre.inexact))
        else:
            try:
                check_request(endpoint, body, cfg.max_tokens_limit)
                client_id = client_request_id(body, request.headers)
                prompt = extract_prompt(endpoint, body)
                max_out = max_output_tokens(endpoint, body, cfg.default_max_tokens)
            except PromptError as e:
                return error_response(400, str(e))
            model = body.get("model")
            root = self._lora_roots.get(model) if self._lora_roots and isinstance(model, str) else None  # a LoRA's chain
            try:
                if self.hasher.tokenizes(prompt) and len(prompt.text or "") >= TOKENIZE_IN_THREAD_CHARS:
                    # long prompts are tokenised in a worker thread so that the event loop keeps serving other
                    # requests' I/O (at least between GIL switch intervals) while a big prompt is encoded
                    n_tokens, hashes = await asyncio.get_running_loop().run_in_executor(None, self.hasher.hash, prompt, root)
                else:
                    n_tokens, hashes = self.hasher.hash(prompt, root)
            except PromptError as e:  # e.g. the model's chat template rejected the messages
                return error_response(400, str(e))
            exact = prompt.token_ids is not None
        if cfg.max_model_len is not None and n_tokens + max_out > cfg.max_model_len:
            return error_response(400, f"the prompt ({n_tokens} tokens{'' if exact else ', estimated'}) plus "
                                       f"the output limit ({max_out} tokens) exceed max_model_len={cfg.max_model_len}")
        try:
            session_id = session_id_of(body, request.headers)
        except PromptError as e:
            return error_response(400, str(e))
        visible_id = client_id if client_id is not None else self.new_upstream_id()
        ctx = _Ctx(request, endpoint, body, body.get("stream") is True, t0, raw, visible_id=visible_id, max_out=max_out,
                   session_id=session_id)
        if self.admission is not None:  # held, shed (429 + Retry-After) or let through here
            refused = await admission_answer(self.admission, request, n_tokens, max_out, hashes)
            if refused is not None:
                refused.headers["X-Request-Id"] = visible_id
                return refused
            try:
                resp = await self._handle(ctx, client_id, n_tokens, hashes, max_out)
            finally:
                self.admission.on_request_done()
        else:
            resp = await self._handle(ctx, client_id, n_tokens, hashes, max_out)
        if "X-Request-Id" not in resp.headers and not resp.prepared:
            resp.headers["X-Request-Id"] = visible_id
        return resp

    async def _handle(self, ctx: _Ctx, client_id: str | None, n_tokens: int, hashes: tuple[int, ...],
                      max_out: int) -> web.StreamResponse:
        """:meth:`handle` once the request is checked: attempts, retries, the timeout."""
        cfg = self.cfg
        visible_id = ctx.visible_id
        attempt = 0
        faults = _RequestFaults()
        faults_token = _FAULTS.set(faults)
        deferred: list[Failure] = []  # 500 answers, charged only if the request succeeds elsewhere
        try:
            async with self._request_deadlines.after(cfg.request_timeout_s):
                while True:
                    # the router's own id at the engines, new per attempt (the first attempt of a
                    # request without a client id uses the id the client will see)
                    ctx.upstream_id = visible_id if attempt == 0 and client_id is None else self.new_upstream_id()
                    faults.waiting.clear()  # the last attempt's legs were aborted
                    try:
                        result = await self._attempt(ctx, ctx.upstream_id, n_tokens, hashes, max_out)
                    except Failure as f:
                        f.__traceback__ = None  # its frames hold the attempt's tasks and body (never logged)
                        faults.waiting.clear()  # the attempt's other legs were aborted
                        if f.worker is not None:
                            self._failed(f.worker, f.kind, charge=f.charge == "now",
                                         unreachable=f.message if f.unreachable else None)
                        if f.charge == "deferred":
                            if f.status == 500 and f.body is not None and any(
                                    d.status == 500 and d.body is not None for d in deferred):
                                # the same error from a second worker: the request is at fault
                                log.info("request %s: %d from %s and %s; not retried (request-caused error)",
                                         visible_id, f.status, deferred[0].worker.url if deferred[0].worker else "?",
                                         f.worker.url if f.worker else "?")
                                return f.response(passthrough=True)
                            deferred.append(f)
                        if not f.retryable or attempt >= cfg.retry.max_retries:
                            self._log_failure(visible_id, f.status, f.kind, f.message, f.where)
                            return f.response()
                        attempt += 1
                        self.metrics.child(self.metrics.retries, f.kind).inc()
                        await asyncio.sleep(self.backoff_s(attempt))
                    else:
                        for d in deferred:  # the request was fine: those workers really failed
                            if d.worker is not None:
                                self._charge(d.worker)
                        return result
        except TimeoutError:
            msg = f"request timed out after {cfg.request_timeout_s:g} s"
            for w in list(faults.waiting.values()):  # legs that never answered: their engines' fault
                self._failed(w, "request_timeout")
            if ctx.resp is not None:  # already streaming: end the stream with an error event
                await self._stream_error(ctx, 504, msg, "timeout")  # the type a non-streamed answer has
                return ctx.resp
            return error_response(504, msg, "timeout")
        except ConnectionResetError:  # the client went away while we were writing
            return ctx.resp if ctx.resp is not None else web.Response(status=499)
        finally:
            _FAULTS.reset(faults_token)

    def _log_failure(self, request_id: str, status: int, kind: str, message: str, where: str) -> None:
        """Log a worker failure that became a client's answer (5xx: an engine's 4xx is the
        request's) with the URLs the client's message leaves out: one line per ``kind`` per 10 s."""
        if status >= 500 and where:
            self.failures_log.log(logging.WARNING, kind, time.monotonic(), "request %s: %d %s [%s]",
                                  request_id, status, message, where)

    def new_upstream_id(self) -> str:
        """A new request id, unique per attempt and unguessable: ``pdlb-<24 hex digits>`` from the
        OS's random source (96 bits; no counter, so an id tells a client nothing of the others'
        traffic, and no router process repeats another's): :func:`random_id_hex`."""
        return f"pdlb-{random_id_hex()}"

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1-based), with jitter."""
        r = self.cfg.retry
        base = min(r.max_backoff_s, r.initial_backoff_s * r.backoff_multiplier ** (attempt - 1))
        return base * (1.0 + r.jitter * (2.0 * self.rng.random() - 1.0))

    # ------------------------------------------------------------------ one attempt
    async def _attempt(self, ctx: _Ctx, upstream_id: str, n_tokens: int, hashes: tuple[int, ...],
                       max_out: int) -> web.StreamResponse:
        now = time.monotonic()
        self.pool.refresh_due(now)
        if self.cfg.pd_protocol != "none" and self.pool.num_prefill and not self.router.disaggregated:
            # PD decode engines cannot serve a request without its prefill leg: 503, not a silent
            # decode-only request (pd_min_uncached_tokens still serves short prompts decode-only
            # while a prefill worker is routable)
            if not self._no_prefill:
                self._no_prefill = True
                log.warning("no routable prefill worker (%d registered): PD requests get 503 until one recovers",
                            self.pool.num_prefill)
            raise Failure(503, "no healthy prefill worker (every prefill worker is unhealthy or its circuit "
                               "breaker is open)", True, "no_prefill")
        if self._no_prefill:
            self._no_prefill = False
            log.info("a prefill worker is routable again: PD requests are served")
        router_id = f"a{next(self._ids)}"
        try:
            route = self.router.route(Request(router_id, now, n_tokens, hashes, max_output_tokens=max_out,
                                              session_id=ctx.session_id), now,
                                      exclude_engines=faults.failed if (faults := _FAULTS.get()) is not None else ())
        except NoReplicaError as e:
            raise Failure(503, f"no healthy worker: {e}", True, "no_worker") from None
        except RequestTooLargeError as e:
            raise Failure(400, str(e), False, "too_large") from None
        self._record_route(route, n_tokens)
        legs = _Legs()
        try:
            result = await self._forward(ctx, route, upstream_id, router_id, legs)
            legs.done = True
            return result
        except Failure as f:
            if 400 <= f.status < 500 and f.kind.startswith("http_") and hashes:  # an engine refused the request
                # SGLang PD: the prefill engine runs the prompt only after the decode's bootstrap
                # handshake (sglang/srt/disaggregation/prefill.py), which a refusing decode never
                # makes: both forget (vLLM PD: the prefill leg finished before the decode leg began)
                by_prefill = route.prefill is not None and (
                    f.where == route.prefill.engine or (self.cfg.pd_protocol == "sglang" and f.where == route.decode.engine))
                if by_prefill or f.where == route.decode.engine:  # its blocks are cached on neither
                    self.router.on_rejected(route, hashes, now, by_prefill=by_prefill)
            raise
        finally:
            self.router.on_finished(router_id, time.monotonic(), legs.output_tokens)
            if not legs.done:
                self._abort(legs)
            # a failed leg's task holds its exception, whose traceback holds the frames that hold
            # the task (and the body): cut those cycles so that the body is freed when the request
            # ends, not at the next full collection (issue 25 item 1)
            for t in legs.tasks:
                if t.done() and not t.cancelled() and (leg_exc := t.exception()) is not None:
                    leg_exc.__traceback__ = None
            legs.tasks.clear()
            legs.responses.clear()

    def _record_route(self, route: Route, n_tokens: int) -> None:
        m = self.metrics
        d = route.decode_choice
        m.count(m.decisions, route.decode.engine, "decode", self.router.decode_policy.name, d.reason if d else "")
        m.child(m.match_ratio, "decode").observe(min(1.0, route.decode_matched_tokens / n_tokens))
        if route.prefill is not None:
            p = route.prefill_choice
            m.count(m.decisions, route.prefill.engine, "prefill", self.router.prefill_policy.name, p.reason if p else "")
            m.child(m.match_ratio, "prefill").observe(min(1.0, route.prefill_matched_tokens / n_tokens))

    def _worker(self, url: str) -> Worker:
        w = self.pool.get(url)
        if w is None:  # removed through the admin API after routing
            raise Failure(503, "the worker chosen was removed", True, "removed", where=url)
        return w

    def _model_for(self, ctx: _Ctx, w: Worker, fields: dict[str, Any]) -> None:
        """Add ``model`` to a leg's ``fields`` when the request names the router's alias
        (``served_model_name``) and ``w`` serves another name (configured, else discovered): the
        engine gets the one name it accepts (transformers' server refuses any other, 400)."""
        engine_name = self._engine_name_for_alias(ctx, w)
        if engine_name is not None and ctx.body.get("model"):
            fields["model"] = engine_name

    def _engine_name_for_alias(self, ctx: _Ctx, w: Worker) -> str | None:
        """The name ``w`` serves the router's alias under, when the request names the alias (or no
        model: absent, ``null`` or ``""``, as vLLM's ``check_model`` reads ``not model_name``) and
        ``w`` does not serve the alias itself; else ``None``."""
        alias = self.cfg.served_model_name
        model = ctx.body.get("model")
        if alias is None or (model and model != alias):
            return None
        names = w.model_names()
        return names[0] if names and alias not in names else None

    def _model_swaps(self, ctx: _Ctx, d: Worker) -> tuple[tuple[bytes, bytes], ...]:
        """The answer's ``"model"`` value rewritten from ``d``'s own name back to the router's alias
        (S7): a client that named the alias (or no model) is answered under it, as vLLM answers under
        its first served name whatever the request named (0.33.0 ``OpenAIServingModels.model_name``:
        ``base_model_paths[0].name``) and SGLang under the name the request gave
        (``model=request.model``). Compact (pydantic, orjson) and spaced (``json.dumps``) JSON."""
        engine_name = self._engine_name_for_alias(ctx, d)
        if engine_name is None:
            return ()
        alias = self.cfg.served_model_name
        assert alias is not None
        new = json.dumps(alias).encode()
        return tuple((key + old, key + new) for key in (b'"model":', b'"model": ')
                     for old in {json.dumps(engine_name).encode(), json.dumps(engine_name, ensure_ascii=False).encode()})

    def _headers(self, upstream_id: str) -> dict[str, str]:
        return {"Content-Type": "application/json", "X-Request-Id": upstream_id}

    async def _forward(self, ctx: _Ctx, route: Route, upstream_id: str, router_id: str, legs: _Legs) -> web.StreamResponse:
        cfg = self.cfg
        d = self._worker(route.decode.engine)
        path = ctx.request.path
        headers = self._headers(upstream_id)
        if route.prefill is None or cfg.pd_protocol == "none":
            # the client's rid (if any) is replaced by the router's: never forwarded
            extra: dict[str, Any] = {"rid": upstream_id} if cfg.pd_protocol == "sglang" or "rid" in ctx.body else {}
            self._dp_rank(extra, headers, d, route.decode.dp_rank)
            self._model_for(ctx, d, extra)
            legs.started.append((d, upstream_id))
            deadline = self._first_byte_deadline(ctx.stream, ctx.max_out)
            d_resp = await self._open(d, path, encode_with(ctx.raw, ctx.body, extra), headers, legs, deadline,
                                      stream=ctx.stream, max_out=ctx.max_out)
            return await self._relay(ctx, d, d_resp, router_id, legs, deadline)
        p = self._worker(route.prefill.engine)
        if cfg.pd_protocol == "sglang":
            return await self._sglang(ctx, p, d, route, path, upstream_id, router_id, legs)
        return await self._vllm(ctx, p, d, route, path, upstream_id, router_id, legs)

    def _dp_rank(self, fields: dict[str, Any], headers: dict[str, str], w: Worker, rank: int) -> None:
        """Address DP rank ``rank`` of ``w`` (if it has several): a header for vLLM, else a body field
        (added to ``fields``)."""
        if w.cfg.dp_size > 1:
            if self.cfg.pd_protocol == "vllm":
                headers["X-data-parallel-rank"] = str(rank)
            else:
                fields["data_parallel_rank"] = rank

    async def _sglang(self, ctx: _Ctx, p: Worker, d: Worker, route: Route, path: str, upstream_id: str,
                      router_id: str, legs: _Legs) -> web.StreamResponse:
        assert route.prefill is not None
        common = {"bootstrap_host": p.host, "bootstrap_port": p.cfg.bootstrap_port,
                  "bootstrap_room": self._room_rng.getrandbits(63), "rid": upstream_id}
        p_extra, d_extra = dict(common), dict(common)
        p_headers, d_headers = self._headers(upstream_id), self._headers(upstream_id)
        self._dp_rank(p_extra, p_headers, p, route.prefill.dp_rank)
        self._dp_rank(d_extra, d_headers, d, route.decode.dp_rank)
        self._model_for(ctx, p, p_extra)
        self._model_for(ctx, d, d_extra)
        legs.started += [(p, upstream_id), (d, upstream_id)]
        d_deadline = self._first_byte_deadline(ctx.stream, ctx.max_out)
        p_data = encode_with(ctx.raw, ctx.body, p_extra)
        # the same bytes for both legs unless their DP ranks differ
        d_data = p_data if p_extra == d_extra else encode_with(ctx.raw, ctx.body, d_extra)
        loop = self._loop()
        p_task = loop.create_task(self._full(p, path, p_data, p_headers, legs, prefill=True))
        d_task = loop.create_task(self._open(d, path, d_data, d_headers, legs, d_deadline, stream=ctx.stream,
                                             max_out=ctx.max_out))
        legs.tasks += [p_task, d_task]
        p_seen = False  # the prefill leg's answer was read here
        while True:
            if not p_seen and p_task.done():
                p_seen = True
                # raises the prefill's Failure: the finally of _attempt aborts D
                legs.prefill_cached_tokens = cached_tokens_in(p_task.result())
                self.router.on_prefill_done(router_id, time.monotonic())
            if d_task.done():
                break
            await _first_done(loop, d_task, None if p_seen else p_task)
        if d_task.exception() is not None and not p_task.done():
            # D failed while P runs: a decode leg whose prefill failed fails too, often first; wait
            # briefly for P so that the failure is charged to the worker at fault
            await asyncio.wait({p_task}, timeout=PREFILL_BLAME_GRACE_S)
        if d_task.exception() is not None:
            if p_task.done():
                p_task.result()  # P failed too: raise its Failure (D not charged)
            # P still running PREFILL_BLAME_GRACE_S after its decode leg answered 502 (a decode
            # engine that could not get the KV from its prefill): the prefill is the one stalled,
            # charge it, not D. Other decode failures (503, timeouts, resets) are D's own.
            df = d_task.exception()
            assert df is not None
            if not (isinstance(df, Failure) and df.kind == "http_502"):
                raise df
            raise Failure(504, f"the prefill worker had not finished when the decode worker failed ({df.message})",
                          True, "prefill_stalled", worker=p, charge="now", where=f"prefill {p.url}, decode {d.url}")
        d_resp = d_task.result()
        legs.pd = True
        if not p_task.done():
            # D answered before P: if P fails now, close D so that the relay fails (and retries
            # if nothing reached the client yet), charging P, not D.
            def _watch(t: asyncio.Task) -> None:
                if t.cancelled() or t.exception() is not None:
                    legs.prefill_failure = None if t.cancelled() else t.exception()
                    d_resp.close()
                else:
                    legs.prefill_cached_tokens = cached_tokens_in(t.result())
                    self.router.on_prefill_done(router_id, time.monotonic())
            p_task.add_done_callback(_watch)
        return await self._relay(ctx, d, d_resp, router_id, legs, d_deadline)

    async def _vllm(self, ctx: _Ctx, p: Worker, d: Worker, route: Route, path: str, upstream_id: str,
                    router_id: str, legs: _Legs) -> web.StreamResponse:
        assert route.prefill is not None
        p_body = dict(ctx.body)
        p_body.pop("stream_options", None)
        p_body.update(stream=False, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        if "rid" in p_body:  # the client's rid is never forwarded
            p_body["rid"] = upstream_id
        p_headers = self._headers(upstream_id)
        p_extra: dict[str, Any] = {}
        self._dp_rank(p_extra, p_headers, p, route.prefill.dp_rank)
        self._model_for(ctx, p, p_extra)
        p_body.update(p_extra)
        legs.started.append((p, upstream_id))
        data = await self._full(p, path, encode_body(p_body, ctx.raw), p_headers, legs, prefill=True)
        try:
            kv = json.loads(data)["kv_transfer_params"]
            if not isinstance(kv, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            raise Failure(502, "the prefill worker answered without kv_transfer_params", True, "bad_response",
                          worker=p, charge="now") from None
        self.router.on_prefill_done(router_id, time.monotonic())
        legs.pd, legs.prefill_cached_tokens = True, cached_tokens_in(data)
        d_extra: dict[str, Any] = {"kv_transfer_params": kv}
        if "rid" in ctx.body:
            d_extra["rid"] = upstream_id
        d_headers = self._headers(upstream_id)
        self._dp_rank(d_extra, d_headers, d, route.decode.dp_rank)
        self._model_for(ctx, d, d_extra)
        legs.started.append((d, upstream_id))
        deadline = self._first_byte_deadline(ctx.stream, ctx.max_out)
        d_resp = await self._open(d, path, encode_with(ctx.raw, ctx.body, d_extra), d_headers, legs, deadline,
                                  stream=ctx.stream, max_out=ctx.max_out)
        return await self._relay(ctx, d, d_resp, router_id, legs, deadline)

    # ------------------------------------------------------------------ upstream I/O
    @staticmethod
    def _waiting(w: Worker, waiting: bool) -> None:
        """Mark a leg on ``w`` as waiting for its first byte (or no longer)."""
        faults = _FAULTS.get()
        if faults is not None:
            if waiting:
                faults.waiting[w.url] = w
            else:
                faults.waiting.pop(w.url, None)

    def _failed(self, w: Worker, kind: str, charge: bool = True, unreachable: str | None = None) -> None:
        """Count a failure of ``w`` in the metrics, keep the current request's retries off it and,
        with ``charge``, count it against its circuit breaker (at most once per client request);
        ``unreachable`` (why no connection could be opened) also marks it unreachable
        (:meth:`WorkerPool.record_connect_failure`)."""
        faults = _FAULTS.get()
        if faults is not None:
            faults.failed.add(w.url)
        self.metrics.child(self.metrics.upstream_failures, w.url, kind).inc()
        if unreachable is not None and self.pool.get(w.url) is w:
            self.pool.record_connect_failure(w, time.monotonic(), unreachable)
        if charge:
            self._charge(w)

    def _charge(self, w: Worker) -> None:
        """One failure of the current client request against ``w``'s breaker (once per request)."""
        faults = _FAULTS.get()
        if faults is not None:
            if w.url in faults.charged:
                return
            faults.charged.add(w.url)
        if self.pool.get(w.url) is w:  # not removed meanwhile
            self.pool.record_result(w, False, time.monotonic())

    def _first_byte_timeout(self, stream: bool = False, max_out: int | None = None) -> tuple[str, float] | None:
        """``(setting, seconds)`` bounding a leg's first byte: ``first_byte_timeout_s``, else for a
        streamed decode leg ``stream_first_chunk_timeout_s``, else for a non-streamed decode leg
        asking for ``max_out`` output tokens ``nonstream_timeout_s + max_out *
        nonstream_timeout_per_token_s`` (its whole answer); ``None``: unbounded."""
        cfg = self.cfg
        if cfg.first_byte_timeout_s is not None:
            return "first_byte_timeout_s", cfg.first_byte_timeout_s
        if stream:
            if cfg.stream_first_chunk_timeout_s is not None:
                return "stream_first_chunk_timeout_s", cfg.stream_first_chunk_timeout_s
        elif max_out is not None and cfg.nonstream_timeout_s is not None:
            return ("nonstream_timeout_s + max_tokens * nonstream_timeout_per_token_s",
                    cfg.nonstream_timeout_s + max_out * cfg.nonstream_timeout_per_token_s)
        return None

    def _first_byte_deadline(self, stream: bool = False, max_out: int | None = None) -> float | None:
        """Event-loop time by which a leg sent now must answer, or ``None`` (no first-byte timeout)."""
        t = self._first_byte_timeout(stream, max_out)
        return None if t is None else self._loop().time() + t[1]

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this proxy serves on (its deadline queues' loop, the first one that ran
        a request): looked up once, not per request (on Python 3.11 each lookup of the running
        loop is a ``getpid()`` system call)."""
        return self._request_deadlines._running_loop()

    def deadlines_waiting(self) -> int:
        """Deadline blocks (request, first byte, prefill) now open in this proxy's queues: 0 when no
        request is in flight (every block left its queue, whatever way it ended)."""
        return (len(self._request_deadlines) + len(self._prefill_deadlines) + len(self._first_byte_overflow)
                + sum(len(q) for q in self._first_byte_deadlines.values()))

    def _first_byte_queue(self, stream: bool, max_out: int | None) -> DeadlineQueue:
        """The deadline queue of a leg's first byte: one per ``(stream, max_out)``, whose deadlines
        all have one length (so they queue in arrival order); when :data:`FIRST_BYTE_QUEUES` are in
        use, the idle ones are dropped, and if none is idle the leg uses the shared overflow queue
        (correct in any order, a timer per out-of-order deadline)."""
        key = (stream, max_out)
        queues = self._first_byte_deadlines
        q = queues.get(key)
        if q is None:
            if len(queues) >= FIRST_BYTE_QUEUES:
                for k in [k for k, v in queues.items() if not len(v)]:
                    del queues[k]
                if len(queues) >= FIRST_BYTE_QUEUES:
                    return self._first_byte_overflow
            q = queues[key] = DeadlineQueue()
        return q

    def _first_byte_failure(self, w: Worker, stream: bool = False, max_out: int | None = None) -> Failure:
        name, t = self._first_byte_timeout(stream, max_out) or ("first_byte_timeout_s", float("nan"))
        return Failure(504, f"{_who(w)} sent no response within {name}={t:g} s", True, "first_byte_timeout",
                       worker=w, charge="now")

    async def _open(self, w: Worker, path: str, body: dict[str, Any] | bytes, headers: dict[str, str],
                    legs: _Legs, deadline: float | None | bool = True, stream: bool = False,
                    max_out: int | None = None) -> LegResponse:
        """POST ``body`` (a JSON object, or its encoding) and wait for the response headers (until
        ``deadline``, event-loop time; ``True``: ``first_byte_timeout_s`` from now; ``None``: no
        deadline); non-2xx answers and a missed deadline become :class:`Failure` (naming ``w``;
        the caller charges it)."""
        if deadline is True:
            deadline = self._first_byte_deadline()
        data = body if isinstance(body, bytes) else encode_body(body, None)
        # the lean client speaks plain HTTP: https workers use the aiohttp session
        client = self.client if w.url[4] == ":" else self.session
        self._waiting(w, True)  # until its first byte (cleared on an answer or a failure, kept if cancelled)
        try:
            if deadline is None:
                resp = await client.post(w.endpoint(path), data=data, headers=headers)
            else:
                # the request timeout of handle() is an outer deadline block: its expiry passes
                # through this one as a cancellation, so TimeoutError here is the first-byte deadline
                async with self._first_byte_queue(stream, max_out).at(deadline):
                    resp = await client.post(w.endpoint(path), data=data, headers=headers)
        except TimeoutError:
            self._waiting(w, False)
            raise self._first_byte_failure(w, stream, max_out) from None
        except (aiohttp.ClientError, OSError) as e:
            self._waiting(w, False)
            f = Failure(502, f"{_who(w)} is unreachable ({type(e).__name__})", True, "connect",
                        worker=w, charge="now")
            # no connection could be opened (not a pooled connection closed under the request)
            f.unreachable = isinstance(e, _CONNECT_ERRORS)
            raise f from None
        if not stream or resp.status >= 400:  # a streamed decode leg waits for its first chunk (_relay)
            self._waiting(w, False)
        legs.responses.append(resp)
        if resp.status >= 400:
            try:
                data = await resp.read()
            except (aiohttp.ClientError, OSError):
                data = b""
            finally:
                resp.release()
            retryable = resp.status in self.cfg.retry.retry_statuses
            # 500 is what an engine answers when the request broke it: charged only once the same
            # request succeeded elsewhere (see the module docstring); other retryable statuses are
            # the worker's (overload, gateway errors); the remaining 4xx are the request's
            charge = ("deferred" if resp.status == 500 else "now") if retryable else "no"
            raise Failure(resp.status, f"{_who(w)} answered {resp.status}", retryable, f"http_{resp.status}",
                          data, resp.content_type, worker=w if charge != "no" else None, charge=charge, where=w.url)
        return resp

    async def _full(self, w: Worker, path: str, body: dict[str, Any] | bytes, headers: dict[str, str],
                    legs: _Legs, prefill: bool = False) -> bytes:
        """The whole answer of one leg; a prefill leg (``prefill``) must have it within
        ``prefill_timeout_s`` (kind ``prefill_timeout``) as well as its headers within
        ``first_byte_timeout_s``."""
        t = self.cfg.prefill_timeout_s if prefill else None
        if t is None:
            resp = await self._open(w, path, body, headers, legs)
            data = await self._read_all(w, resp)
        else:
            try:
                async with self._prefill_deadlines.after(t):  # inside handle()'s request timeout (see _open)
                    resp = await self._open(w, path, body, headers, legs)
                    data = await self._read_all(w, resp)
            except TimeoutError:
                raise Failure(504, f"{_who(w)} did not answer within prefill_timeout_s={t:g} s",
                              True, "prefill_timeout", worker=w, charge="now") from None
        self.pool.record_result(w, True, time.monotonic())
        return data

    async def _read_all(self, w: Worker, resp: LegResponse) -> bytes:
        """The whole body of ``resp``; a failure mid-body counts against ``w`` and is retryable."""
        try:
            return await resp.read()
        except (aiohttp.ClientError, OSError) as e:
            raise Failure(502, f"{_who(w)} failed mid-response ({type(e).__name__})", True, "read",
                          worker=w, charge="now") from None
        finally:
            resp.release()

    def _blame(self, legs: _Legs, failure: Failure) -> Failure:
        """The prefill leg's failure instead of ``failure`` when the prefill leg failed (the decode
        leg was closed because of it)."""
        pf = legs.prefill_failure
        return pf if isinstance(pf, Failure) else failure

    def _rewriter(self, ctx: _Ctx, d: Worker, d_resp: LegResponse) -> tuple[tuple[bytes, bytes], ...] | None:
        """``((old, new), ...)`` byte replacements of the relayed body, if it needs any and is not
        compressed: ``(upstream id, client's id)`` as they appear in a JSON body when they differ,
        and the engine's model name back to the router's alias (:meth:`_model_swaps`)."""
        if "Content-Encoding" in d_resp.headers:
            return None
        swaps = self._model_swaps(ctx, d) if self.cfg.served_model_name is not None else ()
        if ctx.upstream_id != ctx.visible_id:
            swaps += ((ctx.upstream_id.encode(), json.dumps(ctx.visible_id)[1:-1].encode()),)
        return swaps or None

    async def _relay(self, ctx: _Ctx, d: Worker, d_resp: LegResponse, router_id: str,
                     legs: _Legs, deadline: float | None = None) -> web.StreamResponse:
        """Send the decode leg's answer to the client (chunk by chunk when streaming), with the
        upstream request id replaced by the client's."""
        swap = self._rewriter(ctx, d, d_resp)
        if not ctx.stream:
            try:
                if deadline is None or (type(d_resp) is UpstreamResponse and d_resp.arrived()):
                    # no deadline, or the whole answer is here (most short answers): no timer to set
                    data = await self._read_all(d, d_resp)
                else:  # the answer in full, not only its headers, by the deadline
                    async with asyncio.timeout_at(deadline):
                        data = await self._read_all(d, d_resp)
            except TimeoutError:
                raise self._blame(legs, self._first_byte_failure(d, ctx.stream, ctx.max_out)) from None
            except Failure as f:
                raise self._blame(legs, f) from None
            self.router.on_first_token(router_id, time.monotonic())
            self.pool.record_result(d, True, time.monotonic())
            if self.router.cost_learner is not None:  # the only reader of the count
                legs.output_tokens = completion_tokens_in(data)
            if swap is not None:
                for pair in swap:
                    data = data.replace(*pair)
            if legs.prefill_cached_tokens is not None and d_resp.status == 200:
                data = with_cached_tokens(data, legs.prefill_cached_tokens, sse=False)
            headers = _relayed_headers(d_resp, "application/json")
            headers["X-Request-Id"] = ctx.visible_id
            return web.Response(status=d_resp.status, body=data, headers=headers)
        it = d_resp.content.iter_any()
        try:
            if deadline is None:
                first = await it.__anext__()
            else:
                async with asyncio.timeout_at(deadline):
                    first = await it.__anext__()
        except StopAsyncIteration:
            first = b""
        except TimeoutError:
            self._waiting(d, False)
            raise self._blame(legs, self._first_byte_failure(d, ctx.stream, ctx.max_out)) from None
        except (aiohttp.ClientError, OSError) as e:
            self._waiting(d, False)
            raise self._blame(legs, Failure(502, f"{_who(d)} failed before its first byte ({type(e).__name__})",
                                            True, "read", worker=d, charge="now")) from None
        self._waiting(d, False)
        meter = StreamMeter()
        if meter.feed(first):
            self._first_token(ctx, router_id)
        headers = _relayed_headers(d_resp, "text/event-stream")
        headers["Cache-Control"] = "no-cache"
        headers["X-Request-Id"] = ctx.visible_id
        if type(ctx.request) is LeanRequest:  # the lean front: the head is written at once
            resp = ctx.resp = ctx.request.open_stream(d_resp.status, headers)
        else:
            resp = web.StreamResponse(status=d_resp.status, headers=headers)
            ctx.resp = resp
            await resp.prepare(ctx.request)
        # with id swapping or PD usage rewriting, chunks are relayed by whole lines (SSE events end
        # in newlines): the incomplete last line is held back (_SwapLines: linear cost, bounded)
        lines = _SwapLines(lambda data: self._rewrite(data, swap, legs)) if swap is not None or legs.pd else None
        try:
            if lines is not None:
                first = lines.feed(first)
            if first:
                await resp.write(first)
            while True:
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientError, OSError) as e:
                    failed = self._blame(legs, Failure(502, "", True, "mid_stream", worker=d, charge="now"))
                    if failed.worker is not None:
                        self._failed(failed.worker, "mid_stream")
                    if lines is not None and (rest := lines.rest()):
                        await resp.write(rest)
                    await self._stream_error(ctx, 502, f"{_who(d)} failed mid-stream ({type(e).__name__})", where=d.url)
                    self._abort(legs)
                    legs.done = True
                    return resp
                if meter.feed(chunk):
                    self._first_token(ctx, router_id)
                if lines is not None:
                    chunk = lines.feed(chunk)
                if chunk:
                    await resp.write(chunk)
        except _LineTooLong:
            self._failed(d, "sse_line_too_long")
            await self._stream_error(ctx, 502, f"{_who(d)} sent an SSE line over {MAX_SSE_LINE_BYTES} bytes",
                                     where=d.url)
            self._abort(legs)
            legs.done = True
            return resp
        if self.router.cost_learner is not None:  # the only reader of the count
            legs.output_tokens = meter.output_tokens()
        d_resp.release()
        if lines is not None and (rest := lines.rest()):
            await resp.write(rest)
        await resp.write_eof()
        self.pool.record_result(d, True, time.monotonic())
        return resp

    def _first_token(self, ctx: _Ctx, router_id: str) -> None:
        """The decode leg's first event with generated content arrived (streaming): TTFT metric and
        ``Router.on_first_token``, now."""
        now = time.monotonic()
        self.metrics.child(self.metrics.ttft, ctx.endpoint).observe(now - ctx.t0)
        self.router.on_first_token(router_id, now)

    @staticmethod
    def _rewrite(data: bytes, swap: tuple[tuple[bytes, bytes], ...] | None, legs: _Legs) -> bytes:
        """Whole SSE lines as the client gets them: the id (and model alias) swapped, and in PD the
        prefill leg's ``cached_tokens`` in the usage."""
        if swap is not None:
            for pair in swap:
                data = data.replace(*pair)
        if legs.prefill_cached_tokens is not None and b'"usage"' in data:
            data = with_cached_tokens(data, legs.prefill_cached_tokens, sse=True)
        return data

    async def _stream_error(self, ctx: _Ctx, status: int, message: str, etype: str = "server_error",
                            where: str = "") -> None:
        """End a started stream with an SSE error event and then ``data: [DONE]``, as SGLang's own
        servers do (0.5.23 ``serving_chat.py``: ``except ValueError`` yields the error event, then
        ``[DONE]``; ``http_server.py`` ``stream_results`` the same for ``/generate``), so a client
        that reads until ``[DONE]`` stops there (``message``: names no URL; ``where``: the workers'
        URLs, logged, :meth:`_log_failure`); the request counts with ``status`` (not 200) in
        ``pdlb_requests_total``."""
        resp = ctx.resp
        assert resp is not None
        ctx.request[STREAM_STATUS] = status
        self._log_failure(ctx.visible_id, status, "mid_stream", message, where)
        err = {"error": {"message": message, "type": etype, "code": status}}
        try:
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    # ------------------------------------------------------------------ aborts
    def _abort(self, legs: _Legs) -> None:
        """Abort every started leg: cancel pending POSTs, close open responses (vLLM aborts on
        disconnect) and send SGLang's ``/abort_request`` (best effort, in the background) to the
        engines that have it (:attr:`Worker.caps`)."""
        for t in legs.tasks:
            if not t.done():
                t.cancel()
            else:
                t.exception() if not t.cancelled() else None  # mark retrieved
        for r in legs.responses:
            r.close()
        if self.cfg.pd_protocol == "vllm":
            return
        for w, rid in legs.started:
            # only engines that have the endpoint (SGLang); before the probe answered, as configured
            # (an SGLang PD router's engines are SGLang)
            if w.caps.abort_endpoint is None and (w.caps.probed or self.cfg.pd_protocol != "sglang"):
                continue
            t = asyncio.create_task(self._post_abort(w, rid))
            self.background.add(t)
            t.add_done_callback(self.background.discard)

    async def _post_abort(self, w: Worker, rid: str) -> None:
        try:
            async with self.session.post(w.endpoint("/abort_request"), json={"rid": rid},
                                         timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                await r.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass
