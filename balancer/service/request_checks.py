"""Checks of a generation request body before anything is forwarded (OpenAI-style 400s).

The router forwards a client's body to engines almost unchanged, so anything it lets through
reaches every engine it retries on. What it checks here:

* **Fields the router owns** are refused (:data:`ROUTER_FIELDS`): the PD handshake
  (``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` for SGLang, ``kv_transfer_params`` for
  vLLM) and the DP rank (``data_parallel_rank``). Forwarded from a client they would make a decode
  engine fetch KV from a host and port the client chose, or address a rank the router did not pick.
* **Fields the router reads or that engines reject with a 5xx** are type- and range-checked the way
  an OpenAI server does: ``stream`` a boolean (``"false"`` is truthy in Python; the spellings
  vLLM's and SGLang's pydantic models accept, ``"no"``, ``1``, ``"on"``..., are accepted and
  replaced by their boolean: :func:`~balancer.service.prompt.lax_bool`), the output limit
  (``max_tokens``, ``max_completion_tokens``, ``sampling_params.max_new_tokens``) an integer
  1..``max_tokens_limit``, ``n``/``best_of`` 1..:data:`MAX_N`, sampling numbers finite
  (``temperature`` >= 0, ``top_p`` in (0, 1], penalties in [-2, 2], ``repetition_penalty`` > 0),
  ``top_k`` an integer >= -1, ``seed`` an integer, ``stop`` a string or at most :data:`MAX_STOP`
  strings.
* **The request's shape**: ``model`` a string; ``logprobs`` an integer 0..:data:`MAX_LOGPROBS`
  on ``/v1/completions``, a boolean on chat (with ``top_logprobs`` an integer 0..:data:`MAX_LOGPROBS`),
  SGLang's ``return_logprob`` a boolean and ``top_logprobs_num`` an integer; chat ``messages`` each
  an object with a string ``role`` and a ``content`` that is a string or an array of parts (objects
  with a string ``type``; a ``text`` part has a string ``text``), ``null`` or absent only on an
  ``assistant`` message with ``tool_calls`` (or ``function_call``). **Batched prompts** (a
  ``prompt`` array of several strings or several token-id arrays; SGLang's ``text`` array or
  ``input_ids`` array of arrays) are refused: one request is routed to one pair of ranks and its
  answer relayed as is, so a batch would be answered as one prompt; send one request per prompt.
* **The client's request id** (``rid`` body field or ``X-Request-Id`` header): a string (or
  integer) of at most :data:`MAX_REQUEST_ID_CHARS` printable characters. It is echoed to the
  client and logged, never sent upstream (the router uses its own ids there).

Every error is a :class:`~balancer.service.prompt.PromptError` naming the field; the service
answers 400. NaN and infinities are refused when the body is parsed (:func:`parse_json_body`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from balancer.service.prompt import PromptError, lax_bool

__all__ = ["MAX_LOGPROBS", "MAX_N", "MAX_REQUEST_ID_CHARS", "MAX_STOP", "ROUTER_FIELDS", "check_request",
           "client_request_id", "parse_json_body"]

ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "kv_transfer_params", "data_parallel_rank")
"""Body fields the router sets itself; a client request that carries one is refused."""
MAX_REQUEST_ID_CHARS = 256
"""Longest client request id accepted (``rid`` / ``X-Request-Id``)."""
MAX_N = 128
"""Most choices per request (``n``, ``best_of``), as the OpenAI API allows."""
MAX_STOP = 16
"""Most stop strings per request."""
MAX_LOGPROBS = 20
"""Most log-probabilities per token (``logprobs`` on completions, ``top_logprobs`` on chat), as
vLLM's default ``max_logprobs`` and the OpenAI chat API allow."""
_BATCH = "batched prompts are not supported by the router ({n} prompts in '{key}'): send one request per prompt"


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def parse_json_body(raw: bytes) -> Any:
    """``json.loads(raw)`` that refuses ``NaN``/``Infinity`` and too deeply nested documents.

    Raises:
        ValueError: not JSON, not UTF-8, a non-finite constant, or nesting beyond what the
            parser can recurse into (the message says which).
    """
    try:
        if isinstance(raw, (bytes, bytearray)):  # what json.loads does, with one decoder made once
            return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("the JSON body is nested too deeply") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], key: str, where: str, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PromptError(f"'{where}{key}' must be a finite number")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise PromptError(f"'{where}{key}' must be {'>' if lo_open else '>='} {lo:g}, got {v!r}")
    if hi is not None and v > hi:
        raise PromptError(f"'{where}{key}' must be <= {hi:g}, got {v!r}")


def _integer(body: Mapping[str, Any], key: str, where: str, lo: int, hi: int) -> None:
    v = body.get(key)
    if v is None:
        return
    if not _is_int(v) or not lo <= v <= hi:
        raise PromptError(f"'{where}{key}' must be an integer {lo}..{hi}")


_SAMPLING_NUMBERS: dict[str, tuple[float | None, float | None, bool]] = {
    # key: (lo, hi, lo_open), checked in this order
    "temperature": (0.0, None, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, None, True),
}
_SAMPLING_INTEGERS: dict[str, tuple[int, int | None]] = {
    # key: (lo, hi; None: max_tokens_limit), checked after the numbers, in this order
    "top_k": (-1, 2**31 - 1),
    "n": (1, MAX_N),
    "best_of": (1, MAX_N),
    "seed": (-(2**63), 2**64 - 1),
    "max_tokens": (1, None),
    "max_completion_tokens": (1, None),
    "max_new_tokens": (1, None),
    "min_tokens": (0, None),
}
_SAMPLING_SEQ = (*_SAMPLING_NUMBERS, *_SAMPLING_INTEGERS, "stop")
_SAMPLING_KEYS = frozenset(_SAMPLING_SEQ)


def _sampling(body: Mapping[str, Any], where: str, max_tokens_limit: int) -> None:
    # only the keys the body has, in the order above (a body names a few of the 15: most checks
    # would find nothing), so the first problem reported is the same as checking every key in turn
    present = body.keys() & _SAMPLING_KEYS
    if not present:
        return
    for key in _SAMPLING_SEQ if len(present) > 1 else present:
        if key not in present:
            continue
        if key in _SAMPLING_NUMBERS:
            lo, hi, lo_open = _SAMPLING_NUMBERS[key]
            _number(body, key, where, lo, hi, lo_open)
        elif key == "stop":
            stop = body[key]
            if stop is not None and not isinstance(stop, str):
                if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
                    raise PromptError(f"'{where}stop' must be a string or an array of at most {MAX_STOP} strings")
        else:
            ilo, ihi = _SAMPLING_INTEGERS[key]
            _integer(body, key, where, ilo, max_tokens_limit if ihi is None else ihi)


def _boolean(body: dict[str, Any], key: str, where: str = "") -> None:
    """``body[key]`` a boolean as the engines read one (:func:`~balancer.service.prompt.lax_bool`);
    an accepted non-boolean (``"yes"``, ``0``) is replaced by its boolean in ``body``, so that the
    router reads what the engine will (``"stream": "yes"`` streams)."""
    v = body.get(key)
    if v is not None and type(v) is not bool:
        body[key] = lax_bool(v, where + key)


def _messages(messages: Any) -> None:
    """Chat messages as the OpenAI API requires them (content present; tool-call turns excepted)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"'messages[{i}]' must be an object with a string 'role'")
        content = m.get("content")
        if content is None:
            if m["role"] == "assistant" and (m.get("tool_calls") or m.get("function_call")):
                continue
            raise PromptError(f"'messages[{i}].content' is required: a string or an array of content parts")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise PromptError(f"'messages[{i}].content' must be a string or an array of content parts")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise PromptError(f"'messages[{i}].content[{j}]' must be an object with a string 'type'")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise PromptError(f"'messages[{i}].content[{j}].text' must be a string")


def _not_batched(body: Mapping[str, Any], endpoint: str) -> None:
    if endpoint == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise PromptError(_BATCH.format(n=len(p), key="prompt"))
    elif endpoint == "generate":
        t, ids = body.get("text"), body.get("input_ids")
        if isinstance(t, list):
            if len(t) != 1 or not isinstance(t[0], str):
                raise PromptError(_BATCH.format(n=len(t), key="text") if len(t) > 1 else "'text' must be a string")
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids) and len(ids) > 1:
            raise PromptError(_BATCH.format(n=len(ids), key="input_ids"))


def check_request(endpoint: str, body: dict[str, Any], max_tokens_limit: int) -> None:
    """Check a generation request body (see the module docstring). Boolean fields the engines
    accept in another spelling (``"yes"``, ``1``: :func:`~balancer.service.prompt.lax_bool`) are
    replaced in ``body`` by their boolean.

    Args:
        endpoint: ``"completions"``, ``"chat"`` or ``"generate"``.
        body: the parsed JSON object.
        max_tokens_limit: the largest output-token limit accepted.

    Raises:
        PromptError: the first problem found, naming the field.
    """
    if not body.keys().isdisjoint(ROUTER_FIELDS):
        key = next(k for k in ROUTER_FIELDS if k in body)
        raise PromptError(f"'{key}' is set by the router (PD handshake and DP rank); remove it from the request")
    _boolean(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise PromptError("'stream_options' must be an object")
    if so is not None:
        for key in ("include_usage", "continuous_usage_stats"):  # OpenAI's and vLLM's flags
            _boolean(so, key, "stream_options.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise PromptError("'model' must be a string")
    _not_batched(body, endpoint)
    if endpoint == "completions":
        _integer(body, "logprobs", "", 0, MAX_LOGPROBS)
    elif endpoint == "chat":
        _boolean(body, "logprobs")
        _integer(body, "top_logprobs", "", 0, MAX_LOGPROBS)
        _messages(body.get("messages"))
    else:
        _boolean(body, "return_logprob")
        _integer(body, "top_logprobs_num", "", 0, 2**31 - 1)
        _integer(body, "logprob_start_len", "", -1, 2**63 - 1)
    _sampling(body, "", max_tokens_limit)
    if endpoint == "generate":
        sp = body.get("sampling_params")
        if sp is not None:
            if not isinstance(sp, dict):
                raise PromptError("'sampling_params' must be an object")
            _sampling(sp, "sampling_params.", max_tokens_limit)
        if "max_new_tokens" in body:  # top level is not where SGLang reads it: refuse rather than ignore
            raise PromptError("'max_new_tokens' belongs in 'sampling_params'")


#: headers naming a conversation / agent session, in the order vllm-router reads them for its
#: consistent hashing (``src/policies/hash_key.rs`` of the 0.1.17 sdist; its per-request ids,
#: ``x-request-id`` and ``x-trace-id``, are left out: they give no affinity)
SESSION_HEADERS = ("X-Session-Id", "X-User-Id", "X-Tenant-Id", "X-Correlation-Id")
#: body fields naming a session, in order (``user`` is OpenAI's end-user id)
SESSION_FIELDS = ("session_id", "user")


def session_id_of(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The request's session key for session-affine policies (``Request.session_id``): the first
    non-empty header of :data:`SESSION_HEADERS`, else the first string field of
    :data:`SESSION_FIELDS` in the body, else ``None``.

    A body field of :data:`SESSION_FIELDS` that is present must be a string or ``null``, whether or
    not a header names the session: the engines refuse it the same way (vLLM 0.33.0 and SGLang
    0.5.23 declare ``session_id`` and ``user`` as ``str | None`` in their OpenAI request models, so
    ``"session_id": 123`` is a validation error there), and ignoring it would route the request
    without the affinity its client asked for.

    Raises:
        PromptError: the value is longer than :data:`MAX_REQUEST_ID_CHARS` or not printable, or a
            body field of :data:`SESSION_FIELDS` is neither a string nor ``null``.
    """
    for name in SESSION_FIELDS:
        b = body.get(name)
        if b is not None and not isinstance(b, str):
            raise PromptError(f"'{name}' must be a string or null (pdlb reads it as the session id), got {type(b).__name__}")
    found: tuple[str, str] | None = None
    for name in SESSION_HEADERS:
        h = headers.get(name)
        if h:
            found = (name, h)
            break
    if found is None:
        for name in SESSION_FIELDS:
            b = body.get(name)
            if isinstance(b, str) and b:
                found = (name, b)
                break
    if found is None:
        return None
    name, v = found
    if len(v) > MAX_REQUEST_ID_CHARS or not v.isprintable():
        raise PromptError(f"'{name}' (the session id) must be 1..{MAX_REQUEST_ID_CHARS} printable characters")
    return v


def client_request_id(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The client's own request id (body ``rid``, else the ``X-Request-Id`` header), or ``None``.

    Raises:
        PromptError: ``rid`` is not a string or integer, or the id is empty, longer than
            :data:`MAX_REQUEST_ID_CHARS` or has non-printable characters.
    """
    v = body.get("rid")
    where = "rid"
    if v is None:
        v = headers.get("X-Request-Id")
        where = "X-Request-Id"
        if v is None:
            return None
    elif _is_int(v):
        v = str(v)
    elif not isinstance(v, str):
        raise PromptError("'rid' must be a string (one request id)")
    if not v or len(v) > MAX_REQUEST_ID_CHARS or not v.isprintable():
        raise PromptError(f"'{where}' must be 1..{MAX_REQUEST_ID_CHARS} printable characters")
    return v
