"""``--tokenizer MODEL_DIR``: chat requests hashed as the engine tokenises them (jinja2 chat template).

The model folder is built here: a WordLevel ``tokenizer.json`` with a hand-written vocabulary and
special tokens, and a ``tokenizer_config.json`` whose ``chat_template`` is Llama-3-shaped. Expected
token ids are written out by hand from the vocabulary and the template's text.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from aiohttp.test_utils import TestServer  # noqa: E402

from balancer.hashing import hash_token_blocks  # noqa: E402
from balancer.service.app import SERVICE, create_app  # noqa: E402
from balancer.service.config import ServiceConfig  # noqa: E402
from balancer.service.prompt import ChatTemplate, PromptError, PromptHasher, extract_prompt  # noqa: E402
from sim.emulator.app import STATE, create_engine_app  # noqa: E402
from sim.emulator.config import EmulatorConfig  # noqa: E402
from tests.kv_publisher import FakeEngine  # noqa: E402

SPECIAL = {"<s>": 1, "<|start|>": 2, "<|end|>": 3, "<|eot|>": 4}
WORDS = ["system", "user", "assistant", "you", "are", "a", "helpful", "tell", "me", "joke", "story", "about", "cats",
         "dogs"]
VOCAB = {"[UNK]": 0, **SPECIAL, **{w: 5 + i for i, w in enumerate(WORDS)}}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "<|start|>{{ m['role'] }}<|end|>\n\n{{ m['content'] | trim }}<|eot|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% endif %}")
MESSAGES = [{"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": "tell me a joke about cats "}]
# by hand: <s> <|start|> system <|end|> you are a helpful assistant <|eot|> <|start|> user <|end|>
# tell me a joke about cats <|eot|> <|start|> assistant <|end|>
IDS = [1, 2, 5, 3, 8, 9, 10, 11, 7, 4, 2, 6, 3, 12, 13, 10, 14, 16, 17, 4, 2, 7, 3]


@pytest.fixture
def model_dir(tmp_path):
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "<|eot|>", "chat_template": TEMPLATE}))
    return tmp_path


def test_chat_template_renders_like_the_engine(model_dir):
    h = PromptHasher(block_size=4, tokenizer_path=str(model_dir))
    prompt = extract_prompt("chat", {"messages": MESSAGES})
    assert h.token_ids(prompt) == IDS
    n, hashes = h.hash(prompt)
    assert n == 23 and list(hashes) == hash_token_blocks(IDS, 4)  # 5 full blocks of 4
    # the rendered text itself, by hand
    text = ChatTemplate.from_folder(model_dir).render(MESSAGES)
    assert text == ("<s><|start|>system<|end|>\n\nyou are a helpful assistant<|eot|><|start|>user<|end|>\n\n"
                    "tell me a joke about cats<|eot|><|start|>assistant<|end|>\n\n")
    with pytest.raises(PromptError, match="unknown role tool"):
        h.hash(extract_prompt("chat", {"messages": [{"role": "tool", "content": "x"}]}))
    # a template in a list of named templates, and chat_template.jinja wins over the config
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": TEMPLATE}]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert PromptHasher(4, tokenizer_path=str(model_dir)).token_ids(prompt) == IDS
    (model_dir / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert PromptHasher(4, tokenizer_path=str(model_dir)).token_ids(prompt) == [1, 8, 9, 10, 11, 7]
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


async def test_chat_request_follows_the_engine_that_announced_its_tokens(model_dir):
    """End to end: engine 1 announces (KV events, vLLM block size 4 here) the token ids the
    template gives for this conversation; the chat request goes to engine 1; a request whose
    template is rejected gets a 400."""
    pubs = [FakeEngine("map", "int", block_size=4) for _ in range(2)]
    engines = []
    for _ in range(2):
        s = TestServer(create_engine_app(EmulatorConfig(role="mixed", speed=50.0)), host="127.0.0.1")
        await s.start_server()
        engines.append(s)
    cfg = ServiceConfig.model_validate({
        "pd_protocol": "none", "port": 0, "block_size": 4, "index_mode": "events", "tokenizer_path": str(model_dir),
        "health_check": {"enabled": False}, "decode_policy": {"name": "cache_aware"},
        "workers": [{"url": f"http://127.0.0.1:{s.port}", "role": "mixed", "events": p.endpoint}
                    for s, p in zip(engines, pubs)]})
    router = TestServer(create_app(cfg), host="127.0.0.1")
    await router.start_server()
    try:
        await asyncio.sleep(0.5)
        pubs[1].publish([pubs[1].stored(IDS[:20])[1]])
        svc = router.app[SERVICE]
        end = time.monotonic() + 10
        while svc.router.index.num_blocks() < 5 and time.monotonic() < end:
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
            r = await s.post(url, json={"messages": MESSAGES, "max_tokens": 2})
            assert r.status == 200
            assert [len(e.app[STATE].log) for e in engines] == [0, 1]
            r = await s.post(url, json={"messages": [{"role": "tool", "content": "x"}]})
            assert r.status == 400 and "unknown role tool" in (await r.json())["error"]["message"]
    finally:
        await router.close()
        for e in engines:
            await e.close()
        for p in pubs:
            p.close()
