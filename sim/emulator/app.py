"""The emulated engine's HTTP server: SGLang- and vLLM-shaped endpoints over :class:`EngineCore`.

Endpoints (the shapes of SGLang's and vLLM's OpenAI servers, trimmed to what routers use):

* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /generate`` (SGLang native):
  JSON or SSE (``stream: true``), one SSE event per generated token, ``data: [DONE]`` at the end
  (``stream_format: transformers``: a role-only chat chunk before prefill and no ``[DONE]``).
  Output length is exactly ``max_tokens`` / ``max_completion_tokens`` /
  ``sampling_params.max_new_tokens`` (as with ``ignore_eos``).
* A request whose prompt + output limit exceeds ``max_model_len`` (reported by ``/v1/models``)
  is answered HTTP 400 with an OpenAI-style JSON error before anything runs, as vLLM does. So are
  what the emulator does not emulate (``n`` or ``best_of`` above 1, batched prompts) and malformed
  PD fields (``data_parallel_rank`` / ``X-data-parallel-rank`` not a rank of this engine,
  ``bootstrap_room`` not an integer >= 0).
* ``GET /health``, ``/health_generate``, ``/v1/models``, ``/server_info`` (``/get_server_info``),
  ``/model_info`` (``/get_model_info``): what SGLang's router probes (ANCHORS.md).
* ``POST /abort_request`` ``{"rid": ...}``: abort a request (SGLang); closing the connection
  aborts too (vLLM).
* ``GET /metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (0..1) and ``pdlb_emulator_*`` counters.
* ``GET /bootstrap/{room}``: the prefill side of the SGLang KV handshake (long poll: answers when
  the prefill leg with that ``bootstrap_room`` has finished; 410 if it failed, 504 on timeout).
* ``GET /emulator/stats``, ``GET /emulator/requests``, ``POST /emulator/faults``: test hooks.

PD protocols (ANCHORS.md, "PD request flows"):

* **SGLang**: a body with ``bootstrap_room`` is a PD leg. The prefill engine prefills and marks the
  room ready; the decode engine long-polls ``http://{bootstrap_host}:{bootstrap_port}/bootstrap/{room}``,
  waits the KV transfer time, then decodes. ``data_parallel_rank`` picks the DP rank.
* **vLLM**: a prefill engine given ``kv_transfer_params.do_remote_decode`` answers with
  ``kv_transfer_params = {do_remote_prefill: true, remote_engine_id, remote_block_ids,
  remote_host, remote_port, ...}``; a decode engine given ``do_remote_prefill`` waits the transfer
  time and decodes. ``X-Request-Id`` is the request id; ``X-data-parallel-rank`` picks the rank.

A decode engine given neither serves the request alone (conditional disaggregation).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
import uuid
from collections import OrderedDict, deque
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from balancer.hashing import hash_token_blocks, text_chunk_hashes
from balancer.service.prompt import PromptError, extract_prompt, lax_bool, max_output_tokens
from balancer.validation import format_validation_error
from sim.emulator.config import MAX_BOOTSTRAP_WAIT_S, EmulatorConfig, FaultConfig
from sim.emulator.engine import EngineCore
from sim.emulator.kv_events import KvEventPublisher

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
STATE: web.AppKey["EmulatorState"] = web.AppKey("emulator_state", object)  # type: ignore[arg-type]


def _err(status: int, message: str, etype: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": etype, "code": status}}, status=status)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _one_completion(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why the emulator cannot answer ``body`` as asked, or ``None``: it generates one completion
    of one prompt per request, so ``n`` / ``best_of`` above 1 (``sampling_params.n`` on SGLang's
    ``/generate``) and batched prompts (a ``prompt`` array of several strings or token-id arrays)
    get HTTP 400 instead of an answer with fewer choices than asked for (``/generate``'s ``text``
    / ``input_ids`` batches fail :func:`~balancer.service.prompt.extract_prompt` already)."""
    sp = body.get("sampling_params") if endpoint == "generate" else body
    for key in ("n", "best_of"):
        v = sp.get(key) if isinstance(sp, dict) else None
        if v is not None and v != 1:
            return f"'{key}' must be 1: pdlb engine emulates one completion per request, got {v!r}"
    v = body.get("prompt") if endpoint == "completions" else None  # /generate's batches fail extract_prompt
    if isinstance(v, list) and len(v) > 1 and (all(isinstance(x, str) for x in v) or all(isinstance(x, list) for x in v)):
        return f"batched prompts are not emulated ({len(v)} prompts in 'prompt'): send one request per prompt"
    return None


def _pd_leg_fields(body: dict[str, Any], dp_header: str | None, dp_ranks: int) -> tuple[int | None, int | None]:
    """``(data_parallel_rank, bootstrap_room)`` of a request: the body's ``data_parallel_rank``
    (else the ``X-data-parallel-rank`` header) as a rank ``0 .. dp_ranks - 1``, and SGLang's
    ``bootstrap_room`` as an integer >= 0; ``None`` where absent.

    Raises:
        ValueError: a value of the wrong type or out of range (the caller answers 400), naming
            the field, instead of a 500 or a request silently served on another rank.
    """
    dp = body.get("data_parallel_rank")
    if dp is None and dp_header is not None:
        try:
            dp = int(dp_header.strip())
        except ValueError:
            raise ValueError(f"header X-data-parallel-rank must be an integer, got {dp_header!r}") from None
    if dp is not None and not (_is_int(dp) and 0 <= dp < dp_ranks):
        raise ValueError(f"data_parallel_rank must be an integer 0..{dp_ranks - 1} (this engine has {dp_ranks} "
                         f"DP rank{'s' if dp_ranks != 1 else ''}), got {dp!r}")
    room = body.get("bootstrap_room")
    if room is not None and not (_is_int(room) and room >= 0):
        raise ValueError(f"bootstrap_room must be an integer >= 0, got {room!r}")
    return dp, room


class _Room:
    __slots__ = ("event", "ok", "prompt_tokens", "created_s")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.ok = False
        self.prompt_tokens = 0
        self.created_s = time.monotonic()


class EmulatorState:
    """Everything one emulated engine holds (the core, PD rooms, stats, faults)."""

    def __init__(self, cfg: EmulatorConfig, exit_on_die: bool) -> None:
        self.cfg = cfg
        self.exit_on_die = exit_on_die
        self.faults: FaultConfig = cfg.faults
        self.rng = random.Random(cfg.faults.seed)
        self.core: EngineCore | None = None
        self.kv_bytes_per_token = 0
        if not cfg.zero_delay:
            from sim.models.hardware import get_hardware
            from sim.models.presets import get_model
            from sim.perf.roofline import RooflinePerf

            perf = RooflinePerf.for_engine(get_model(cfg.model), get_hardware(cfg.hardware),
                                           num_dp_ranks=cfg.dp_ranks, gpus_per_rank=cfg.gpus_per_rank,
                                           ep_synchronous=cfg.ep)
            self.kv_bytes_per_token = perf.kv_bytes_per_token
            self.core = EngineCore(perf, cfg.role, dp_ranks=cfg.dp_ranks, block_size=cfg.block_size,
                                   max_prefill_tokens=cfg.max_prefill_tokens, max_decode_batch=cfg.max_decode_batch,
                                   kv_capacity_tokens=cfg.kv_capacity_tokens, speed=cfg.speed, name=cfg.engine_id or "engine")
        self.kv_events: KvEventPublisher | None = None
        if cfg.kv_events_endpoint is not None and self.core is not None:
            self.kv_events = KvEventPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.dp_ranks,
                                              cfg.block_size)
            for rank in self.core.ranks:
                rank.kv_listener = self.kv_events.on_change
        self.rooms: OrderedDict[int, _Room] = OrderedDict()  # creation order (expiry pops the front)
        self.tasks: dict[str, asyncio.Task] = {}  # rid -> handler task (abort_request cancels it)
        self.log: deque[dict[str, Any]] = deque(maxlen=5000)
        self.counts = {"received": 0, "ok": 0, "aborted": 0, "error": 0, "injected_error": 0}
        self.tokens_streamed = 0
        self.dead = False
        self.session: aiohttp.ClientSession | None = None
        self.port = 0
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.g_running = Gauge("vllm:num_requests_running", "Requests in prefill or decode", labels, registry=self.registry)
        self.g_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for admission", labels, registry=self.registry)
        self.g_kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1", labels, registry=self.registry)
        self.c_requests = Counter("pdlb_emulator_requests", "Generation requests by outcome", ["outcome"], registry=self.registry)
        self.running_simple = 0  # zero-delay mode's in-flight count

    # ------------------------------------------------------------------ rooms (SGLang bootstrap)
    def room(self, room: int) -> _Room:
        """The room ``room`` (created on first use by either leg). A room is dropped when the decode
        leg's bootstrap poll returns; rooms never polled (a decode leg that never came) expire
        after 4 bootstrap timeouts. Amortised O(1): rooms are kept in creation order."""
        r = self.rooms.get(room)
        if r is None:
            cutoff = time.monotonic() - 4 * self.cfg.bootstrap_timeout_s
            rooms = self.rooms
            while rooms:
                oldest = next(iter(rooms.values()))
                if oldest.created_s >= cutoff:
                    break
                rooms.popitem(last=False)
            r = rooms[room] = _Room()
        return r

    def transfer_delay_s(self, prompt_tokens: int, block_hashes: tuple[int, ...] = (),
                         dp_rank: int | None = None) -> float:
        """Real seconds a decode leg waits for the KV of its prompt (0 in zero-delay mode).

        As the simulator (:mod:`sim.run.cluster`, "KV transfer"): only the prompt blocks the decode
        rank's prefix cache does not hold move, ``(latency + (prompt_tokens - min(held_blocks *
        block_size, prompt_tokens)) * kv_bytes_per_token / bandwidth) / speed``. The rank is
        ``dp_rank``, or the only rank; with several ranks and no ``dp_rank`` nothing is held.
        """
        if self.core is None:
            return 0.0
        c = self.cfg
        held = self.core.held_tokens(block_hashes, dp_rank) if block_hashes else 0
        moved = prompt_tokens - min(held, prompt_tokens)
        return (c.kv_transfer_latency_s + moved * self.kv_bytes_per_token / c.kv_transfer_bandwidth_bytes_per_s) / c.speed

    def count_tokens(self, k: int) -> None:
        self.tokens_streamed += k
        n = self.faults.die_after_tokens
        if n is not None and self.tokens_streamed >= n:
            self.die()

    def die(self) -> None:
        """Fault: vanish. Exits the process (CLI) or drops every connection (in-process)."""
        if self.exit_on_die:
            os._exit(17)
        self.dead = True
        for t in list(self.tasks.values()):
            t.cancel()


# ---------------------------------------------------------------------- response bodies
def _token_text(i: int) -> str:
    return f" t{i}"


def _now_s() -> int:
    return int(time.time())


class _Shape:
    """Builds one endpoint's response objects (OpenAI completions / chat, SGLang generate)."""

    def __init__(self, endpoint: str, rid: str, model: str, prompt_tokens: int) -> None:
        self.endpoint, self.rid, self.model, self.prompt_tokens = endpoint, rid, model, prompt_tokens
        self.created = _now_s()
        self.text = ""
        self.n = 0

    def usage(self, cached: int = 0) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.n,
                "total_tokens": self.prompt_tokens + self.n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def add(self, k: int) -> str:
        piece = "".join(_token_text(self.n + j) for j in range(k))
        self.n += k
        self.text += piece
        return piece

    def chunk(self, piece: str, finish: str | None, first: bool) -> dict[str, Any]:
        if self.endpoint == "generate":
            return {"text": self.text, "meta_info": self._meta(finish)}
        if self.endpoint == "chat":
            delta: dict[str, Any] = {"content": piece}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def _meta(self, finish: str | None) -> dict[str, Any]:
        fr = None if finish is None else ({"type": "length", "length": self.n} if finish == "length" else {"type": finish})
        return {"id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": self.n, "finish_reason": fr}

    def final(self, finish: str, cached: int) -> dict[str, Any]:
        if self.endpoint == "generate":
            return {"text": self.text, "meta_info": self._meta(finish)}
        if self.endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "finish_reason": finish,
                      "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(cached)}


# ---------------------------------------------------------------------- handlers
async def _generate(request: web.Request, endpoint: str) -> web.StreamResponse:
    st = request.app[STATE]
    cfg = st.cfg
    if st.dead:
        request.transport.close() if request.transport else None
        raise web.HTTPServiceUnavailable()
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
    except (ValueError, json.JSONDecodeError) as e:
        return _err(400, f"invalid JSON body: {e}")
    st.counts["received"] += 1
    if not st.port:
        st.port = request.url.port or 0
    if st.faults.error_rate > 0 and st.rng.random() < st.faults.error_rate:
        st.counts["injected_error"] += 1
        st.c_requests.labels("injected_error").inc()
        if cfg.role == "prefill" and body.get("bootstrap_room") is not None:
            try:
                st.room(int(body["bootstrap_room"])).event.set()  # the waiting decode leg fails fast
            except (TypeError, ValueError):
                pass
        return _err(st.faults.error_status, "injected fault", "server_error")
    try:
        prompt = extract_prompt(endpoint, body)
        out_tokens = max_output_tokens(endpoint, body, cfg.default_max_tokens)
        dp_rank, room = _pd_leg_fields(body, request.headers.get("X-data-parallel-rank"), cfg.dp_ranks)
        stream = bool(lax_bool(body.get("stream"), "stream"))  # "no" is false to vLLM and SGLang, as here
    except (PromptError, ValueError) as e:
        return _err(400, str(e))
    unsupported = _one_completion(endpoint, body)
    if unsupported is not None:
        return _err(400, unsupported)
    if prompt.token_ids is not None:
        prompt_tokens = len(prompt.token_ids)
        hashes = tuple(hash_token_blocks(prompt.token_ids, cfg.block_size))
        if st.kv_events is not None:
            st.kv_events.register(hashes, prompt.token_ids)
    else:
        text = prompt.text or ""
        prompt_tokens = max(1, math.ceil(len(text) / cfg.chars_per_token))
        hashes = tuple(text_chunk_hashes(text, max(1, round(cfg.block_size * cfg.chars_per_token))))
    if prompt_tokens + out_tokens > cfg.max_model_len:  # as vLLM: 400 before anything runs
        st.counts["error"] += 1
        st.c_requests.labels("error").inc()
        return _err(400, f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                         f"requested {prompt_tokens + out_tokens} tokens ({prompt_tokens} in the messages, "
                         f"{out_tokens} in the completion). Please reduce the length of the messages or completion.")
    rid = str(body.get("rid") or request.headers.get("X-Request-Id") or uuid.uuid4().hex)
    kv_in = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else None
    if cfg.role == "prefill":
        mode = "prefill"
    elif cfg.role == "decode" and (room is not None or (kv_in and kv_in.get("do_remote_prefill"))):
        mode = "remote"
    else:
        mode = "local"
    entry = {"rid": rid, "endpoint": endpoint, "mode": mode, "stream": stream, "bootstrap_room": room,
             "bootstrap_host": body.get("bootstrap_host"), "bootstrap_port": body.get("bootstrap_port"),
             "kv_transfer_params": kv_in, "x_request_id": request.headers.get("X-Request-Id"),
             "data_parallel_rank": dp_rank, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
             "cached_tokens": 0, "status": "running", "arrival_s": time.monotonic()}
    st.log.append(entry)
    if rid in st.tasks:
        st.counts["error"] += 1
        entry["status"] = "error"
        return _err(400, f"request id {rid!r} is already running")
    task = asyncio.current_task()
    assert task is not None
    st.tasks[rid] = task
    shape = _Shape(endpoint, rid, body.get("model") or cfg.served_model_name, prompt_tokens)
    handle = None
    try:
        if st.faults.hang:
            await asyncio.Event().wait()
        if mode == "remote":
            if room is not None:
                err = await _await_bootstrap(st, body, room)
                if err is not None:
                    entry["status"] = "error"
                    st.counts["error"] += 1
                    return _err(502, err, "server_error")
            delay = st.transfer_delay_s(prompt_tokens, hashes, dp_rank)
            if delay > 0:
                await asyncio.sleep(delay)
        if st.core is not None:
            handle = st.core.submit(rid, prompt_tokens, out_tokens, hashes, mode, dp_rank)
            events = handle.events
        else:
            events = asyncio.Queue()
            n = 1 if mode == "prefill" else out_tokens
            for _ in range(n):
                events.put_nowait(("token", 1))
            events.put_nowait(("done", "length"))
        def prefill_done() -> None:  # KV ready: release the waiting decode leg before answering
            if room is not None and mode == "prefill":
                r = st.room(room)
                r.ok, r.prompt_tokens = True, prompt_tokens
                r.event.set()

        resp = await _respond(request, st, shape, events, stream, handle, entry, mode, kv_in, prefill_done)
        entry["status"] = "ok"
        st.counts["ok"] += 1
        st.c_requests.labels("ok").inc()
        return resp
    except asyncio.CancelledError:
        entry["status"] = "aborted"
        st.counts["aborted"] += 1
        st.c_requests.labels("aborted").inc()
        raise
    finally:
        if entry["status"] not in ("ok",):
            if st.core is not None:
                st.core.abort(rid)
            if room is not None and mode == "prefill":
                r = st.room(room)
                r.event.set()  # ok stays False: the decode leg learns the prefill failed
        if st.tasks.get(rid) is task:
            del st.tasks[rid]


async def _await_bootstrap(st: EmulatorState, body: dict[str, Any], room: int) -> str | None:
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if not host or not port:
        return "bootstrap_host and bootstrap_port are required for a PD decode leg"
    url = f"http://{host}:{port}/bootstrap/{room}"
    assert st.session is not None
    try:
        async with st.session.get(url, params={"timeout_s": str(st.cfg.bootstrap_timeout_s)},
                                  timeout=aiohttp.ClientTimeout(total=st.cfg.bootstrap_timeout_s + 5)) as r:
            if r.status == 200:
                return None
            return f"prefill for bootstrap room {room} failed (bootstrap answered {r.status})"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"bootstrap server {host}:{port} unreachable: {type(e).__name__}"


async def _respond(request: web.Request, st: EmulatorState, shape: _Shape, events: asyncio.Queue, stream: bool,
                   handle: Any, entry: dict[str, Any], mode: str, kv_in: dict[str, Any] | None,
                   on_done: Any = None) -> web.StreamResponse:
    cfg = st.cfg
    extra: dict[str, Any] = {}
    if mode == "prefill" and kv_in is not None and kv_in.get("do_remote_decode"):
        n_blocks = -(-shape.prompt_tokens // cfg.block_size)
        extra["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(range(n_blocks)),
            "remote_engine_id": cfg.engine_id or f"emulator-{st.port}",
            "remote_host": request.url.host or "127.0.0.1", "remote_port": st.port, "tp_size": cfg.gpus_per_rank,
        }
    if not stream:
        while True:
            kind, val = await events.get()
            if kind == "token":
                shape.add(val)
                st.count_tokens(val)
            else:
                break
        if val != "abort" and on_done is not None:
            on_done()
        cached = handle.cached_tokens if handle is not None else 0
        entry["cached_tokens"] = cached
        if val == "abort":
            raise asyncio.CancelledError()
        return web.json_response(shape.final(val, cached) | extra)
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    if st.faults.hang_after_headers:
        await asyncio.Event().wait()
    tx = cfg.stream_format == "transformers"
    first = True
    if tx and shape.endpoint == "chat":  # transformers serve: the role chunk goes out before prefill
        role = shape.chunk("", None, True)
        role["choices"][0]["delta"] = {"role": "assistant"}
        await resp.write(b"data: " + json.dumps(role).encode() + b"\n\n")
        first = False
    while True:
        kind, val = await events.get()
        if kind == "done":
            if val != "abort" and on_done is not None:
                on_done()
            break
        piece = shape.add(val)
        await resp.write(b"data: " + json.dumps(shape.chunk(piece, None, first)).encode() + b"\n\n")
        first = False
        st.count_tokens(val)
    if val == "abort":
        raise asyncio.CancelledError()
    cached = handle.cached_tokens if handle is not None else 0
    entry["cached_tokens"] = cached
    last = shape.chunk("", val, first) | extra
    if shape.endpoint != "generate":
        last["usage"] = shape.usage(cached)
    await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
    if not tx:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _bootstrap(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:
        room_id = int(request.match_info["room"])
    except ValueError:
        return _err(400, "room must be an integer")
    raw = request.query.get("timeout_s")
    try:
        timeout_s = st.cfg.bootstrap_timeout_s if raw is None else float(raw)
    except ValueError:
        timeout_s = math.nan
    if not 0 <= timeout_s <= MAX_BOOTSTRAP_WAIT_S:  # False for NaN: a long poll is bounded
        return _err(400, f"timeout_s must be a number of seconds 0..{MAX_BOOTSTRAP_WAIT_S:g}, got {raw!r}")
    room = st.room(room_id)
    try:
        await asyncio.wait_for(room.event.wait(), timeout_s)
    except asyncio.TimeoutError:
        return _err(504, f"no prefill for room {room_id} within {timeout_s} s", "timeout")
    finally:
        if st.rooms.get(room_id) is room:  # the decode leg has its answer: the room is done
            del st.rooms[room_id]
    if not room.ok:
        return _err(410, f"prefill for room {room_id} failed or was aborted", "server_error")
    return web.json_response({"status": "ready", "prompt_tokens": room.prompt_tokens})


async def _abort(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:
        body = await request.json()
    except ValueError:
        body = {}
    rid = str((body or {}).get("rid") or request.headers.get("X-Request-Id") or "")
    task = st.tasks.get(rid)
    if task is not None:
        task.cancel()
    return web.json_response({"rid": rid, "aborted": task is not None})


async def _health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.dead:
        return _err(503, "dead", "server_error")
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[STATE].cfg
    return web.json_response({"object": "list", "data": [
        {"id": cfg.served_model_name, "object": "model", "created": _now_s(), "owned_by": "pdlb-emulator",
         "root": cfg.model, "max_model_len": cfg.max_model_len}]})


async def _server_info(request: web.Request) -> web.Response:
    st = request.app[STATE]
    cfg = st.cfg
    core = st.core
    return web.json_response({
        "model_path": cfg.model, "served_model_name": cfg.served_model_name, "tokenizer_path": cfg.model,
        "tp_size": cfg.gpus_per_rank, "dp_size": cfg.dp_ranks, "page_size": cfg.block_size,
        "disaggregation_mode": cfg.role if cfg.role != "mixed" else "null",
        "disaggregation_bootstrap_port": st.port, "enable_dp_attention": cfg.dp_ranks > 1,
        "version": "pdlb-emulator", "status": "ready", "speed": cfg.speed, "zero_delay": cfg.zero_delay,
        "max_total_num_tokens": core.ranks[0].kv_capacity_blocks * cfg.block_size if core else 0,
        "internal_states": [{"num_running": core.num_running if core else st.running_simple,
                             "num_waiting": core.num_waiting if core else 0}],
    })


async def _model_info(request: web.Request) -> web.Response:
    cfg = request.app[STATE].cfg
    return web.json_response({"model_path": cfg.model, "tokenizer_path": cfg.model, "is_generation": True,
                              "preferred_sampling_params": None, "weight_version": "default",
                              "has_image_understanding": False, "has_audio_understanding": False,
                              "model_type": "emulated", "architectures": ["EmulatedForCausalLM"]})


async def _metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = st.cfg.served_model_name
    core = st.core
    st.g_running.labels(name).set(core.num_running if core else len(st.tasks))
    st.g_waiting.labels(name).set(core.num_waiting if core else 0)
    st.g_kv.labels(name).set(core.kv_usage if core else 0.0)
    return web.Response(body=generate_latest(st.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _stats(request: web.Request) -> web.Response:
    st = request.app[STATE]
    core = st.core
    return web.json_response(st.counts | {
        "in_flight": len(st.tasks), "tokens_streamed": st.tokens_streamed,
        "num_running": core.num_running if core else 0, "num_waiting": core.num_waiting if core else 0,
        "kv_usage": core.kv_usage if core else 0.0, "role": st.cfg.role, "port": st.port})


async def _requests(request: web.Request) -> web.Response:
    return web.json_response(list(request.app[STATE].log))


async def _set_faults(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:
        st.faults = FaultConfig.model_validate(await request.json())
    except ValidationError as e:  # one line naming the field, as every pdlb config error
        return _err(400, f"invalid faults: {format_validation_error(e, model=FaultConfig)}")
    except ValueError as e:  # not JSON
        return _err(400, f"invalid faults: invalid JSON body: {e}")
    st.rng = random.Random(st.faults.seed)
    return web.json_response(st.faults.model_dump())


def _generate_handler(endpoint: str):  # noqa: ANN202
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _generate(request, endpoint)
    return handler


def create_engine_app(cfg: EmulatorConfig, *, exit_on_die: bool = False) -> web.Application:
    """The emulated engine as an aiohttp app (run it with handler cancellation on, so that a
    client disconnect aborts the request, as in vLLM/SGLang).

    Args:
        cfg: the engine.
        exit_on_die: the ``die_after_tokens`` fault exits the process (``pdlb engine``) rather
            than dropping connections (in-process tests).
    """
    app = web.Application(client_max_size=64 * 1024 * 1024)
    st = EmulatorState(cfg, exit_on_die)
    app[STATE] = st

    async def lifecycle(app: web.Application):  # noqa: ANN202
        if st.kv_events is not None:
            import zmq

            try:
                st.kv_events.start()
            except zmq.ZMQError as e:
                raise ValueError(f"--kv-events: cannot bind {' '.join(st.kv_events.endpoints + st.kv_events.replay_endpoints)}: "
                                 f"{e}") from None
        st.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if st.core is not None:
            st.core.start()
        yield
        if st.kv_events is not None:
            await st.kv_events.stop()
        for t in list(st.tasks.values()):
            t.cancel()
        if st.core is not None:
            await st.core.stop()
        await st.session.close()

    app.cleanup_ctx.append(lifecycle)
    for path, ep in (("/v1/completions", "completions"), ("/v1/chat/completions", "chat"), ("/generate", "generate")):
        app.router.add_post(path, _generate_handler(ep))
    app.router.add_get("/health", _health)
    app.router.add_get("/health_generate", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_get("/model_info", _model_info)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_post("/abort_request", _abort)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/bootstrap/{room}", _bootstrap)
    app.router.add_get("/emulator/stats", _stats)
    app.router.add_get("/emulator/requests", _requests)
    app.router.add_post("/emulator/faults", _set_faults)
    return app
