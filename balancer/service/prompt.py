"""Request body -> prompt text or token ids -> (prompt length, chained block hashes).

The router sees OpenAI / SGLang request bodies, not token ids. Two ways to get the block hashes
the prefix index (:mod:`balancer.prefix_index`) matches on:

* **Tokenizer configured** (``tokenizer_path``: a local model folder with ``tokenizer.json`` and
  ``tokenizer_config.json``, or a lone ``tokenizer.json``; loaded with the optional ``tokenizers``
  package): the prompt is tokenised as the engine tokenises it and full ``block_size``-token
  blocks are hashed with :func:`balancer.hashing.hash_token_blocks`, so they equal the pdlb hashes
  the router derives from the engine's KV events (:mod:`balancer.kv_translate`). Completion and
  ``/generate`` text: ``encode(text, add_special_tokens=True)`` (vLLM's and SGLang's default, e.g.
  a BOS token; a completion's ``add_special_tokens: false`` is honoured with ``engine="vllm"``,
  whose completions have the field). Chat: the folder's chat template (``tokenizer_config.json`` ``chat_template``, or
  ``chat_template.jinja``) is rendered with jinja2 as HuggingFace's ``apply_chat_template`` does
  (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``add_generation_prompt=True``, ``bos_token``/
  ``eos_token`` from the config, ``raise_exception``), then encoded with
  ``add_special_tokens=False``, the way vLLM's chat endpoint does; a template that raises (e.g.
  roles that do not alternate) is a 400. Without a template (a lone ``tokenizer.json``) chat
  messages are rendered as ``"<role>: <content>\n"`` lines (:func:`render_messages`), which
  does not match the engine's tokens.
* **No tokenizer** (default): fixed-size character chunks of ``block_size * chars_per_token``
  characters are hashed with :func:`balancer.hashing.text_chunk_hashes`, and the prompt length is
  estimated as ``ceil(chars / chars_per_token)``. Approximate, like SGLang's character radix tree
  (ANCHORS.md, "SGLang cache_aware"): no tokenizer cost per request, prefix matches are exact at
  chunk granularity, token counts are estimates (off by the text's real chars/token ratio).

Prompts given as token ids (``prompt: [int, ...]`` in ``/v1/completions``, ``input_ids`` in
``/generate``) are always hashed exactly.

Functions here are pure (no I/O) except :func:`load_tokenizer`, which the service calls once at
startup; request errors are :class:`PromptError` (the service maps them to 400).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from balancer.hashing import hash_token_blocks, text_chunk_hashes

__all__ = ["ChatOptions", "ChatTemplate", "Prompt", "PromptError", "PromptHasher", "extract_prompt", "load_tokenizer", "render_messages"]


class PromptError(ValueError):
    """The request body has no usable prompt (missing or mistyped field)."""


@functools.cache
def _bool_adapter() -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(bool)


def lax_bool(value: Any, name: str) -> bool | None:
    """A request's boolean field read the way vLLM's and SGLang's request models read it
    (pydantic v2 ``bool`` in its default lax mode, e.g. vLLM 0.33 ``CompletionRequest.stream`` and
    SGLang 0.5.23's; pdlb validates with the same library): ``true``/``false``, the numbers 0 and
    1 (integer or float), and the strings ``"1" "0" "true" "false" "t" "f" "yes" "no" "y" "n" "on"
    "off"`` in any case. ``None`` (absent or ``null``) stays ``None``.

    Raises:
        PromptError: anything else (``2``, ``"maybe"``, ``""``, an array, ...), naming ``name``.
    """
    if value is None or type(value) is bool:
        return value
    from pydantic import ValidationError

    if isinstance(value, (str, int, float)) and not (isinstance(value, str) and len(value) > 5):  # "false": 5
        try:
            return bool(_bool_adapter().validate_python(value))
        except ValidationError:
            pass
    raise PromptError(f"'{name}' must be a boolean")


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The chat request fields that change the prompt an engine renders (vLLM 0.33
    ``ChatCompletionRequest``, SGLang 0.5.23 the same names), with the engines' defaults."""

    tools: list[Any] | None = None
    add_generation_prompt: bool | None = None  # None: not given (True in vLLM; SGLang then turns a final assistant message into a user one)
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None
    reasoning_effort: str | None = None
    chat_template: str | None = None  # a per-request template: pdlb cannot render it exactly (counted)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the router sees it: text, or token ids (exactly one is set); for
    chat also the ``messages`` (``text`` is then their :func:`render_messages` rendering) and the
    request's :class:`ChatOptions`."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: list[Any] | None = field(default=None, compare=False)
    chat: ChatOptions | None = field(default=None, compare=False)
    #: a completion's ``add_special_tokens`` (vLLM 0.33 ``CompletionRequest``, default true; SGLang's
    #: completions have no such field); ``None``: not given
    add_special_tokens: bool | None = field(default=None, compare=False)


def _chat_options(body: dict[str, Any]) -> ChatOptions:
    """The :class:`ChatOptions` of a chat body. Raises :class:`PromptError` on a mistyped field
    (the engines answer 400 to the same)."""
    def opt_bool(name: str, default: bool | None) -> bool | None:
        v = lax_bool(body.get(name), name)
        return default if v is None else v

    def opt(name: str, kind: type, what: str) -> Any:
        v = body.get(name)
        if v is not None and not isinstance(v, kind):
            raise PromptError(f"'{name}' must be {what}")
        return v

    tools = opt("tools", list, "an array of tools")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise PromptError("'tools' must be an array of objects")
    documents = opt("documents", list, "an array of objects")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise PromptError("'documents' must be an array of objects")
    agp = opt_bool("add_generation_prompt", None)
    cont = bool(opt_bool("continue_final_message", False))
    if cont and agp:  # vLLM and SGLang refuse the pair
        raise PromptError("cannot set both 'continue_final_message' and 'add_generation_prompt' to true")
    return ChatOptions(tools=tools, add_generation_prompt=agp, continue_final_message=cont,
                       add_special_tokens=bool(opt_bool("add_special_tokens", False)),
                       chat_template_kwargs=opt("chat_template_kwargs", dict, "an object"), documents=documents,
                       reasoning_effort=opt("reasoning_effort", str, "a string"),
                       chat_template=opt("chat_template", str, "a string"))


def render_messages(messages: Any) -> str:
    """Chat messages -> one string, ``"<role>: <content>\\n"`` per message.

    ``content`` may be a string or a list of parts (``{"type": "text", "text": ...}``; other part
    types contribute their type name, so images still change the hash).

    Raises:
        PromptError: ``messages`` is not a non-empty list of objects with a ``role``.
    """
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty array")
    out: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict):
                    parts.append(str(p.get("text", "")) if p.get("type") == "text" else f"<{p.get('type')}>")
                else:
                    parts.append(str(p))
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            content = str(content)
        out.append(f"{m['role']}: {content}\n")
    return "".join(out)


TOKEN_ID_LIMIT = 2**32
"""Token ids must be below this (block hashes serialise them as ``uint32``; vocabularies are far smaller)."""


def _token_list(value: Any, field: str) -> tuple[int, ...]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < TOKEN_ID_LIMIT for t in value):
        raise PromptError(f"'{field}' must be a non-empty string or array of token ids in 0..{TOKEN_ID_LIMIT - 1}")
    return tuple(value)


EMPTY_PROMPT = "'prompt' must not be empty: a non-empty string, array of strings, or array of token ids"
"""The 400's message for an empty completions prompt (``""``, ``[]``, or strings all empty): SGLang's
OpenAI server refuses these with 400 "Prompt cannot be empty" (``OpenAIServingCompletion.
_validate_request``, 0.5.23), vLLM's ``""`` with 400 "Either prompt or prompt_embeds must be provided
and non-empty." (``CompletionRequest.validate_prompt_and_prompt_embeds``, 0.33) and an empty token
list with 400 "The decoder prompt cannot be empty"."""


def extract_prompt(endpoint: str, body: dict[str, Any]) -> Prompt:
    """The prompt of a request body.

    Args:
        endpoint: ``"completions"`` (``prompt``: string, array of strings, token ids, or array of
            token-id arrays; batches are routed by their concatenation), ``"chat"`` (``messages``)
            or ``"generate"`` (SGLang: ``text`` or ``input_ids``; ``input_ids`` where both are
            given, as SGLang prefills them).
        body: the parsed JSON object.

    Raises:
        PromptError: the required field is missing or has the wrong type, or a completions
            prompt is empty (:data:`EMPTY_PROMPT`; chat: no messages).
    """
    if endpoint == "chat":
        messages = body.get("messages")
        return Prompt(text=render_messages(messages), messages=messages, chat=_chat_options(body))
    if endpoint == "generate":
        # both given: SGLang 0.5.23 takes them (GenerateReqInput refuses only none, or text,
        # input_ids and input_embeds all three) and prefills input_ids, text unused
        # (TokenizerManager._tokenize_one_request), so the ids are what its KV cache holds
        if isinstance(body.get("input_ids"), list):
            return Prompt(token_ids=_token_list(body["input_ids"], "input_ids"))
        if isinstance(body.get("text"), str):
            return Prompt(text=body["text"])
        raise PromptError("'text' (string) or 'input_ids' (array of token ids) is required")
    if endpoint != "completions":
        raise ValueError(f"unknown endpoint {endpoint!r}")
    p = body.get("prompt")
    special = lax_bool(body.get("add_special_tokens"), "add_special_tokens")
    if isinstance(p, str):
        if not p:
            raise PromptError(EMPTY_PROMPT)
        return Prompt(text=p, add_special_tokens=special)
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            if not any(p):
                raise PromptError(EMPTY_PROMPT)
            return Prompt(text="".join(p), add_special_tokens=special)
        if all(isinstance(x, list) for x in p):
            return Prompt(token_ids=_token_list([t for x in p for t in x], "prompt"))
        return Prompt(token_ids=_token_list(p, "prompt"))
    if isinstance(p, list):
        raise PromptError(EMPTY_PROMPT)
    raise PromptError("'prompt' is required: a string, an array of strings, or an array of token ids")


def max_output_tokens(endpoint: str, body: dict[str, Any], default: int) -> int:
    """The output-token limit a request asks for: ``sampling_params.max_new_tokens`` on SGLang's
    ``/generate``, else ``max_completion_tokens`` or ``max_tokens`` (OpenAI); ``default`` if none.

    Raises:
        PromptError: the limit is not a positive integer (the caller answers 400).
    """
    if endpoint == "generate":
        sp = body.get("sampling_params")
        v = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    else:
        v = body.get("max_completion_tokens", body.get("max_tokens"))
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PromptError("'max_tokens' must be a positive integer")
    return v


def load_tokenizer(path: str | Path) -> Any:
    """Load a HuggingFace ``tokenizer.json`` (a ``tokenizers.Tokenizer``) from a local file, or
    from a model folder holding one.

    Raises:
        ValueError: the file does not exist, is not a regular file, or ``tokenizers`` cannot parse
            it; the message starts with ``tokenizer_path <path>:``.
        RuntimeError: the optional ``tokenizers`` package is not installed.
    """
    p = Path(path)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer_path {p}: the folder has no tokenizer.json")
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"tokenizer_path {p}: no such file (give a local tokenizer.json)")
    try:
        from tokenizers import Tokenizer  # optional dependency
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("tokenizer_path needs the 'tokenizers' package (pip install 'pdlb[tokenizer]')") from e
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise ValueError(f"tokenizer_path {p}: not a valid tokenizer.json ({e})") from None


def _token_text(v: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    """A model's chat template, rendered with jinja2 as HuggingFace's ``apply_chat_template`` does.

    Args:
        template: the jinja2 source.
        special_tokens: ``bos_token``, ``eos_token``, ... passed to the template.

    Raises:
        ValueError: the template does not compile (the message names the jinja2 error).
    """

    def __init__(self, template: str, special_tokens: dict[str, str] | None = None) -> None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise PromptError(f"chat template: {message}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            self._template = env.from_string(template)
            ast = env.parse(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        import jinja2.meta
        self.source = template
        #: the template's free variables (request ``chat_template_kwargs`` vLLM passes on are those)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        #: ``"openai"`` when the template loops over a message's content parts, else ``"string"``
        self.content_format = _content_format(ast)
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate | None:
        """The template of a HuggingFace model folder (``chat_template.jinja``, else
        ``tokenizer_config.json`` ``chat_template``: a string, or a list of ``{name, template}``
        from which ``default`` or the first is taken), or ``None`` if it has none.

        Raises:
            ValueError: an unreadable ``tokenizer_config.json`` or a template that does not compile.
        """
        d = Path(folder)
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"tokenizer_path {d}: tokenizer_config.json is not readable JSON ({e})") from None
        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        else:
            t = cfg.get("chat_template")
            if isinstance(t, list):
                named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
                t = named.get("default") or next(iter(named.values()), None)
            template = t if isinstance(t, str) else None
        if template is None:
            return None
        tokens = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                  if (v := _token_text(cfg.get(k))) is not None}
        return cls(template, tokens)

    def render(self, messages: list[Any], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` (``extra``: further template variables, e.g. ``tools``).

        Raises:
            PromptError: the template raised (``raise_exception``) or failed on these messages.
        """
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **extra})
        except PromptError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise PromptError(f"chat template failed on these messages: {e}") from None

    def render_for(self, messages: list[Any], options: ChatOptions | None, engine: str = "vllm",
                   inexact: list[str] | None = None) -> tuple[str, str | None]:
        """``(prompt text, suffix)`` as ``engine`` (``"vllm"`` or ``"sglang"``) renders a chat
        request: the text goes through the tokenizer with ``options.add_special_tokens``, the
        suffix (SGLang's continued final message, else ``None``) without special tokens, and the
        two token lists are concatenated. Sources: vLLM 0.33 ``ChatCompletionRequest.
        build_chat_params`` and ``renderers/hf.py`` (``safe_apply_chat_template``,
        ``resolve_chat_template_kwargs``: request kwargs reach the template only if it names
        them), which call transformers' ``apply_chat_template`` (``continue_final_message``: the
        render is cut right after the final message's text); SGLang 0.5.23 ``serving_chat.py``
        (a final assistant message is removed and its text appended after the generation prompt
        when continued, turned into a user message when ``add_generation_prompt`` is not given).
        Reasons pdlb cannot be exact are appended to ``inexact``.

        Raises:
            PromptError: the template raised, or ``continue_final_message`` cannot be honoured.
        """
        o = options or ChatOptions()
        notes = inexact if inexact is not None else []
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if o.chat_template is not None:
            notes.append("request_chat_template")
        msgs = _engine_messages(messages, engine, self.content_format, notes)
        user_kwargs = dict(o.chat_template_kwargs or {})
        # Variables pdlb sets from the request itself: a request kwarg of the same name cannot also
        # reach the template (the engines call the template with those names bound: vLLM's
        # merge_kwargs lets the request field win, a second ``messages`` / ``tools`` is a TypeError
        # in both engines), so the field wins here and the prompt is counted inexact.
        clash = sorted(k for k in user_kwargs if k in _BOUND_TEMPLATE_VARS)
        if clash:
            notes.append("chat_template_kwargs")
            user_kwargs = {k: v for k, v in user_kwargs.items() if k not in _BOUND_TEMPLATE_VARS}
        if engine == "sglang":
            suffix = None
            agp = o.add_generation_prompt
            if (agp is None or o.continue_final_message) and msgs and msgs[-1].get("role") == "assistant" \
                    and isinstance(msgs[-1].get("content"), str):
                if o.continue_final_message:
                    suffix = msgs[-1]["content"]
                    msgs = msgs[:-1]
                else:
                    msgs[-1] = {"role": "user", "content": msgs[-1]["content"]}
            kw: dict[str, Any] = {}
            if o.reasoning_effort is not None:
                kw["reasoning_effort"] = o.reasoning_effort
            kw.update(user_kwargs)
            text = self.render(msgs, agp is not False, tools=o.tools, documents=None, **kw)
            return text, suffix
        if any(m.get("role") == "developer" for m in msgs) and not (
                '"developer"' in self.source or "'developer'" in self.source):
            msgs = _developer_as_system(msgs)  # vLLM renderers/hf.py, for templates without that role
        # vLLM: documents and reasoning_effort always passed, request kwargs only if the template names them
        kw = {k: v for k, v in user_kwargs.items() if k in self.variables and k not in ("chat_template", "tokenize")}
        if "reasoning_effort" in self.variables:
            kw.setdefault("reasoning_effort", o.reasoning_effort)
        agp = True if o.add_generation_prompt is None else o.add_generation_prompt
        if not o.continue_final_message:
            return self.render(msgs, agp, tools=o.tools, documents=o.documents, **kw), None
        if not msgs or not isinstance(msgs[-1], dict):
            raise PromptError("continue_final_message is set but the conversation is empty")
        last = dict(msgs[-1])
        content = last.get("content")
        if isinstance(content, list):
            parts = [dict(p) for p in content]
            for p in reversed(parts):
                if "text" in p:
                    final = p["text"]
                    p["text"] = p["text"] + _CONTINUE_TAG
                    break
            else:
                raise PromptError("continue_final_message is set but the final message has no text to continue")
            last["content"] = parts
        elif isinstance(content, str):
            final = content
            last["content"] = content + _CONTINUE_TAG
        else:
            raise PromptError("continue_final_message is set but the final message has no content to continue")
        text = self.render(msgs[:-1] + [last], agp, tools=o.tools, documents=o.documents, **kw)
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise PromptError("continue_final_message is set but the chat template drops the final message's text")
        at = text.rindex(tag)
        return (text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()), None


def _content_format(ast: Any) -> str:
    """vLLM's and SGLang's content-format detection (vLLM ``renderers/hf.py``
    ``_detect_content_format``; SGLang ``jinja_template_utils``): ``"openai"`` when the template
    iterates over a message's ``content`` (``{% for part in message['content'] %}``, directly or
    through a variable set from it), else ``"string"`` (content parts are joined into one string)."""
    import jinja2.nodes as n

    def reads_content(x: Any) -> bool:
        return ((isinstance(x, n.Getitem) and isinstance(x.arg, n.Const) and x.arg.value == "content")
                or (isinstance(x, n.Getattr) and x.attr == "content"))

    names = {a.target.name for a in ast.find_all(n.Assign) if isinstance(a.target, n.Name) and reads_content(a.node)}
    for loop in ast.find_all(n.For):
        it = loop.iter
        if isinstance(it, n.Filter) and it.node is not None:  # e.g. message['content'] | selectattr(...)
            it = it.node
        if reads_content(it) or (isinstance(it, n.Name) and it.name in names):
            return "openai"
    return "string"


#: Content part types each engine reads as text (vLLM 0.33 ``TEXT_PART_TYPES``; SGLang 0.5.23
#: ``process_content_for_template_format``), and how it joins them for a ``"string"`` template.
_TEXT_PARTS = {"vllm": (frozenset({"text", "input_text", "output_text", "refusal", "thinking"}), "\n"),
               "sglang": (frozenset({"text", "input_text"}), " ")}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
#: template variables that :meth:`ChatTemplate.render_for` binds from request fields; the same
#: names in ``chat_template_kwargs`` are dropped (reason ``chat_template_kwargs``)
_BOUND_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"})
ENGINES = ("vllm", "sglang")


def _engine_messages(messages: list[Any], engine: str, content_format: str, inexact: list[str]) -> list[dict[str, Any]]:
    """``messages`` as ``engine`` hands them to the chat template: content parts joined (string
    templates) or kept as text parts (openai templates), non-text parts noted in ``inexact``
    (``"multimodal"``: their placeholders are the engine's processor's); vLLM also parses
    assistant ``tool_calls`` arguments from JSON into objects (``_postprocess_messages``)."""
    types_, sep = _TEXT_PARTS[engine]
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type", "text") in types_ and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif isinstance(part, dict) and part.get("type") == "text" and part.get("text") is None:
                    continue  # vLLM skips a text part without text
                else:
                    inexact.append("multimodal")
            m["content"] = sep.join(texts) if content_format == "string" else [{"type": "text", "text": t} for t in texts]
        if engine == "vllm" and m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            if not m["tool_calls"]:
                m.pop("tool_calls")
            else:
                calls = []
                for c in m["tool_calls"]:
                    c = dict(c) if isinstance(c, dict) else c
                    f = c.get("function") if isinstance(c, dict) else None
                    if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                        try:
                            args = json.loads(f["arguments"])
                        except ValueError:
                            args = {}
                        c["function"] = {**f, "arguments": args if isinstance(args, dict) else {}}
                    calls.append(c)
                m["tool_calls"] = calls
        if engine == "sglang":
            m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:  # transformers' apply_chat_template aliases them (both engines call it)
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.33's treatment of ``developer`` messages for a template that does not name that role
    (``_convert_developer_to_system`` then ``_consolidate_system_messages``): they become system
    messages (without ``tools``), and when a system message is not first or not alone, all system
    texts are merged, ``"\n\n"``-joined, into one first message."""
    out = [({k: v for k, v in m.items() if k != "tools"} | {"role": "system"}) if m.get("role") == "developer" else m
           for m in messages]
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(out):
        if m.get("role") != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(str(p["text"]) if isinstance(p, dict) else p for p in c
                           if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if c:
            texts.append(c)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else out


#: model architectures (config.json ``architectures``) whose chat vLLM 0.33 renders with its own
#: encoder instead of the folder's jinja template: ``ModelConfig`` sets ``tokenizer_mode`` from the
#: architecture when it is ``auto`` (vllm/config/model.py; renderers in vllm/renderers/deepseek_v*.py)
VLLM_OWN_RENDERER_ARCHS = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "DeepseekV4ForConditionalGeneration": "deepseek_v4",
    "DeepseekV41ForCausalLM": "deepseek_v41",
    "KimiK3ForConditionalGeneration": "kimi_k3",
    "InklingForCausalLM": "inkling",
    "InklingForConditionalGeneration": "inkling",
}


def engine_renderer(folder: str | Path, engine: str) -> str | None:
    """The tokenizer mode under which ``engine`` renders chat for the model in ``folder`` with its
    own code rather than the folder's chat template, or ``None``.

    vLLM 0.33 (``tokenizer_mode="auto"``): the architectures of :data:`VLLM_OWN_RENDERER_ARCHS`,
    and Mistral's tokenizer when the folder holds ``tekken.json`` or ``tokenizer.model.v*``
    (``vllm/tokenizers/registry.py``). SGLang renders with the folder's template: ``None``. An
    unreadable ``config.json`` is treated as naming no architecture.
    """
    if engine != "vllm":
        return None
    d = Path(folder)
    try:
        archs = json.loads((d / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        archs = []
    for arch in archs if isinstance(archs, list) else []:
        if isinstance(arch, str) and arch in VLLM_OWN_RENDERER_ARCHS:
            return VLLM_OWN_RENDERER_ARCHS[arch]
    if (d / "tekken.json").exists() or any(d.glob("tokenizer.model.v*")):
        return "mistral"
    return None


class PromptHasher:
    """Turns a :class:`Prompt` into ``(prompt_tokens, block_hashes)`` for :class:`balancer.types.Request`.

    Args:
        block_size: tokens per block (the router's ``block_size``).
        chars_per_token: characters per token assumed without a tokenizer (4 for English text).
        tokenizer_path: a local HuggingFace model folder (``tokenizer.json``, and
            ``tokenizer_config.json`` with its chat template) or a lone ``tokenizer.json``; needs the
            optional ``tokenizers`` package (and ``jinja2`` for a chat template).
        root_hash: the chain root for every prompt (:func:`balancer.kv_translate.chain_root`,
            e.g. a LoRA adapter's); ``None`` for the base model.

    Raises:
        ValueError: ``block_size`` < 1 or ``chars_per_token`` <= 0; ``tokenizer_path`` missing,
            unreadable or not a valid ``tokenizer.json`` (the message names the file and the
            parser's reason).
        RuntimeError: ``tokenizer_path`` given but ``tokenizers`` is not installed.
    """

    def __init__(self, block_size: int, chars_per_token: float = 4.0, tokenizer_path: str | None = None,
                 root_hash: int | None = None, engine: str = "vllm") -> None:
        if block_size < 1 or chars_per_token <= 0:
            raise ValueError("block_size must be >= 1 and chars_per_token > 0")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        #: whose chat rendering to reproduce (:meth:`ChatTemplate.render_for`)
        self.engine = engine
        #: called with a reason each time a prompt's token ids may differ from the engine's
        #: (``no_chat_template``, ``multimodal``, ``request_chat_template``, ``chat_template_kwargs``,
        #: ``engine_renderer``); the service counts
        #: them as ``pdlb_prompt_inexact_total{reason}``
        self.on_inexact: Any = None
        self.block_size = int(block_size)
        self.chars_per_token = float(chars_per_token)
        self.chunk_chars = max(1, round(block_size * chars_per_token))
        self._tokenizer = None
        self.root_hash = root_hash
        #: the model folder's chat template, if ``tokenizer_path`` is a folder that has one
        self.chat_template: ChatTemplate | None = None
        #: the engine renders this model's chat with its own encoder, not the folder's template
        #: (:func:`engine_renderer`): chat prompts are counted ``engine_renderer``
        self.engine_renderer: str | None = None
        if tokenizer_path:
            self._tokenizer = load_tokenizer(tokenizer_path)
            if Path(tokenizer_path).is_dir():
                self.chat_template = ChatTemplate.from_folder(tokenizer_path)
                self.engine_renderer = engine_renderer(tokenizer_path, engine)

    def tokenizes(self, prompt: Prompt) -> bool:
        """Whether :meth:`hash` runs the tokenizer on ``prompt`` (text prompt, tokenizer configured)."""
        return prompt.token_ids is None and self._tokenizer is not None

    def token_estimate(self, text: str) -> int:
        """Estimated tokens of ``text`` without a tokenizer: ``max(1, ceil(chars / chars_per_token))``."""
        return max(1, math.ceil(len(text) / self.chars_per_token))

    def token_ids(self, prompt: Prompt) -> list[int] | None:
        """The token ids the engine will see for ``prompt`` (module docstring), ``None`` without a
        tokenizer for a text prompt.

        Raises:
            PromptError: the chat template rejected the messages.
        """
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if self._tokenizer is None:
            return None
        if prompt.messages is not None and self.chat_template is not None:
            notes: list[str] = []
            text, suffix = self.chat_template.render_for(prompt.messages, prompt.chat, self.engine, notes)
            special = prompt.chat.add_special_tokens if prompt.chat is not None else False
            ids = self._tokenizer.encode(text, add_special_tokens=special).ids
            if suffix:
                ids = ids + self._tokenizer.encode(suffix, add_special_tokens=False).ids
            if self.engine_renderer is not None:
                notes.append("engine_renderer")
            self._note(notes)
            return ids
        if prompt.messages is not None:  # a tokenizer without a chat template: the engine's rendering is unknown
            self._note(["no_chat_template"])
        special = prompt.messages is None
        if special and prompt.add_special_tokens is not None and self.engine == "vllm":
            special = prompt.add_special_tokens  # vLLM's completions honour it; SGLang's have no such field
        return self._tokenizer.encode(prompt.text or "", add_special_tokens=special).ids

    def _note(self, reasons: list[str]) -> None:
        if reasons and self.on_inexact is not None:
            for r in dict.fromkeys(reasons):
                self.on_inexact(r)

    def hash_token_ids(self, ids: Sequence[int] | np.ndarray, root_hash: int | None = None) -> tuple[int, tuple[int, ...]]:
        """``(prompt_tokens >= 1, block_hashes)`` of a prompt of token ids ``ids`` (shape
        ``(n_tokens,)``; a list, or an integer array as the body worker parses large ones), as
        :meth:`hash` gives for a token-id prompt.

        Raises:
            ValueError: a token id outside ``[0, 2**32)`` (:func:`balancer.hashing.hash_token_blocks`).
        """
        root = self.root_hash if root_hash is None else root_hash
        return max(1, len(ids)), tuple(hash_token_blocks(ids, self.block_size, root))

    def hash(self, prompt: Prompt, root_hash: int | None = None) -> tuple[int, tuple[int, ...]]:
        """``(prompt_tokens >= 1, block_hashes)`` of ``prompt``; ``root_hash``: this request's
        chain root (a LoRA adapter's, :func:`balancer.kv_translate.chain_root`), default the
        hasher's.

        Raises:
            PromptError: the chat template rejected the messages.
        """
        ids = self.token_ids(prompt)
        if ids is not None:
            return self.hash_token_ids(ids, root_hash)
        root = self.root_hash if root_hash is None else root_hash
        text = prompt.text or ""
        return self.token_estimate(text), tuple(text_chunk_hashes(text, self.chunk_chars, root))
