"""HTTP fuzzer over every endpoint of the router service (issue 14, "tests that keep it so").

A seeded generator (reproducible: the seed and the request are in the failure message) mutates
valid requests: fields dropped, retyped to hostile JSON values (huge or negative numbers, long or
odd strings, deep nesting, lists and objects where scalars belong), router-owned fields added,
raw bodies truncated or corrupted, wrong content types, odd headers. Property: every answer is a
2xx or a 4xx with an OpenAI-style JSON error object (``{"error": {"message", ...}}``), never a
5xx and never a hang (each request has a 10 s client timeout); afterwards the router still serves
a valid request and its load is back to 0. Loopback only; bounded: a few hundred requests per
endpoint family, a few seconds in all.
"""

from __future__ import annotations

import json
import random

import aiohttp
import pytest

from balancer.service.app import SERVICE
from sim.emulator.testing import inprocess_cluster

N_GENERATE = 400  # per protocol
N_ADMIN = 150

VALID = {
    "/v1/completions": {"model": "m", "prompt": "hello world " * 20, "max_tokens": 3, "temperature": 0.5,
                        "stream": False, "n": 1, "stop": ["\n"]},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi " * 30}], "max_tokens": 3,
                             "stream": True, "top_p": 0.9, "stream_options": {"include_usage": True}},
    "/generate": {"text": "abc " * 40, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}, "stream": False},
}
FIELDS = ["prompt", "messages", "text", "input_ids", "max_tokens", "max_completion_tokens", "stream", "n", "best_of",
          "temperature", "top_p", "top_k", "stop", "seed", "rid", "sampling_params", "stream_options", "model",
          "bootstrap_host", "bootstrap_port", "bootstrap_room", "kv_transfer_params", "data_parallel_rank",
          "presence_penalty", "frequency_penalty", "min_tokens", "logprobs", "user", "\u0000", ""]


def hostile_value(rng: random.Random, depth: int = 0) -> object:
    """A JSON value chosen to break a parser or a type assumption."""
    k = rng.randrange(16 if depth < 3 else 11)
    if k == 0:
        return None
    if k == 1:
        return rng.choice([True, False])
    if k == 2:
        return rng.choice([0, -1, 1, 2**31, 2**32, 2**63, -(2**63), 10**7, 10**18, 2**64 + 5])
    if k == 3:
        return rng.choice([0.0, -0.0, 1e308, -1e308, 1e-320, 0.5, 3.5, -2.5])
    if k == 4:
        return rng.choice(["", "false", "true", "0", "NaN", "x" * rng.randrange(1, 3000), "\u202e\u0000\ud7ff",
                           "é" * 100, "[1,2]", "{}", "a\nb", " " * 10])
    if k == 5:
        return [rng.randrange(-5, 2**33) for _ in range(rng.randrange(0, 40))]
    if k == 6:
        return [[rng.randrange(0, 1000)] for _ in range(rng.randrange(0, 5))]
    if k == 7:
        return [{"role": rng.choice(["user", 1, None]), "content": rng.choice(["c", 5, [{"type": "text", "text": 7}],
                                                                              None, {"a": 1}])}]
    if k == 8:
        nested: object = 1
        for _ in range(rng.choice([10, 200, 900])):
            nested = [nested]
        return nested
    if k == 9:
        return {"max_new_tokens": hostile_value(rng, depth + 1), "temperature": hostile_value(rng, depth + 1)}
    if k == 10:
        return rng.randrange(-3, 100)
    if k in (11, 12):
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(FIELDS): hostile_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def mutate(rng: random.Random, body: dict) -> dict:
    out = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        if op == 0 and out:
            out.pop(rng.choice(list(out)))
        elif op == 1:
            out[rng.choice(FIELDS)] = hostile_value(rng)
        elif op == 2 and out:
            out[rng.choice(list(out))] = hostile_value(rng)
        else:
            sp = out.setdefault("sampling_params", {})
            if isinstance(sp, dict):
                sp[rng.choice(["max_new_tokens", "temperature", "top_p", "n", "top_k", "stop"])] = hostile_value(rng)
    return out


def raw_body(rng: random.Random, body: dict) -> tuple[bytes, dict[str, str]]:
    """The encoded body, sometimes corrupted, and request headers (sometimes odd)."""
    data = json.dumps(body).encode()
    k = rng.randrange(10)
    if k == 0:
        data = data[: rng.randrange(len(data) + 1)]
    elif k == 1:
        b = bytearray(data)
        for _ in range(rng.randrange(1, 5)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        data = bytes(b)
    elif k == 2:
        data = rng.choice([b"", b"null", b"[]", b'"s"', b"1e999", b"{" * 5000, b"\xff\xfe{}", b'{"a":1}{"b":2}'])
    headers = {"Content-Type": rng.choice(["application/json", "application/json", "text/plain", "x/y"])}
    if rng.random() < 0.3:
        headers["X-Request-Id"] = rng.choice(["", "id", "x" * 300, "dup", "\t"])
    if rng.random() < 0.1:
        headers["X-data-parallel-rank"] = "abc"
    return data, headers


async def _check(r: aiohttp.ClientResponse, what: str) -> None:
    text = await r.text(errors="replace")
    assert r.status < 500, f"{what}: {r.status} {text[:300]}"
    if r.status >= 400:
        err = json.loads(text)["error"]  # an OpenAI-style JSON error, not text
        assert isinstance(err["message"], str) and err["message"] and err["code"] == r.status, what


async def _still_serves(s: aiohttp.ClientSession, c) -> None:
    r = await s.post(c.url + "/v1/completions", json={"prompt": "valid " * 10, "max_tokens": 2})
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
    svc = c.router.app[SERVICE]
    assert svc.in_flight == 0 and svc.router.load.num_in_flight == 0 and int(svc.router.load.num_requests.sum()) == 0


@pytest.mark.parametrize("protocol,seed", [("sglang", 1), ("vllm", 2), ("none", 3)])
async def test_fuzz_generation_endpoints(protocol, seed):
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=10)
    async with inprocess_cluster(protocol, num_prefill=1, num_decode=1, engine={"zero_delay": True},
                                 router={"max_body_bytes": 1 << 20}) as c, \
            aiohttp.ClientSession(timeout=timeout) as s:
        paths = list(VALID) if protocol != "vllm" else ["/v1/completions", "/v1/chat/completions"]
        for i in range(N_GENERATE):
            path = rng.choice(paths)
            body = mutate(rng, VALID[path]) if rng.random() < 0.9 else VALID[path]
            data, headers = raw_body(rng, body)
            what = f"seed {seed} #{i} POST {path} {data[:300]!r} {headers}"
            async with s.post(c.url + path, data=data, headers=headers) as r:
                await _check(r, what)
        await _still_serves(s, c)


async def test_fuzz_other_endpoints_and_methods():
    rng = random.Random(7)
    timeout = aiohttp.ClientTimeout(total=10)
    async with inprocess_cluster("sglang", num_prefill=1, num_decode=1, engine={"zero_delay": True},
                                 router={"served_model_name": "m"}) as c, aiohttp.ClientSession(timeout=timeout) as s:
        n_before = len(c.router.app[SERVICE].pool.workers)
        for i in range(N_ADMIN):
            k = rng.randrange(6)
            if k == 0:  # admin: add a worker with a hostile body; a success is removed again at once
                body = {"url": rng.choice(["http://127.0.0.1:9", "127.0.0.1:9", "http://u:p@h:1", "http://h:99999",
                                           "http://[::1]:9", "ftp://x", "", "http://" + "a" * 3000, 5]),
                        "role": rng.choice(["decode", "prefill", "mixed", "boss", None])}
                if rng.random() < 0.7:
                    body[rng.choice(["dp_size", "kv_capacity_tokens", "bootstrap_port", "extra"])] = hostile_value(rng)
                data, headers = raw_body(rng, body)
                async with s.post(c.url + "/workers", data=data, headers=headers) as r:
                    await _check(r, f"#{i} POST /workers {data[:200]!r}")
                    if r.status == 201:
                        url = (await r.json())["url"]
                        async with s.delete(c.url + "/workers", params={"url": url}) as d:
                            assert d.status == 200
            elif k == 1:
                q = rng.choice([{}, {"url": ""}, {"url": "http://nope:1"}, {"url": "x" * 5000}, {"urls": "a"}])
                async with s.delete(c.url + "/workers", params=q) as r:
                    await _check(r, f"#{i} DELETE /workers {q}")
            else:
                method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
                path = rng.choice(["/health", "/metrics", "/v1/models", "/workers", "/nope", "/v1/completions",
                                   "/generate", "/" + "z" * 2000, "/%00", "/v1/../workers"])
                async with s.request(method, c.url + path, data=b"{}" if method in ("POST", "PUT") else None,
                                     params={"x": "y" * rng.randrange(100)}) as r:
                    if method == "HEAD" or (method == "POST" and path in ("/v1/completions", "/generate")):
                        assert r.status < 500, f"#{i} {method} {path}: {r.status}"
                    else:
                        await _check(r, f"#{i} {method} {path}")
        assert len(c.router.app[SERVICE].pool.workers) == n_before
        await _still_serves(s, c)
