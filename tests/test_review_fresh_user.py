"""Findings of the fresh-user review (docs/serving.md, README, --help tried as a new user would),
each a case that failed before its fix. Expected values are worked out by hand from the inputs.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("jinja2")

from balancer.service.prompt import ChatOptions, ChatTemplate  # noqa: E402

#: a minimal template naming tools, documents and one free variable of its own
TEMPLATE = ("{% if tools %}T{{ tools | length }};{% endif %}{% if documents %}D;{% endif %}"
            "{% if custom %}C={{ custom }};{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
USER = {"role": "user", "content": "hi"}


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


def test_a_restarted_engine_whose_first_batches_were_lost_while_reconnecting_is_resynced():
    """Tried by hand (SGLang 0.5.23's own publisher behind `pdlb serve --index-mode events`): an
    engine restarted and published a few batches (numbered below the old last one) before the SUB
    socket reconnected, then nothing more. The predecessor's view stayed credited to it for
    minutes (until something else cleared it): the restart check waited for a next live batch.
    Now the reconnect itself asks a replay from the last applied number; the new engine holds
    nothing from there on, so its view is cleared and rebuilt from its buffer (replay from 0).
    Expected routes by construction: the prompts each engine was given. About 2 s."""
    pytest.importorskip("zmq")
    from tests.test_engine_conformance import PROBES_PER_ENGINE, Cluster, _fill, prompt
    c = Cluster("sglang")
    try:
        c.connected()
        want = _fill(c)
        c.wait_routed(want, time.monotonic(), what="before the restart")
        old_a = want["a"]
        c.a.restart()
        fresh = [prompt(600 + i, tag=5) for i in range(2)]  # 2 batches: numbers 0, 1 < the old last
        assert c.stats("a")["last_seq"] >= PROBES_PER_ENGINE  # the old numbering went past them
        c.a.drop_next(len(fresh))  # lost on the wire, as while the SUB socket reconnects
        for t in fresh:
            c.a.store(t)
        c.a.wait_sent(len(fresh))
        want["a"] = fresh
        c.wait_routed(want, time.monotonic(), bound_s=5.0, what="restart, its batches lost, nothing after")
        assert all(c.held_blocks("a", t) == 0 for t in old_a), "the old engine's blocks are still credited to it"
        assert c.stats("a")["restarts"] == 1
    finally:
        c.close()


def test_the_subscriber_child_process_logs_in_the_routers_format(capfd):
    """`pdlb serve` (runner: process, the default) printed the child's lines bare, e.g.
    `KV events of http://127.0.0.1:31100/dp0: nothing for 60 s (stale)` beside the router's
    `2026-12-04 21:56:33,188 ERROR pdlb.kv_events: ...`, and dropped its INFO lines: a spawned child
    starts with no logging set up. It now takes the router's format and level. Expected line by
    hand: the format below applied to the stale warning of a source that never publishes."""
    pytest.importorskip("zmq")
    import logging
    import re

    from balancer.service.kv_subscriber import KvEventSource, KvEventSubscriberProcess
    from balancer.types import ReplicaId
    from tests.kv_publisher import free_port

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    sub = KvEventSubscriberProcess([KvEventSource(ReplicaId("http://silent", 0), f"tcp://127.0.0.1:{free_port()}")],
                                   64, lambda items: None, stale_after_s=0.3)
    try:
        sub.start()
        deadline = time.monotonic() + 10
        err = ""
        while time.monotonic() < deadline and "stale" not in err:
            time.sleep(0.2)
            err += capfd.readouterr().err
    finally:
        sub.stop()
        root.handlers, _ = saved[0], root.setLevel(saved[1])
    line = next((ln for ln in err.splitlines() if "stale" in ln), "")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING pdlb\.kv_events: KV events of "
                        r"http://silent/dp0: nothing for \d+ s \(stale\)", line), err


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
