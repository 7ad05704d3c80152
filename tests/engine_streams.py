"""Recorded SSE answers of real engines, write by write, with when each write left the engine.

Each stream is a list of ``(delay_s, bytes)``: the engine writes ``bytes`` ``delay_s`` seconds after
its previous write (the first after the request arrived). The bytes are the engines' own formats,
taken from their serving code (never copied into pdlb; these are outputs, built as that code builds
them):

* transformers 5.17.0 (``transformers serve``, wheel from the registry):
  ``transformers/cli/serving/chat_completion.py`` ``_streaming.sse_gen``: a role-only chunk is the
  first write, *before* the request is queued for prefill; tokens then arrive in writes that join
  every queued event (``"".join(sse_parts)``); the last chunk carries ``finish_reason`` and
  ``usage``; no ``data: [DONE]``. Bytes from ``_build_chunk_sse`` -> ``chunk_to_sse``
  (``model_dump_json(exclude_none=True)`` of the openai package's ``ChatCompletionChunk``),
  generated with those classes. ``completion.py`` streams text chunks, then a finish chunk with
  ``text: ""`` and ``usage``; no role chunk, no ``[DONE]``.
* vLLM (``vllm/entrypoints/openai/chat_completion/serving.py``,
  ``chat_completion_stream_generator``): on the first engine output a role chunk
  (``delta: {role, content: ""}``), then per output a content chunk; the finishing output's chunk
  carries its text and ``finish_reason``; with ``stream_options.include_usage`` a usage chunk with
  ``choices: []`` (``exclude_none``); then ``data: [DONE]``. Chunks are ``model_dump_json
  (exclude_unset=True)``: explicitly passed ``None`` fields appear as ``null``.
* SGLang ``/generate`` (``python/sglang/srt/entrypoints/http_server.py``, ``generate_request``'s
  ``stream_results``): one ``data: {"text", "output_ids", "meta_info"}`` per output, the text
  cumulative, ``meta_info.completion_tokens`` counting, then ``data: [DONE]``.
* SGLang (``python/sglang/srt/entrypoints/openai/serving_chat.py``, ``_generate_chat_stream``, and
  ``sse_utils.build_sse_content``, msgspec with ``omit_defaults`` on the delta): on the first
  output a role chunk (``delta: {role, content: ""}``), content chunks, then one finish chunk per
  choice with an empty delta (``delta: {}``), a usage chunk (``choices: []``) with
  ``include_usage``, then ``data: [DONE]``. The usage chunk is pydantic's ``model_dump_json``;
  its optional fields that are ``null`` are left out here except ``prompt_tokens_details``.

Hand-computed expectations per stream: ``ttft_s`` (sum of delays up to and including the write
with the first content event), ``output_tokens`` (the usage's ``completion_tokens``, or with no
usage the content events counted), ``role_s`` (when the first byte left the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_TX = "/models/llama8b@main"


@dataclass(frozen=True)
class Recorded:
    name: str
    endpoint: str  # "chat", "completions" or "generate" (SGLang's native API)
    writes: tuple[tuple[float, bytes], ...]
    ttft_s: float  # hand-computed: delays summed through the write holding the first content event
    output_tokens: int  # hand-computed (see the module docstring)
    done: bool  # ends with data: [DONE]


def _tx_chat(content: str) -> bytes:
    return (b'data: {"id":"req-7","choices":[{"delta":{"content":"' + content.encode() +
            b'"},"index":0}],"created":1764880000,"model":"/models/llama8b@main","object":"chat.completion.chunk",'
            b'"system_fingerprint":""}\n\n')


TX_ROLE = (b'data: {"id":"req-7","choices":[{"delta":{"role":"assistant"},"index":0}],"created":1764880000,'
           b'"model":"/models/llama8b@main","object":"chat.completion.chunk","system_fingerprint":""}\n\n')
TX_TOOL = (b'data: {"id":"req-7","choices":[{"delta":{"tool_calls":[{"index":0,"id":"req-7_tool_call_0","function":'
           b'{"arguments":"{\\"city\\": \\"Paris\\"}","name":"get_weather"},"type":"function"}]},"index":0}],'
           b'"created":1764880000,"model":"/models/llama8b@main","object":"chat.completion.chunk",'
           b'"system_fingerprint":""}\n\n')
TX_FINISH = (b'data: {"id":"req-7","choices":[{"delta":{},"index":0,"finish_reason":"length"}],"created":1764880000,'
             b'"model":"/models/llama8b@main","object":"chat.completion.chunk","system_fingerprint":"",'
             b'"usage":{"completion_tokens":4,"prompt_tokens":12,"total_tokens":16}}\n\n')
TX_TEXT = (b'data: {"id":"req-8","choices":[{"index":0,"text":" world"}],"created":1764880000,'
           b'"model":"/models/llama8b@main","object":"text_completion"}\n\n')
TX_TEXT_FINISH = (b'data: {"id":"req-8","choices":[{"finish_reason":"length","index":0,"text":""}],'
                  b'"created":1764880000,"model":"/models/llama8b@main","object":"text_completion",'
                  b'"usage":{"completion_tokens":3,"prompt_tokens":5,"total_tokens":8}}\n\n')


def _vllm_chat(delta: bytes, finish: bytes = b"null", extra: bytes = b',"token_ids":null') -> bytes:
    stop = b',"stop_reason":null' if finish != b"null" else b""
    return (b'data: {"id":"chatcmpl-pdlb-1","object":"chat.completion.chunk","created":1764880000,"model":"llama",'
            b'"choices":[{"index":0,"delta":' + delta + b',"logprobs":null,"finish_reason":' + finish + stop + extra +
            b'}]}\n\n')


VLLM_ROLE = (b'data: {"id":"chatcmpl-pdlb-1","object":"chat.completion.chunk","created":1764880000,"model":"llama",'
             b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
             b'"prompt_token_ids":null,"prompt_text":null}\n\n')
VLLM_USAGE = (b'data: {"id":"chatcmpl-pdlb-1","object":"chat.completion.chunk","created":1764880000,"model":"llama",'
              b'"choices":[],"usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5}}\n\n')
DONE = b"data: [DONE]\n\n"


def _sgl(delta: bytes, finish: bytes = b"null") -> bytes:
    return (b'data: {"id":"9f1c","object":"chat.completion.chunk","created":1764880000,"model":"llama","choices":'
            b'[{"index":0,"delta":' + delta + b',"logprobs":null,"finish_reason":' + finish +
            b',"matched_stop":null}]}\n\n')


SGL_USAGE = (b'data: {"id":"9f1c","object":"chat.completion.chunk","created":1764880000,"model":"llama","choices":[],'
             b'"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":null,'
             b'"reasoning_tokens":0}}\n\n')

def _sgl_gen(text: str, ids: str, n: int, finish: bytes = b"null") -> bytes:
    return (b'data: {"text":"' + text.encode() + b'","output_ids":[' + ids.encode() + b'],"meta_info":{"id":"9f1d",'
            b'"finish_reason":' + finish + b',"prompt_tokens":12,"completion_tokens":' + str(n).encode() +
            b',"cached_tokens":0}}\n\n')


STREAMS: tuple[Recorded, ...] = (
    # transformers: role chunk at once, first token after a 0.30 s prefill, two tokens in one write,
    # finish + usage, no [DONE]
    Recorded("transformers_chat", "chat", (
        (0.0, TX_ROLE), (0.30, _tx_chat("Hello")), (0.05, _tx_chat(" big") + _tx_chat(" wide")),
        (0.05, _tx_chat(" world")), (0.0, TX_FINISH)), ttft_s=0.30, output_tokens=4, done=False),
    # transformers, a tool call as the first content (the parser emits the call whole)
    Recorded("transformers_chat_tool_call", "chat", (
        (0.0, TX_ROLE), (0.25, TX_TOOL), (0.02, TX_FINISH)), ttft_s=0.25, output_tokens=4, done=False),
    # transformers completions: no role chunk; text, then the finish chunk with usage
    Recorded("transformers_completions", "completions", (
        (0.20, TX_TEXT), (0.05, TX_TEXT + TX_TEXT), (0.0, TX_TEXT_FINISH)), ttft_s=0.20, output_tokens=3, done=False),
    # vLLM with include_usage: the role chunk and the first token come out of the same engine output
    Recorded("vllm_chat_usage", "chat", (
        (0.22, VLLM_ROLE), (0.0, _vllm_chat(b'{"content":"Hi"}')), (0.03, _vllm_chat(b'{"content":" there"}')),
        (0.03, _vllm_chat(b'{"content":","}')), (0.03, _vllm_chat(b'{"content":" you"}')),
        (0.03, _vllm_chat(b'{"content":"!"}', b'"length"')), (0.0, VLLM_USAGE), (0.0, DONE)),
        ttft_s=0.22, output_tokens=5, done=True),
    # vLLM without usage (its default): counted, the finishing chunk carries the last token
    Recorded("vllm_chat_counted", "chat", (
        (0.18, VLLM_ROLE + _vllm_chat(b'{"content":"Hi"}')), (0.03, _vllm_chat(b'{"content":" there"}')),
        (0.03, _vllm_chat(b'{"content":"!"}', b'"stop"')), (0.0, DONE)),
        ttft_s=0.18, output_tokens=3, done=True),
    # SGLang: role chunk, an empty-delta chunk (its parser path flushing nothing), content, the
    # empty-delta finish chunk, usage, [DONE]
    Recorded("sglang_chat", "chat", (
        (0.15, _sgl(b'{"role":"assistant","content":""}')), (0.0, _sgl(b'{}')), (0.10, _sgl(b'{"content":"A"}')),
        (0.02, _sgl(b'{"content":"B"}')), (0.02, _sgl(b'{"content":"C"}')), (0.0, _sgl(b'{}', b'"length"')),
        (0.0, SGL_USAGE), (0.0, DONE)), ttft_s=0.25, output_tokens=3, done=True),
    # SGLang without usage: counted (the empty finish chunk is not a token)
    Recorded("sglang_chat_counted", "chat", (
        (0.12, _sgl(b'{"role":"assistant","content":""}') + _sgl(b'{"content":"A"}')), (0.02, _sgl(b'{"content":"B"}')),
        (0.0, _sgl(b'{}', b'"stop"')), (0.0, DONE)), ttft_s=0.12, output_tokens=2, done=True),
    # SGLang /generate: the first event already carries the first token; tokens from meta_info
    Recorded("sglang_generate", "generate", (
        (0.16, _sgl_gen(" A", "32", 1)), (0.02, _sgl_gen(" A B", "32,33", 2)),
        (0.02, _sgl_gen(" A B C", "32,33,34", 3, b'{"type":"length","length":3}')), (0.0, DONE)),
        ttft_s=0.16, output_tokens=3, done=True),
)
