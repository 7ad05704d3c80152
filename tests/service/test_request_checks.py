"""Request-shape checks of the service (``balancer/service/request_checks.py``): batched prompts,
``model`` and ``logprobs`` types, chat messages without content; each an OpenAI-style 400 naming
the field, before anything reaches an engine.

The rules are the OpenAI API's (a ``model`` string; completions ``logprobs`` an integer, chat
``logprobs`` a boolean with ``top_logprobs`` an integer 0..20; a message needs ``content`` unless
it is an assistant turn with ``tool_calls``); the expected messages are written by hand from them.
"""

from __future__ import annotations

import aiohttp
import pytest

from balancer.service.body_offload import OFFLOAD_BODY_BYTES
from balancer.service.prompt import EMPTY_PROMPT, PromptError
from balancer.service.request_checks import check_request
from sim.emulator.testing import inprocess_cluster

BATCH = "batched prompts are not supported by the router ({n} prompts in '{key}'): send one request per prompt"
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("endpoint, body, message", [
    ("completions", {"prompt": ["a", "b"]}, BATCH.format(n=2, key="prompt")),
    ("completions", {"prompt": [[1, 2], [3]]}, BATCH.format(n=2, key="prompt")),
    ("generate", {"text": ["a", "b", "c"]}, BATCH.format(n=3, key="text")),
    ("generate", {"input_ids": [[1], [2]]}, BATCH.format(n=2, key="input_ids")),
    ("generate", {"text": [5]}, "'text' must be a string"),
    ("completions", {"prompt": "x", "model": 123}, "'model' must be a string"),
    ("chat", {"messages": [USER], "model": ["m"]}, "'model' must be a string"),
    ("completions", {"prompt": "x", "logprobs": "x"}, "'logprobs' must be an integer 0..20"),
    ("completions", {"prompt": "x", "logprobs": 21}, "'logprobs' must be an integer 0..20"),
    ("completions", {"prompt": "x", "logprobs": True}, "'logprobs' must be an integer 0..20"),
    ("chat", {"messages": [USER], "logprobs": "x"}, "'logprobs' must be a boolean"),
    ("chat", {"messages": [USER], "logprobs": 2}, "'logprobs' must be a boolean"),
    ("chat", {"messages": [USER], "logprobs": True, "top_logprobs": -1}, "'top_logprobs' must be an integer 0..20"),
    ("generate", {"text": "x", "return_logprob": "maybe"}, "'return_logprob' must be a boolean"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 0.5}},
     "'stream_options.include_usage' must be a boolean"),
    ("chat", {"messages": [USER], "stream": True, "stream_options": {"continuous_usage_stats": [1]}},
     "'stream_options.continuous_usage_stats' must be a boolean"),
    ("chat", {"messages": [{"role": "user"}]},
     "'messages[0].content' is required: a string or an array of content parts"),
    ("chat", {"messages": [USER, {"role": "assistant", "content": None}]},
     "'messages[1].content' is required: a string or an array of content parts"),
    ("chat", {"messages": [{"role": "user", "content": 5}]},
     "'messages[0].content' must be a string or an array of content parts"),
    ("chat", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
     "'messages[0].content[0]' must be an object with a string 'type'"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
     "'messages[0].content[0].text' must be a string"),
    ("chat", {"messages": [{"content": "hi"}]}, "'messages[0]' must be an object with a string 'role'"),
    ("chat", {"messages": []}, "'messages' must be a non-empty array"),
])
def test_bad_shapes_are_refused_naming_the_field(endpoint: str, body: dict, message: str) -> None:
    with pytest.raises(PromptError) as ei:
        check_request(endpoint, body, 4096)
    assert str(ei.value) == message


@pytest.mark.parametrize("endpoint, body", [
    ("completions", {"prompt": ["one prompt in an array"], "logprobs": 5, "model": "m"}),
    ("completions", {"prompt": [[1, 2, 3]], "logprobs": 0}),
    ("completions", {"prompt": [1, 2, 3]}),  # token ids of one prompt, not a batch
    ("chat", {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "t"}]},
                           {"role": "tool", "content": "42"}], "logprobs": True, "top_logprobs": 20}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]}),
    ("generate", {"text": ["one"], "return_logprob": False, "top_logprobs_num": 3}),
    ("generate", {"input_ids": [1, 2, 3]}),
])
def test_valid_shapes_pass(endpoint: str, body: dict) -> None:
    check_request(endpoint, body, 4096)  # raises on a false refusal


async def test_the_service_answers_400s_in_openai_form_and_forwards_nothing() -> None:
    cases = [("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, BATCH.format(n=2, key="prompt")),
             ("/v1/completions", {"prompt": "x", "model": 123}, "'model' must be a string"),
             ("/v1/completions", {"prompt": "x", "logprobs": "x"}, "'logprobs' must be an integer 0..20"),
             ("/v1/chat/completions", {"messages": [{"role": "user"}]},
              "'messages[0].content' is required: a string or an array of content parts"),
             # empty prompts (review F9): SGLang 0.5.23's OpenAI server answers 400 "Prompt cannot be empty"
             # to each of these (OpenAIServingCompletion._validate_request: not prompt, or every string empty);
             # vLLM 0.33's to "" (CompletionRequest.validate_prompt_and_prompt_embeds). "" was forwarded (200)
             ("/v1/completions", {"prompt": "", "max_tokens": 2}, EMPTY_PROMPT),
             ("/v1/completions", {"prompt": [""], "max_tokens": 2}, EMPTY_PROMPT),
             ("/v1/completions", {"prompt": [], "max_tokens": 2}, EMPTY_PROMPT),
             # the same from the worker process that parses large bodies (body_offload)
             ("/v1/completions", {"prompt": "", "max_tokens": 2, "user": "x" * OFFLOAD_BODY_BYTES}, EMPTY_PROMPT),
             # SGLang: "Messages cannot be empty." (OpenAIServingChat._validate_request)
             ("/v1/chat/completions", {"messages": []}, "'messages' must be a non-empty array")]
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine={"speed": 20.0}) as c, \
            aiohttp.ClientSession() as s:
        for path, body, message in cases:
            async with s.post(c.url + path, json=body) as r:
                assert r.status == 400
                assert await r.json() == {"error": {"message": message, "type": "invalid_request_error", "code": 400}}
        log = []
        for srv in c.engines:
            async with s.get(f"http://127.0.0.1:{srv.port}/emulator/requests") as r:
                log += await r.json()
        assert log == []  # nothing reached an engine
        async with s.post(c.url + "/v1/completions", json={"prompt": ["one"], "max_tokens": 2}) as r:
            assert r.status == 200 and len((await r.json())["choices"]) == 1
        # SGLang's native /generate: text "" goes through as SGLang itself takes it (its TokenizerManager
        # tokenizes it and checks only the context length, 0.5.23); an empty input_ids list is refused
        # by SGLang ("input_ids cannot be empty.", GenerateReqInput) and by the router (review R6)
        async with s.post(c.url + "/generate", json={"text": "", "sampling_params": {"max_new_tokens": 2}}) as r:
            assert r.status == 200, await r.text()
        async with s.post(c.url + "/generate", json={"input_ids": [], "sampling_params": {"max_new_tokens": 2}}) as r:
            assert r.status == 400


async def test_admin_api_validation_errors_are_one_readable_line_per_problem() -> None:
    # was: "invalid worker: [{'type': 'missing', 'loc': ('role',), 'msg': 'Field required'}, ...]"
    auth = {"Authorization": "Bearer k"}
    async with inprocess_cluster("sglang", engine={"speed": 20.0}, router={"admin_api_key": "k"}) as c, \
            aiohttp.ClientSession() as s:
        cases = [
            ({"url": "http://127.0.0.1:9"}, "invalid worker: role: Field required"),
            ({"url": "http://127.0.0.1:9", "role": "decode", "dp_sise": 2},
             "invalid worker: dp_sise: unknown field (did you mean 'dp_size'?)"),
            ({"url": "http://127.0.0.1:9", "role": "decoder", "dp_size": 0},
             "invalid worker: role: Input should be 'prefill', 'decode' or 'mixed'; "
             "dp_size: Input should be greater than or equal to 1"),
        ]
        for body, message in cases:
            async with s.post(c.url + "/workers", json=body, headers=auth) as r:
                assert r.status == 400
                got = (await r.json())["error"]["message"]
                assert got == message and "\n" not in got


# ---------------------------------------------------------------------- the checks of present keys only
# The sampling checks run only for the keys a body has (issue 26: a body names a few of the 15). The
# reference below is the previous implementation, every key checked in turn (main 3aff0ef's
# request_checks.py, `_sampling` and the ROUTER_FIELDS loop, kept here as the independent
# implementation): the same bodies must get the same first error (or none), in the same order.
import math  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from balancer.service import request_checks as rc  # noqa: E402


def _ref_number(body, key, where, lo=None, hi=None, lo_open=False):  # noqa: ANN001, ANN202
    v = body.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PromptError(f"'{where}{key}' must be a finite number")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise PromptError(f"'{where}{key}' must be {'>' if lo_open else '>='} {lo:g}, got {v!r}")
    if hi is not None and v > hi:
        raise PromptError(f"'{where}{key}' must be <= {hi:g}, got {v!r}")


def _ref_integer(body, key, where, lo, hi):  # noqa: ANN001, ANN202
    v = body.get(key)
    if v is None:
        return
    if not (isinstance(v, int) and not isinstance(v, bool)) or not lo <= v <= hi:
        raise PromptError(f"'{where}{key}' must be an integer {lo}..{hi}")


def _ref_sampling(body, where, max_tokens_limit):  # noqa: ANN001, ANN202
    _ref_number(body, "temperature", where, 0.0)
    _ref_number(body, "top_p", where, 0.0, 1.0, lo_open=True)
    _ref_number(body, "min_p", where, 0.0, 1.0)
    _ref_number(body, "presence_penalty", where, -2.0, 2.0)
    _ref_number(body, "frequency_penalty", where, -2.0, 2.0)
    _ref_number(body, "repetition_penalty", where, 0.0, lo_open=True)
    _ref_integer(body, "top_k", where, -1, 2**31 - 1)
    _ref_integer(body, "n", where, 1, rc.MAX_N)
    _ref_integer(body, "best_of", where, 1, rc.MAX_N)
    _ref_integer(body, "seed", where, -(2**63), 2**64 - 1)
    for key in ("max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens"):
        _ref_integer(body, key, where, 0 if key == "min_tokens" else 1, max_tokens_limit)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or len(stop) > rc.MAX_STOP or not all(isinstance(s, str) for s in stop):
            raise PromptError(f"'{where}stop' must be a string or an array of at most {rc.MAX_STOP} strings")


def _ref_router_fields(body):  # noqa: ANN001, ANN202
    for key in rc.ROUTER_FIELDS:
        if key in body:
            raise PromptError(f"'{key}' is set by the router (PD handshake and DP rank); remove it from the request")


def _outcome(fn, *args):  # noqa: ANN001, ANN002, ANN202
    try:
        fn(*args)
    except PromptError as e:
        return str(e)
    return None


_KEYS = [*rc._SAMPLING_SEQ, *rc.ROUTER_FIELDS, "model", "prompt", "other"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(allow_nan=True),
                    st.text(max_size=3), st.lists(st.one_of(st.text(max_size=2), st.integers()), max_size=20),
                    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=8), st.integers(1, 1 << 20))
def test_present_key_checks_give_the_first_error_of_checking_every_key(body: dict, limit: int) -> None:
    assert _outcome(rc._sampling, body, "sampling_params.", limit) == _outcome(_ref_sampling, body, "sampling_params.", limit)
    # check_request refuses a router field before anything else, naming the first of ROUTER_FIELDS
    want = _outcome(_ref_router_fields, body)
    got = _outcome(check_request, "completions", {**body, "prompt": "x"}, limit)
    if want is not None:
        assert got == want
    else:
        assert got is None or "is set by the router" not in got
