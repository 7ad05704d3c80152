"""Request body -> prompt text or token ids -> (prompt length, chained block hashes).

The router sees OpenAI / SGLang request bodies, not token ids. Two ways to get the block hashes
the prefix index (:mod:`balancer.prefix_index`) matches on:

* **Tokenizer configured** (``tokenizer_path``: a local model folder with ``tokenizer.json`` and
  ``tokenizer_config.json``, or a lone ``tokenizer.json``; loaded with the optional ``tokenizers``
  package): the prompt is tokenised as the engine tokenises it and full ``block_size``-token
  blocks are hashed with :func:`balancer.hashing.hash_token_blocks`, so they equal the pdlb hashes
  the router derives from the engine's KV events (:mod:`balancer.kv_translate`). Completion and
  ``/generate`` text: ``encode(text, add_special_tokens=True)`` (vLLM's and SGLang's default, e.g.
  a BOS token). Chat: the folder's chat template (``tokenizer_config.json`` ``chat_template``, or
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

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from balancer.hashing import hash_token_blocks, text_chunk_hashes

__all__ = ["ChatTemplate", "Prompt", "PromptError", "PromptHasher", "extract_prompt", "load_tokenizer", "render_messages"]


class PromptError(ValueError):
    """The request body has no usable prompt (missing or mistyped field)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the router sees it: text, or token ids (exactly one is set); for
    chat also the ``messages`` (``text`` is then their :func:`render_messages` rendering)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: list[Any] | None = field(default=None, compare=False)


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


def extract_prompt(endpoint: str, body: dict[str, Any]) -> Prompt:
    """The prompt of a request body.

    Args:
        endpoint: ``"completions"`` (``prompt``: string, array of strings, token ids, or array of
            token-id arrays; batches are routed by their concatenation), ``"chat"`` (``messages``)
            or ``"generate"`` (SGLang: ``text`` or ``input_ids``).
        body: the parsed JSON object.

    Raises:
        PromptError: the required field is missing or has the wrong type.
    """
    if endpoint == "chat":
        messages = body.get("messages")
        return Prompt(text=render_messages(messages), messages=messages)
    if endpoint == "generate":
        if isinstance(body.get("text"), str):
            return Prompt(text=body["text"])
        if isinstance(body.get("input_ids"), list):
            return Prompt(token_ids=_token_list(body["input_ids"], "input_ids"))
        raise PromptError("'text' (string) or 'input_ids' (array of token ids) is required")
    if endpoint != "completions":
        raise ValueError(f"unknown endpoint {endpoint!r}")
    p = body.get("prompt")
    if isinstance(p, str):
        return Prompt(text=p)
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return Prompt(text="".join(p))
        if all(isinstance(x, list) for x in p):
            return Prompt(token_ids=_token_list([t for x in p for t in x], "prompt"))
        return Prompt(token_ids=_token_list(p, "prompt"))
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
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
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
        """The prompt text for ``messages``.

        Raises:
            PromptError: the template raised (``raise_exception``) or failed on these messages.
        """
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except PromptError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise PromptError(f"chat template failed on these messages: {e}") from None


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
                 root_hash: int | None = None) -> None:
        if block_size < 1 or chars_per_token <= 0:
            raise ValueError("block_size must be >= 1 and chars_per_token > 0")
        self.block_size = int(block_size)
        self.chars_per_token = float(chars_per_token)
        self.chunk_chars = max(1, round(block_size * chars_per_token))
        self._tokenizer = None
        self.root_hash = root_hash
        #: the model folder's chat template, if ``tokenizer_path`` is a folder that has one
        self.chat_template: ChatTemplate | None = None
        if tokenizer_path:
            self._tokenizer = load_tokenizer(tokenizer_path)
            if Path(tokenizer_path).is_dir():
                self.chat_template = ChatTemplate.from_folder(tokenizer_path)

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
            text = self.chat_template.render(prompt.messages)
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        return self._tokenizer.encode(prompt.text or "", add_special_tokens=prompt.messages is None).ids

    def hash(self, prompt: Prompt, root_hash: int | None = None) -> tuple[int, tuple[int, ...]]:
        """``(prompt_tokens >= 1, block_hashes)`` of ``prompt``; ``root_hash``: this request's
        chain root (a LoRA adapter's, :func:`balancer.kv_translate.chain_root`), default the
        hasher's.

        Raises:
            PromptError: the chat template rejected the messages.
        """
        root = self.root_hash if root_hash is None else root_hash
        ids = self.token_ids(prompt)
        if ids is not None:
            return max(1, len(ids)), tuple(hash_token_blocks(ids, self.block_size, root))
        text = prompt.text or ""
        return self.token_estimate(text), tuple(text_chunk_hashes(text, self.chunk_chars, root))
