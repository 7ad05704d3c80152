"""Engine-exact chat prompts: pdlb's token ids equal the reference's, hence its block hashes.

Reference: transformers' ``apply_chat_template`` (installed from the registry; no torch needed for
templates) on the messages as each engine hands them over, then the tokenizer with the request's
``add_special_tokens``. What the engines do before calling it is theirs, read from their code:
vLLM 0.33 joins a string template's text parts with "\\n" (``renderers/chat_utils/chat_message.py``)
and passes ``chat_template_kwargs`` the template names (``renderers/hf.py``); SGLang 0.5.23 joins
them with " " and, with ``continue_final_message``, renders without the final assistant message
and appends its tokens (``serving_chat.py``). The model folder is built here: a byte-level BPE
trained on a few sentences (every text tokenises), a BOS post-processor (so
``add_special_tokens`` matters), and two templates: one that reads content as a string, one that
loops over content parts (vLLM/SGLang then keep the parts).
"""

from __future__ import annotations

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from balancer.hashing import hash_token_blocks  # noqa: E402
from balancer.service.prompt import ChatTemplate, PromptError, PromptHasher, extract_prompt  # noqa: E402

SPECIALS = ["<s>", "<|start|>", "<|end|>", "<|eot|>"]
STRING_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start|>system<|end|>\n\nTools: {{ tools | tojson }}<|eot|>{% endif %}"
    "{% if custom_system is defined %}<|start|>system<|end|>\n\n{{ custom_system }}<|eot|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n\n"
    "{% if m.get('reasoning_content') and enable_thinking is not false %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
    "{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% if enable_thinking is false %}<think></think>"
    "{% endif %}{% endif %}")
PARTS_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):  # noqa: ANN001, ANN201
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["you are a helpful assistant", "tell me the weather in Paris today",
                             "get_weather city string object function"] * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    out = {}
    for name, template in (("string", STRING_TEMPLATE), ("parts", PARTS_TEMPLATE)):
        d = tmp_path_factory.mktemp(name)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>",
                                                             "eos_token": "<|eot|>"}))
        out[name] = d
    return out


def reference_ids(folder, messages, body) -> list[int]:  # noqa: ANN001
    """transformers' apply_chat_template, then encode with the request's add_special_tokens."""
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>",
                                               eos_token="<|eot|>",
                                               chat_template=json.loads((folder / "tokenizer_config.json").read_text())[
                                                   "chat_template"])
    kwargs = dict(body.get("chat_template_kwargs") or {})
    text = ref.apply_chat_template(messages, tools=body.get("tools"), documents=body.get("documents"), tokenize=False,
                                   add_generation_prompt=body.get("add_generation_prompt", True),
                                   continue_final_message=body.get("continue_final_message", False), **kwargs)
    return ref.encode(text, add_special_tokens=body.get("add_special_tokens", False))


def pdlb_ids(folder, body, engine="vllm"):  # noqa: ANN001, ANN201
    h = PromptHasher(16, tokenizer_path=str(folder), engine=engine)
    notes: list[str] = []
    h.on_inexact = notes.append
    prompt = extract_prompt("chat", body)
    ids = h.token_ids(prompt)
    once = list(notes)  # one request, counted once per hashing
    assert h.hash(prompt)[1] == tuple(hash_token_blocks(ids, 16)) and notes == once * 2
    return ids, once


USER = {"role": "user", "content": "tell me the weather in Paris today"}
SYSTEM = {"role": "system", "content": "you are a helpful assistant"}


@pytest.mark.parametrize("case, body, engine_messages", [
    # (name, request body, the messages the engine hands to apply_chat_template: by vLLM's rules)
    ("tools", {"messages": [SYSTEM, USER], "tools": TOOLS}, [SYSTEM, USER]),
    ("text parts joined by a newline", {"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": "tell me"}, {"type": "text", "text": "the weather"}]}]},
     [SYSTEM, {"role": "user", "content": "tell me\nthe weather"}]),
    ("add_special_tokens", {"messages": [USER], "add_special_tokens": True}, [USER]),
    ("no generation prompt", {"messages": [USER], "add_generation_prompt": False}, [USER]),
    ("continue_final_message", {"messages": [USER, {"role": "assistant", "content": "the weather in Paris is "}],
                                "add_generation_prompt": False, "continue_final_message": True},
     [USER, {"role": "assistant", "content": "the weather in Paris is "}]),
    ("chat_template_kwargs", {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False,
                                                                            "custom_system": "be brief"}},
     [USER]),
    ("tool call arguments and reasoning", {"messages": [USER, {
        "role": "assistant", "content": "", "reasoning_content": "need the weather",
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1"}], "tools": TOOLS},
     [USER, {"role": "assistant", "content": "", "reasoning_content": "need the weather",
             "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "sunny", "tool_call_id": "1"}]),
    ("developer role, template without it", {"messages": [USER, {"role": "developer", "content": "be brief"},
                                                           {"role": "system", "content": "you are a helpful assistant"}]},
     [{"role": "system", "content": "be brief\n\nyou are a helpful assistant"}, USER]),
])
def test_vllm_chat_prompts_match_apply_chat_template(folders, case, body, engine_messages):
    ids, notes = pdlb_ids(folders["string"], body)
    assert ids == reference_ids(folders["string"], engine_messages, body), case
    assert notes == []


def test_chat_template_kwargs_a_template_does_not_name_are_not_passed():
    # vLLM resolve_chat_template_kwargs: only the template's variables (else `x is defined` would flip)
    t = ChatTemplate("{% if foo is defined %}FOO{% endif %}{{ messages[0]['content'] }}")
    from balancer.service.prompt import ChatOptions
    assert t.render_for([USER], ChatOptions(chat_template_kwargs={"bar": 1}))[0] == USER["content"]
    assert t.render_for([USER], ChatOptions(chat_template_kwargs={"foo": 1}))[0] == "FOO" + USER["content"]


def test_a_template_that_loops_over_content_parts_gets_them(folders):
    parts = {"role": "user", "content": [{"type": "text", "text": "tell me"}, {"type": "text", "text": "the weather"}]}
    body = {"messages": [parts]}
    assert ChatTemplate.from_folder(folders["parts"]).content_format == "openai"
    assert ChatTemplate.from_folder(folders["string"]).content_format == "string"
    ids, notes = pdlb_ids(folders["parts"], body)
    assert ids == reference_ids(folders["parts"], [parts], body) and notes == []


def test_sglang_rendering(folders):
    # SGLang joins text parts with a space
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "tell me"},
                                                      {"type": "text", "text": "the weather"}]}]}
    ids, _ = pdlb_ids(folders["string"], body, engine="sglang")
    assert ids == reference_ids(folders["string"], [{"role": "user", "content": "tell me the weather"}], body)
    # continue_final_message: rendered without the final assistant message (generation prompt on),
    # then the message's own tokens appended
    prefix = "the weather in Paris is "
    body = {"messages": [USER, {"role": "assistant", "content": prefix}], "continue_final_message": True}
    ids, _ = pdlb_ids(folders["string"], body, engine="sglang")
    tok = tokenizers.Tokenizer.from_file(str(folders["string"] / "tokenizer.json"))
    assert ids == reference_ids(folders["string"], [USER], {}) + tok.encode(prefix, add_special_tokens=False).ids
    # a final assistant message without add_generation_prompt given becomes a user message
    body = {"messages": [USER, {"role": "assistant", "content": "sunny"}]}
    ids, _ = pdlb_ids(folders["string"], body, engine="sglang")
    assert ids == reference_ids(folders["string"], [USER, {"role": "user", "content": "sunny"}], {})


def test_what_pdlb_cannot_render_exactly_is_counted(folders, tmp_path):
    image = {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}
    assert pdlb_ids(folders["string"], {"messages": [image]})[1] == ["multimodal"]
    assert pdlb_ids(folders["string"], {"messages": [USER], "chat_template": "{{ messages }}"})[1] == [
        "request_chat_template"]
    (tmp_path / "tokenizer.json").write_text((folders["string"] / "tokenizer.json").read_text())
    assert pdlb_ids(tmp_path, {"messages": [USER]})[1] == ["no_chat_template"]


@pytest.mark.parametrize("files, engine, want", [
    # vLLM 0.33 picks its own encoder for these (vllm/config/model.py, tokenizer_mode "auto" by
    # architecture; vllm/tokenizers/registry.py, Mistral by tekken.json / tokenizer.model.v*)
    ({"config.json": {"architectures": ["DeepseekV4ForCausalLM"]}}, "vllm", "deepseek_v4"),
    ({"config.json": {"architectures": ["DeepseekV32ForCausalLM"]}}, "vllm", "deepseek_v32"),
    ({"tekken.json": {}}, "vllm", "mistral"),
    ({"config.json": {"architectures": ["DeepseekV4ForCausalLM"]}}, "sglang", None),  # SGLang: the template
    ({"config.json": {"architectures": ["LlamaForCausalLM"]}}, "vllm", None),
    ({"config.json": "not json"}, "vllm", None),
])
def test_chat_an_engine_renders_with_its_own_encoder_is_counted(folders, tmp_path, files, engine, want):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((folders["string"] / name).read_text())
    for name, doc in files.items():
        (tmp_path / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    h = PromptHasher(16, tokenizer_path=str(tmp_path), engine=engine)
    assert h.engine_renderer == want
    notes: list[str] = []
    h.on_inexact = notes.append
    h.token_ids(extract_prompt("chat", {"messages": [USER]}))
    assert notes == (["engine_renderer"] if want else [])
    notes.clear()
    h.token_ids(extract_prompt("completions", {"prompt": "plain text"}))  # no chat: rendered by no one
    assert notes == []


@pytest.mark.parametrize("body, match", [
    ({"messages": [USER], "tools": "x"}, "'tools' must be an array"),
    ({"messages": [USER], "add_special_tokens": "yess"}, "'add_special_tokens' must be a boolean"),
    ({"messages": [USER], "chat_template_kwargs": [1]}, "'chat_template_kwargs' must be an object"),
    ({"messages": [USER], "add_generation_prompt": True, "continue_final_message": True}, "cannot set both"),
])
def test_mistyped_chat_fields_are_clear_errors(body, match):
    with pytest.raises(PromptError, match=match):
        extract_prompt("chat", body)


def test_continue_final_message_without_the_text_in_the_render_is_an_error(folders):
    t = ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    from balancer.service.prompt import ChatOptions
    with pytest.raises(PromptError, match="drops the final message"):
        t.render_for([USER, {"role": "assistant", "content": "x"}], ChatOptions(continue_final_message=True,
                                                                                 add_generation_prompt=False))


async def test_the_service_counts_inexact_prompts_and_refuses_mistyped_fields(folders):
    """End to end through pdlb serve (one emulated engine): a chat with an image part is counted
    in pdlb_prompt_inexact_total{reason="multimodal"}; mistyped `tools` is a 400."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from balancer.service.app import create_app
    from balancer.service.config import ServiceConfig
    from sim.emulator.app import create_engine_app
    from sim.emulator.config import EmulatorConfig

    engine = TestServer(create_engine_app(EmulatorConfig(role="mixed", speed=50.0)), host="127.0.0.1")
    await engine.start_server()
    cfg = ServiceConfig.model_validate({
        "pd_protocol": "none", "port": 0, "block_size": 16, "tokenizer_path": str(folders["string"]),
        "chat_engine": "vllm", "health_check": {"enabled": False},
        "workers": [{"url": f"http://127.0.0.1:{engine.port}", "role": "mixed"}]})
    router = TestServer(create_app(cfg), host="127.0.0.1")
    await router.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{router.port}"
            image = {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                 {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}
            await s.post(f"{base}/v1/chat/completions", json={"messages": [image], "max_tokens": 2})
            await s.post(f"{base}/v1/chat/completions", json={"messages": [USER], "tools": TOOLS, "max_tokens": 2})
            r = await s.post(f"{base}/v1/chat/completions", json={"messages": [USER], "tools": "x"})
            assert r.status == 400 and "'tools' must be an array" in (await r.json())["error"]["message"]
            text = await (await s.get(f"{base}/metrics")).text()
        lines = [ln for ln in text.splitlines() if ln.startswith("pdlb_prompt_inexact_total")]
        assert lines == ['pdlb_prompt_inexact_total{reason="multimodal"} 1.0']
    finally:
        await router.close()
        await engine.close()
