"""Findings of the fresh-user review (docs/serving.md, README, --help tried as a new user would),
each a case that failed before its fix. Expected values are worked out by hand from the inputs.
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
