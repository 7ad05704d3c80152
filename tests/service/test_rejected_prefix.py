"""The router forgets what it recorded of a request an engine refused (review finding: the
approximate prefix index kept the prompt's blocks on the replicas of a request an engine answered
400, though nothing was cached there). Library-level cases with hand counts:
tests/balancer/test_rejected_requests.py."""

from __future__ import annotations

import aiohttp
import pytest

from sim.emulator.testing import inprocess_cluster


@pytest.mark.parametrize("protocol,role", [("none", "mixed"), ("sglang", "prefill"), ("sglang", "decode"),
                                           ("vllm", "prefill"), ("vllm", "decode")])
async def test_a_request_an_engine_refuses_leaves_no_blocks_in_the_prefix_index(protocol, role):
    # review finding: the approximate prefix index kept the prompt's blocks on the replicas of a
    # request the engine answered 400 (nothing cached there); now the router forgets them
    # (Router.on_rejected): a refused prefill leg clears both replicas, a refused decode leg its own
    from balancer.service.app import SERVICE

    async with inprocess_cluster(protocol, num_prefill=1, num_decode=1, engine={"speed": 20.0, "bootstrap_timeout_s": 1.0},
                                 router={"retry": {"max_retries": 0}}) as c, aiohttp.ClientSession() as s:
        bad = c.prefill[0] if role == "prefill" else c.decode[0]
        async with s.post(f"http://127.0.0.1:{bad.port}/emulator/faults",
                          json={"error_rate": 1.0, "error_status": 400}) as r:
            assert r.status == 200
        index = c.router.app[SERVICE].router.index
        async with s.post(c.url + "/v1/completions", json={"prompt": "hello " * 400, "max_tokens": 2}) as r:
            assert r.status == 400, await r.text()
        held = {rep.engine.rsplit(":", 1)[1]: index.num_blocks(rep) for rep in index.replicas()}
        # a refused prefill: the decode gets no KV; SGLang PD, a refused decode: the prefill runs the
        # prompt only after the decode's bootstrap handshake, never made (review R12)
        both = role == "prefill" or protocol == "sglang"
        want_zero = {str(c.decode[0].port)} | ({str(c.prefill[0].port)} if both and protocol != "none" else set())
        assert all(held.get(p, 0) == 0 for p in want_zero | {str(bad.port)}), held
        if protocol == "vllm" and role == "decode":  # vLLM PD: the prefill leg had finished: its record stays
            assert held[str(c.prefill[0].port)] > 0, held
