"""Chat and completion request options as the engines read them: ``chat_template_kwargs`` naming a
request field are dropped (not a 500), a completion's ``add_special_tokens`` is honoured as each
engine does (a mistyped one is a 400), and ``--chat-engine`` without a tokenizer is warned about.
Expected prompts and token ids are worked out by hand from the inputs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jinja2")

from balancer.service.prompt import ChatOptions, ChatTemplate  # noqa: E402

#: a minimal template naming tools, documents and one free variable of its own
TEMPLATE = ("{% if tools %}T{{ tools | length }};{% endif %}{% if documents %}D;{% endif %}"
            "{% if custom %}C={{ custom }};{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):  # noqa: ANN001, ANN201
    """A lone tokenizer.json whose post-processor adds a BOS token ``<s>`` (as Llama's does)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["tell me the weather in Paris today"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path = tmp_path_factory.mktemp("bos") / "tokenizer.json"
    tok.save(str(path))
    return tok, str(path)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("clash", [{"messages": 5}, {"tools": 5}, {"add_generation_prompt": "x"},
                                   {"continue_final_message": True}, {"documents": 7}])
def test_chat_template_kwargs_naming_a_request_field_are_dropped_not_a_500(engine, clash):
    """`chat_template_kwargs: {"messages": 5}` (or tools / add_generation_prompt / ...) raised
    TypeError "got multiple values for argument" in render_for, which the service answered 500
    "internal router error". The request's own fields win; the prompt is counted inexact."""
    t = ChatTemplate(TEMPLATE)
    inexact: list[str] = []
    text, suffix = t.render_for([USER], ChatOptions(chat_template_kwargs={**clash, "custom": 1}), engine, inexact)
    # by hand: no tools, no documents, custom=1 (vLLM passes it: the template names it), the user
    # message, the generation prompt (add_generation_prompt defaults to true)
    assert text == "C=1;<user>hi<assistant>"
    assert suffix is None
    assert inexact == ["chat_template_kwargs"]


def test_chat_template_kwargs_without_a_clash_are_not_counted():
    inexact: list[str] = []
    text, _ = ChatTemplate(TEMPLATE).render_for([USER], ChatOptions(chat_template_kwargs={"custom": "x"}),
                                                "vllm", inexact)
    assert (text, inexact) == ("C=x;<user>hi<assistant>", [])


@pytest.mark.parametrize("engine,special,bos_expected", [
    ("vllm", None, True),    # vLLM CompletionRequest.add_special_tokens defaults to true
    ("vllm", True, True),
    ("vllm", False, False),  # honoured: the engine's prompt has no BOS
    ("sglang", False, True),  # SGLang's CompletionRequest has no such field: its default, BOS added
])
def test_a_completion_add_special_tokens_is_honoured_as_the_engine_does(bos_tokenizer, engine, special, bos_expected):
    """`/v1/completions` with `add_special_tokens: false` hashed the prompt with a BOS token that
    vLLM then leaves out: every block of the prompt shifted by one token, no prefix hit ever
    matched the engine's KV events. Expected ids by hand: the BOS id, then the text's ids."""
    from balancer.service.prompt import PromptHasher, extract_prompt
    tok, path = bos_tokenizer
    text = "tell me the weather in Paris today"
    body: dict = {"prompt": text, "max_tokens": 1}
    if special is not None:
        body["add_special_tokens"] = special
    ids = PromptHasher(4, tokenizer_path=path, engine=engine).token_ids(extract_prompt("completions", body))
    plain = tok.encode(text, add_special_tokens=False).ids
    bos = tok.token_to_id("<s>")
    assert ids == ([bos] + plain if bos_expected else plain)


def test_a_mistyped_completion_add_special_tokens_is_a_400_error():
    from balancer.service.prompt import PromptError, extract_prompt
    with pytest.raises(PromptError, match="'add_special_tokens' must be a boolean"):
        extract_prompt("completions", {"prompt": "hi", "add_special_tokens": "nope"})  # "no" is a boolean (lax_bool)


def test_chat_engine_without_a_tokenizer_is_warned_about(bos_tokenizer):
    """`pdlb serve --chat-engine sglang` without `--tokenizer` started silently; the option does
    nothing then (chat prompts are hashed as text chunks)."""
    from balancer.service.config import ServiceConfig, config_warnings
    base = {"pd_protocol": "none", "workers": [{"url": "http://127.0.0.1:8000", "role": "mixed"}]}
    warned = config_warnings(ServiceConfig.model_validate({**base, "chat_engine": "sglang"}))
    assert [w for w in warned if "chat_engine" in w] == [
        "warning: chat_engine sglang has no effect without a tokenizer: chat prompts are hashed as text chunks "
        "(give --tokenizer MODEL_DIR to render them as sglang does)"]
    assert not [w for w in config_warnings(ServiceConfig.model_validate(base)) if "chat_engine" in w]
    with_tok = ServiceConfig.model_validate({**base, "chat_engine": "sglang", "tokenizer_path": bos_tokenizer[1]})
    assert not [w for w in config_warnings(with_tok) if "chat_engine" in w]
