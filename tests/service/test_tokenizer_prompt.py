"""Tokenizer-based prompt hashing of ``pdlb serve`` (``tokenizer_path``, ``--tokenizer``).

The tokenizer is a tiny WordLevel ``tokenizer.json`` built here with the ``tokenizers`` library
and a hand-written vocabulary, so every token id below is known by hand (no network, no model).
"""

from __future__ import annotations

import re
import struct

import aiohttp
import pytest
import xxhash

tokenizers = pytest.importorskip("tokenizers")

from balancer.service.app import create_app  # noqa: E402
from balancer.service.config import ServiceConfig  # noqa: E402
from balancer.service.prompt import PromptHasher, extract_prompt, load_tokenizer  # noqa: E402
from pdlb_cli.main import main as pdlb_main  # noqa: E402
from sim.emulator.testing import inprocess_cluster  # noqa: E402

VOCAB = {"[UNK]": 0, "system": 1, "user": 2, ":": 3, "you": 4, "are": 5, "a": 6, "helpful": 7,
         "assistant": 8, "tell": 9, "me": 10, "joke": 11, "story": 12, "about": 13, "cats": 14, "dogs": 15}
SYSTEM = {"role": "system", "content": "you are a helpful assistant"}
CHAT_CATS = {"messages": [SYSTEM, {"role": "user", "content": "tell me a joke about cats"}], "max_tokens": 2}
CHAT_DOGS = {"messages": [SYSTEM, {"role": "user", "content": "tell me a story about dogs"}], "max_tokens": 2}
# Rendered "system: you are a helpful assistant\nuser: tell me a joke about cats\n", split by the
# Whitespace pre-tokenizer (\w+ | [^\w\s]+) and looked up in VOCAB by hand:
IDS_CATS = [1, 3, 4, 5, 6, 7, 8, 2, 3, 9, 10, 6, 11, 13, 14]
IDS_DOGS = [1, 3, 4, 5, 6, 7, 8, 2, 3, 9, 10, 6, 12, 13, 15]  # differs from token 12 on


@pytest.fixture
def tokenizer_json(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def _chain(ids: list[int], block_size: int) -> list[int]:
    """Independent re-implementation of the block-hash formula (balancer/hashing.py docstring):
    ``h_i = XXH3_64(h_{i-1} as 8 LE bytes + block_i as LE uint32)``, ``h_-1 = 0``, full blocks only."""
    out, h = [], 0
    for i in range(len(ids) // block_size):
        block = ids[i * block_size:(i + 1) * block_size]
        h = xxhash.xxh3_64_intdigest(struct.pack("<Q", h) + struct.pack(f"<{block_size}I", *block))
        out.append(h)
    return out


def test_chat_prompts_sharing_a_prefix_share_leading_block_hashes(tokenizer_json):
    h = PromptHasher(block_size=3, tokenizer_path=str(tokenizer_json))
    n_cats, cats = h.hash(extract_prompt("chat", CHAT_CATS))
    n_dogs, dogs = h.hash(extract_prompt("chat", CHAT_DOGS))
    assert n_cats == n_dogs == 15  # exact token counts, not the chars/4 estimate (68 chars -> 17)
    # 15 tokens -> 5 full blocks of 3; tokens 0..11 are shared -> blocks 0..3 equal, block 4 differs
    assert len(cats) == len(dogs) == 5
    assert cats[:4] == dogs[:4] and cats[4] != dogs[4]
    assert list(cats) == _chain(IDS_CATS, 3) and list(dogs) == _chain(IDS_DOGS, 3)
    # completions text is tokenised the same way; a trailing partial block is not hashed
    n, hashes = h.hash(extract_prompt("completions", {"prompt": "tell me a joke"}))
    assert n == 4 and list(hashes) == _chain([9, 10, 6, 11], 3)
    # token ids given by the client bypass the tokenizer
    n, hashes = h.hash(extract_prompt("generate", {"input_ids": IDS_CATS}))
    assert n == 15 and list(hashes) == list(cats)


def test_missing_or_invalid_tokenizer_is_a_clear_startup_error(tmp_path, capsys):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ValueError, match=r"tokenizer_path .*nope/tokenizer.json: no such file"):
        load_tokenizer(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": ')
    with pytest.raises(ValueError, match=r"tokenizer_path .*bad.json: not a valid tokenizer.json"):
        PromptHasher(block_size=4, tokenizer_path=str(bad))
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        create_app(ServiceConfig(tokenizer_path=str(bad)))
    # the CLI reports it on stderr and exits 2 before listening
    rc = pdlb_main(["serve", "--port", "0", "--tokenizer", str(missing),
                    "--mixed", "http://127.0.0.1:9", "--pd-protocol", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: tokenizer_path" in err and "no such file" in err and "Traceback" not in err


def _prefill_match_ratio_sum(metrics_text: str) -> float:
    m = re.search(r'pdlb_prefix_match_ratio_sum\{pool="prefill"\} (\S+)', metrics_text)
    assert m is not None
    return float(m.group(1))


async def test_service_routes_on_token_blocks_from_config(tokenizer_json):
    router = {"tokenizer_path": str(tokenizer_json), "block_size": 3,
              "prefill_policy": {"name": "cache_aware"}, "decode_policy": {"name": "round_robin"}}
    async with inprocess_cluster("sglang", engine={"speed": 20.0}, router=router) as c, aiohttp.ClientSession() as s:
        for body in (CHAT_CATS, CHAT_DOGS):
            r = await s.post(c.url + "/v1/chat/completions", json=body)
            assert r.status == 200
        text = await (await s.get(c.url + "/metrics")).text()
    # first request: nothing cached (0); second: 4 shared blocks * 3 = 12 of 15 tokens = 0.8, on the
    # same prefill engine (cache_aware follows a match above 30%). Without the tokenizer, 12-char
    # chunks would give 4 shared chunks = 12 tokens of an estimated ceil(69 / 4) = 18 -> 0.667.
    assert _prefill_match_ratio_sum(text) == pytest.approx(0.8)


async def test_service_tokenizes_long_prompts_in_a_thread_with_the_same_result(tokenizer_json):
    # a system prompt of 160 x "you are a helpful assistant " (4,480 chars) is over
    # TOKENIZE_IN_THREAD_CHARS, so the worker-thread path runs
    system = {"role": "system", "content": "you are a helpful assistant " * 160}
    bodies = [{"messages": [system, {"role": "user", "content": f"tell me a {w} about {a}"}], "max_tokens": 2}
              for w, a in (("joke", "cats"), ("story", "dogs"))]
    router = {"tokenizer_path": str(tokenizer_json), "block_size": 3,
              "prefill_policy": {"name": "cache_aware"}, "decode_policy": {"name": "round_robin"}}
    async with inprocess_cluster("sglang", engine={"speed": 20.0}, router=router) as c, aiohttp.ClientSession() as s:
        for body in bodies:
            assert (await s.post(c.url + "/v1/chat/completions", json=body)).status == 200
        text = await (await s.get(c.url + "/metrics")).text()
    # by hand: "system" ":" + 5 * 160 words + "user" ":" + 6 words = 810 tokens; the two prompts
    # share the first 2 + 800 + 2 + 3 ("tell me a") = 807 tokens = 269 full blocks of 3 -> 807 / 810
    assert _prefill_match_ratio_sum(text) == pytest.approx(807 / 810)
