"""Boolean request fields read as the engines read them (pdlb once answered 400 to
``"add_special_tokens": "no"`` and ``"stream": 1``, which vLLM and SGLang accept).

The reference is SGLang 0.5.23's OWN request models (``sglang/srt/entrypoints/openai/protocol.py``
from its wheel, loaded at test time as :mod:`tests.engine_publishers` loads its KV-event code; the
one helper it imports from ``sglang.utils``, which needs IPython, is a stand-in never called here):
for each value, pdlb accepts it exactly when SGLang's ``CompletionRequest`` /
``ChatCompletionRequest`` / ``StreamOptions`` do, and reads the same boolean. vLLM 0.33's models
declare the same fields as plain pydantic ``bool`` (read in its wheel: ``CompletionRequest.stream:
bool | None``, ``add_special_tokens: bool``), so they read them the same way.
"""

from __future__ import annotations

import importlib
import sys
import types

import aiohttp
import pytest

from balancer.service.prompt import PromptError, extract_prompt, lax_bool
from balancer.service.request_checks import check_request
from sim.emulator.testing import inprocess_cluster

VALUES = [True, False, 1, 0, 1.0, 0.0, "yes", "no", "YES", "Off", "on", "t", "f", "y", "n", "1", "0", "true",
          "False", "tRuE", 2, -1, "2", "", "maybe", "truee", " true", 0.5, [], {}, [True], "nope"]


def load_sglang_protocol():  # noqa: ANN201
    """SGLang's own ``sglang.srt.entrypoints.openai.protocol`` (its pydantic request models)."""
    pytest.importorskip("openai")  # the module imports openai's response types
    from tests.engine_publishers import SGLANG_VERSION, _bare_packages, _extract, cache_dir, engine_wheel

    wheel = engine_wheel("sglang", SGLANG_VERSION)
    root = _extract(wheel, "sglang/srt/", cache_dir() / f"sglang-{SGLANG_VERSION}-src")
    _bare_packages(root, ["sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai"])
    if "sglang.utils" not in sys.modules:  # needs IPython; protocol.py imports one helper from it
        stand_in = types.ModuleType("sglang.utils")
        stand_in.convert_json_schema_to_str = lambda schema: schema  # type: ignore[attr-defined]
        sys.modules["sglang.utils"] = stand_in
    return importlib.import_module("sglang.srt.entrypoints.openai.protocol")


def _sglang(model, body: dict, read) -> tuple[bool, object]:  # noqa: ANN001
    from pydantic import ValidationError

    try:
        return True, read(model.model_validate(body))
    except ValidationError:
        return False, None


def _pdlb(check) -> tuple[bool, object]:  # noqa: ANN001
    try:
        return True, check()
    except PromptError:
        return False, None


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_boolean_fields_are_read_as_sglangs_own_models_read_them(value) -> None:  # noqa: ANN001
    proto = load_sglang_protocol()
    cases = [
        # (what, SGLang model, body, SGLang's reading, pdlb's check and reading)
        ("completions stream", proto.CompletionRequest, {"model": "m", "prompt": "hi", "stream": value},
         lambda r: r.stream, lambda b: (check_request("completions", b, 1000), b["stream"])[1]),
        ("chat logprobs", proto.ChatCompletionRequest,
         {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": value},
         lambda r: r.logprobs, lambda b: (check_request("chat", b, 1000), b["logprobs"])[1]),
        ("stream_options.include_usage", proto.CompletionRequest,
         {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": value}},
         lambda r: r.stream_options.include_usage,
         lambda b: (check_request("completions", b, 1000), b["stream_options"]["include_usage"])[1]),
        ("chat continue_final_message", proto.ChatCompletionRequest,
         {"model": "m", "messages": [{"role": "user", "content": "hi"}], "continue_final_message": value},
         lambda r: r.continue_final_message,
         lambda b: extract_prompt("chat", b).chat.continue_final_message),
    ]
    for what, model, body, read, pdlb in cases:
        want = _sglang(model, dict(body), read)
        got = _pdlb(lambda: pdlb(dict(body)))
        assert got == want, f"{what} = {value!r}: pdlb {got}, SGLang {want}"


def test_lax_bool_by_hand() -> None:
    # pydantic's documented lax-mode table (hand list): the words and 0/1, any case; nothing else
    for v in ("true", "TRUE", "on", "yes", "y", "t", "1", 1, 1.0, True):
        assert lax_bool(v, "x") is True
    for v in ("false", "Off", "no", "N", "f", "0", 0, 0.0, False):
        assert lax_bool(v, "x") is False
    assert lax_bool(None, "x") is None
    for v in (2, "2", "", "yess", [], 0.5, "false " * 1000):
        with pytest.raises(PromptError, match="'x' must be a boolean"):
            lax_bool(v, "x")


async def test_stream_yes_streams_and_stream_no_does_not() -> None:
    # through the service: "stream": "yes" is relayed as a stream (SSE), "no" as one JSON answer,
    # as the engines would answer them (was: 400 for both)
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine={"speed": 20.0}) as c, \
            aiohttp.ClientSession() as s:
        for value, sse in (("yes", True), ("no", False), (1, True), ("off", False)):
            r = await s.post(c.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": value})
            text = await r.text()
            assert r.status == 200, text
            assert r.content_type == ("text/event-stream" if sse else "application/json"), (value, r.content_type)
            assert ("data: [DONE]" in text) is sse
