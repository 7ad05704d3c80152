"""Request body -> prompt text or token ids -> (prompt length, chained block hashes).

The router sees OpenAI / SGLang request bodies, not token ids. Two ways to get the block hashes
the prefix index (:mod:`balancer.prefix_index`) matches on:

* **Tokenizer configured** (a local ``tokenizer.json`` loaded with the optional ``tokenizers``
  package): the rendered prompt is tokenised and full ``block_size``-token blocks are hashed with
  :func:`balancer.hashing.hash_token_blocks`. Exact for ``/v1/completions`` and ``/generate``; for
  chat the engine applies its own chat template, which the router does not know, so token counts
  differ by the template's extra tokens (a constant prefix per message, so prefix matches still
  line up).
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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from balancer.hashing import hash_token_blocks, text_chunk_hashes

__all__ = ["Prompt", "PromptError", "PromptHasher", "extract_prompt", "load_tokenizer", "render_messages"]


class PromptError(ValueError):
    """The request body has no usable prompt (missing or mistyped field)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the router sees it: text, or token ids (exactly one is set)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None


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
        return Prompt(text=render_messages(body.get("messages")))
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
    """Load a HuggingFace ``tokenizer.json`` (a ``tokenizers.Tokenizer``) from a local file.

    Raises:
        ValueError: the file does not exist, is not a regular file, or ``tokenizers`` cannot parse
            it; the message starts with ``tokenizer_path <path>:``.
        RuntimeError: the optional ``tokenizers`` package is not installed.
    """
    p = Path(path)
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


class PromptHasher:
    """Turns a :class:`Prompt` into ``(prompt_tokens, block_hashes)`` for :class:`balancer.types.Request`.

    Args:
        block_size: tokens per block (the router's ``block_size``).
        chars_per_token: characters per token assumed without a tokenizer (4 for English text).
        tokenizer_path: a local HuggingFace ``tokenizer.json``; needs the optional ``tokenizers``
            package.

    Raises:
        ValueError: ``block_size`` < 1 or ``chars_per_token`` <= 0; ``tokenizer_path`` missing,
            unreadable or not a valid ``tokenizer.json`` (the message names the file and the
            parser's reason).
        RuntimeError: ``tokenizer_path`` given but ``tokenizers`` is not installed.
    """

    def __init__(self, block_size: int, chars_per_token: float = 4.0, tokenizer_path: str | None = None) -> None:
        if block_size < 1 or chars_per_token <= 0:
            raise ValueError("block_size must be >= 1 and chars_per_token > 0")
        self.block_size = int(block_size)
        self.chars_per_token = float(chars_per_token)
        self.chunk_chars = max(1, round(block_size * chars_per_token))
        self._tokenizer = None
        if tokenizer_path:
            self._tokenizer = load_tokenizer(tokenizer_path)

    def tokenizes(self, prompt: Prompt) -> bool:
        """Whether :meth:`hash` runs the tokenizer on ``prompt`` (text prompt, tokenizer configured)."""
        return prompt.token_ids is None and self._tokenizer is not None

    def token_estimate(self, text: str) -> int:
        """Estimated tokens of ``text`` without a tokenizer: ``max(1, ceil(chars / chars_per_token))``."""
        return max(1, math.ceil(len(text) / self.chars_per_token))

    def hash(self, prompt: Prompt) -> tuple[int, tuple[int, ...]]:
        """``(prompt_tokens >= 1, block_hashes)`` of ``prompt``."""
        ids: Sequence[int] | None = prompt.token_ids
        if ids is None and self._tokenizer is not None:
            ids = self._tokenizer.encode(prompt.text or "", add_special_tokens=False).ids
        if ids is not None:
            return max(1, len(ids)), tuple(hash_token_blocks(ids, self.block_size))
        text = prompt.text or ""
        return self.token_estimate(text), tuple(text_chunk_hashes(text, self.chunk_chars))
