"""The body's session fields (``session_id``, ``user``) must be strings (session 16's review, S9).

Before, ``"session_id": 123`` was ignored silently: the request was routed without the session
affinity its client asked for (and the engine behind refused it). The rule now is the engines':
vLLM 0.33.0 and SGLang 0.5.23 declare both fields ``str | None`` in their OpenAI request models
(checked below against the engines' own wheels), so any other JSON type is a 400 naming the field.
"""

from __future__ import annotations

import ast
import zipfile

import aiohttp
import pytest

from balancer.service.prompt import PromptError
from balancer.service.request_checks import SESSION_FIELDS, session_id_of
from sim.emulator.testing import inprocess_cluster

#: every JSON type but string and null (the class of bad values)
NOT_STRINGS = [123, 1.5, True, False, 0, [], ["s"], {}, {"id": "s"}]


@pytest.mark.parametrize("field", SESSION_FIELDS)
@pytest.mark.parametrize("value", NOT_STRINGS, ids=repr)
@pytest.mark.parametrize("header", [False, True])
def test_a_session_field_that_is_not_a_string_is_refused(field, value, header):
    # fails before the fix: the value was skipped and session_id_of returned None (or the header's id)
    headers = {"X-Session-Id": "h"} if header else {}
    with pytest.raises(PromptError, match=f"'{field}' must be a string"):
        session_id_of({field: value}, headers)


def test_null_and_empty_session_fields_mean_no_session():
    # null: the engines' models accept it (Optional); "": no session, the next field is read
    assert session_id_of({"session_id": None, "user": None}, {}) is None
    assert session_id_of({"session_id": "", "user": "u"}, {}) == "u"
    assert session_id_of({"session_id": None, "user": "u"}, {}) == "u"
    assert session_id_of({"session_id": "s", "user": None}, {"X-Session-Id": "h"}) == "h"


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_the_service_answers_400_naming_the_field(endpoint):
    base = ({"prompt": "hello " * 8} if endpoint == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hello " * 8}]})
    async with inprocess_cluster("none", num_decode=1, engine={"speed": 20.0}) as c, aiohttp.ClientSession() as s:
        for field in SESSION_FIELDS:
            for value in (123, ["s"], {"id": "s"}):
                r = await s.post(c.url + endpoint, json=base | {"max_tokens": 1, field: value})
                err = (await r.json())["error"]
                assert r.status == 400 and f"'{field}'" in err["message"] and err["code"] == 400, err
        # the controls: a string and null are served
        for value in ("agent-7", None):
            r = await s.post(c.url + endpoint, json=base | {"max_tokens": 1, "session_id": value})
            assert r.status == 200, await r.text()
        # nothing reached the engine for the refused requests: 2 served
        r = await s.get(f"http://127.0.0.1:{c.decode[0].port}/emulator/requests")
        assert len(await r.json()) == 2


def _annotations(source: str, fields: tuple[str, ...]) -> dict[str, set[str]]:
    """``{field: {annotation text, ...}}`` of every class attribute named in ``fields``."""
    out: dict[str, set[str]] = {f: set() for f in fields}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in fields:
            out[node.target.id].add(ast.unparse(node.annotation))
    return out


@pytest.mark.parametrize("engine,version,path", [
    ("vllm", "0.33.0", "vllm/entrypoints/openai/completion/protocol.py"),
    ("vllm", "0.33.0", "vllm/entrypoints/openai/chat_completion/protocol.py"),
    ("sglang", "0.5.23", "sglang/srt/entrypoints/openai/protocol.py"),
])
def test_the_engines_declare_the_session_fields_as_optional_strings(engine, version, path):
    # the independent source of the rule: the engines' own request models, read from their wheels
    from tests.engine_publishers import engine_wheel
    with zipfile.ZipFile(engine_wheel(engine, version)) as z:
        source = z.read(path).decode()
    found = _annotations(source, SESSION_FIELDS)
    assert found["user"], path  # OpenAI's end-user id, in every request model
    for field, annotations in found.items():
        assert annotations <= {"str | None", "Optional[str]"}, (path, field, annotations)
