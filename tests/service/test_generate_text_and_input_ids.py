"""SGLang ``/generate`` with both ``text`` and ``input_ids`` (review R13, session 16): pdlb routed
on the text's hash. SGLang 0.5.23 (its wheel's code, read for this test) accepts the pair
(``io_struct.GenerateReqInput._validate_inputs`` refuses only none of text / input_ids /
input_embeds, or all three) and prefills ``input_ids``: ``TokenizerManager._tokenize_one_request``
takes ``obj.input_ids`` when it is not None and tokenizes ``text`` only otherwise. The engine's
KV cache then holds the ids' blocks, so the router must hash the ids. Expected hashes: the
library's :func:`balancer.hashing.hash_token_blocks` on the plain id list (an independent path)."""

from __future__ import annotations

import json

import pytest

from balancer.hashing import hash_token_blocks
from balancer.service import body_offload as bo
from balancer.service.prompt import Prompt, PromptHasher, extract_prompt

IDS = list(range(1000, 1000 + 200))  # 200 tokens: 12 full blocks of 16


def test_input_ids_win_over_text() -> None:
    p = extract_prompt("generate", {"text": "something else entirely " * 40, "input_ids": IDS})
    assert p == Prompt(token_ids=tuple(IDS))
    assert extract_prompt("generate", {"text": "hi"}) == Prompt(text="hi")  # text alone: as before


@pytest.mark.parametrize("compact_min_chars", [0, 1 << 62])  # the large-array path and the scanner
def test_a_body_with_both_hashes_as_its_input_ids(compact_min_chars: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bo, "COMPACT_IDS_MIN_CHARS", compact_min_chars)
    raw = json.dumps({"text": "a different prompt " * 50, "input_ids": IDS,
                      "sampling_params": {"max_new_tokens": 4}}).encode()
    a = bo.analyze(raw, "generate", None, 1 << 20, 16, PromptHasher(16, 4.0, None), {})
    assert isinstance(a, bo.Analysis), a
    assert a.tokenized and a.n_tokens == 200
    assert a.hashes == tuple(hash_token_blocks(IDS, 16))
