"""Large token-id prompts parsed into one integer array in the body worker (issue 25).

``balancer.service.body_offload._compact_ids`` reads a flat JSON array of token ids with numpy
instead of ``json``'s scanner; it must take exactly the arrays ``json.loads`` reads as a flat list
of ints in ``[0, 2**32)`` (the engines' and the router's rule), with the same values, and leave
everything else to the scanner, which gives the usual 400. Expected values: ``json.loads`` (the
standard library's parser, an independent implementation) and ``balancer.hashing`` on the list.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import balancer.service.body_offload as bo
from balancer.hashing import hash_token_blocks
from balancer.service.prompt import PromptHasher

TOKEN_ID_LIMIT = 2**32


def _json_ids(s: str) -> list[int] | None:
    """What json.loads makes of ``s`` if it is a non-empty flat array of ints in [0, 2**32), else None."""
    try:
        v = json.loads(s)
    except ValueError:
        return None
    if not isinstance(v, list) or not v:
        return None
    if not all(type(x) is int and 0 <= x < TOKEN_ID_LIMIT for x in v):
        return None
    return v


_MUTATIONS = [
    lambda s, r: s.replace(",", ",0", 1),  # a leading zero ("0123"), or a valid 0-prefixed split? both occur
    lambda s, r: s.replace(",", ",,", 1),
    lambda s, r: s.replace(",", " ", 1),
    lambda s, r: s.replace(",", ", -", 1),
    lambda s, r: s.replace(",", ", +", 1),
    lambda s, r: s.replace(",", ".5,", 1),
    lambda s, r: s.replace(",", "e3,", 1),
    lambda s, r: s.replace(",", "\f,", 1),
    lambda s, r: s.replace(",", "\v,", 1),
    lambda s, r: s.replace(",", "\u00a0,", 1),
    lambda s, r: s.replace(",", ", true,", 1),
    lambda s, r: s.replace(",", f", {2**32},", 1),
    lambda s, r: s.replace(",", f", {2**32 - 1},", 1),
    lambda s, r: s.replace(",", f", {2**64},", 1),
    lambda s, r: s.replace(",", ", 99999999999999999999999,", 1),
    lambda s, r: s.replace(",", ", [1],", 1),
    lambda s, r: s.replace(",", "],", 1),
    lambda s, r: s[:-1] + ",]",
    lambda s, r: "[," + s[1:],
    lambda s, r: s.replace(",", ",\n\t\r ", r.randrange(1, 5)),
    lambda s, r: s.replace(", ", ",", r.randrange(1, 50)),
    lambda s, r: "[ " + s[1:-1] + "\n]",
    lambda s, r: s.replace(",", ", 0,", 1),
    lambda s, r: s.replace(",", ", 00,", 1),
    lambda s, r: s.replace(",", ', "7",', 1),
    lambda s, r: s.replace("1", "\u0661", 1),  # an Arabic-Indic digit: not JSON
    lambda s, r: "[]" + " " * 2000,
]


@pytest.fixture
def small_arrays_too(monkeypatch):
    """Every array over ELIDE_VALUE_BYTES (1 KiB) goes to the fast path, not only those of 64 KiB."""
    monkeypatch.setattr(bo, "COMPACT_IDS_MIN_CHARS", 0)


@pytest.mark.parametrize("seed", range(40))
def test_compact_ids_take_exactly_what_json_reads_as_token_ids(seed, small_arrays_too):
    rng = random.Random(seed)
    ids = [rng.choice([0, 1, 9, 10, rng.randrange(100_000), rng.randrange(TOKEN_ID_LIMIT)]) for _ in range(400)]
    s = json.dumps(ids)
    for m in rng.sample(_MUTATIONS, rng.randrange(0, 3)):
        s = m(s, rng)
    expected = _json_ids(s)
    for raw in (None, s.encode("ascii") if s.isascii() else None):
        got = bo._compact_ids(s, 0, raw)
        if expected is None or len(s) <= bo.ELIDE_VALUE_BYTES or s.index("]") != len(s) - 1:
            assert got is None or (expected is not None and got[0].tolist() == expected), (s[:200], got)
        else:
            # json reads it as token ids and it is one flat array: the fast path must take it too
            assert got is not None, s[:200]
            assert got[0].tolist() == expected and got[1] == len(s)


@pytest.mark.parametrize("mutation", range(len(_MUTATIONS)))
def test_each_kind_of_bad_array_is_left_to_the_json_scanner(mutation, small_arrays_too):
    rng = random.Random(mutation)
    s = _MUTATIONS[mutation](json.dumps([rng.randrange(1, 100_000) for _ in range(400)]), rng)
    got = bo._compact_ids(s, 0)
    expected = _json_ids(s)
    if expected is None:
        assert got is None, s[:120]
    else:
        assert got is not None and got[0].tolist() == expected


def _bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    ids = [rng.randrange(50_000) for _ in range(rng.choice([300, 2_000]))]
    a = json.dumps(ids)
    return [
        ("completions", json.dumps({"prompt": ids, "max_tokens": 3}).encode()),
        ("completions", ('{"prompt": ' + a + ', "prompt": "text wins", "max_tokens": 3}').encode()),
        ("completions", ('{"prompt": "text first", "prompt": ' + a + '}').encode()),
        ("completions", ('{"prompt": ' + a.replace(", ", ",", 7) + ', "model": "m\u00e9"}').encode()),  # non-ASCII body
        ("completions", json.dumps({"prompt": ids, "max_tokens": 3}).encode("utf-16")),
        ("completions", ('{"prompt": ' + a.replace(",", f", {2**32},", 1) + "}").encode()),  # id out of range: 400
        ("completions", ('{"prompt": ' + a.replace(", ", ", 0", 1) + "}").encode()),  # leading zero: invalid JSON
        ("completions", json.dumps({"prompt": [ids, ids]}).encode()),  # a batch: 400
        ("completions", json.dumps({"prompt": ids, "rid": "client-1", "stream": "yes"}).encode()),
        ("generate", json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 5}}).encode()),
        ("generate", json.dumps({"input_ids": ids, "text": "the text is the prompt"}).encode()),
        ("chat", json.dumps({"messages": [{"role": "user", "content": "hi"}], "prompt": ids}).encode()),
    ]


@pytest.mark.parametrize("seed", range(3))
def test_analyze_gives_the_same_answer_with_and_without_compact_ids(seed, monkeypatch):
    hasher = PromptHasher(16, 4.0, None)
    rng = random.Random(seed)
    for endpoint, raw in _bodies(rng):
        monkeypatch.setattr(bo, "COMPACT_IDS_MIN_CHARS", 0)  # every array over ELIDE_VALUE_BYTES
        compact = bo.analyze(raw, endpoint, None, 1 << 20, 16, hasher, {})
        monkeypatch.setattr(bo, "COMPACT_IDS_MIN_CHARS", 1 << 62)  # the scanner for every value
        scanned = bo.analyze(raw, endpoint, None, 1 << 20, 16, hasher, {})
        assert compact == scanned, (endpoint, raw[:120])


def test_a_large_token_id_prompt_hashes_as_its_list_does():
    ids = list(range(100_000, 400_000))  # 300k ids, 2.4 MB of JSON
    raw = json.dumps({"prompt": ids, "max_tokens": 4}).encode()
    a = bo.analyze(raw, "completions", None, 1 << 20, 16, PromptHasher(64, 4.0, None), {})
    assert isinstance(a, bo.Analysis) and a.tokenized
    assert a.n_tokens == 300_000
    assert a.hashes == tuple(hash_token_blocks(ids, 64))  # the library on the plain list
    assert type(a.body["prompt"]) is bo.Elided and json.loads(raw[a.body["prompt"].start:a.body["prompt"].end]) == ids
    got = bo._compact_ids(raw.decode(), raw.index(b"["))
    assert got is not None and got[0].dtype == np.int64 and got[0].size == 300_000
