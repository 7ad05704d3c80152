"""Review finding R10: with several router processes, a prompt an engine refused (4xx) no longer
stays "cached" in the other processes' approximate prefix index. The routing process forgets it
(``Router.on_rejected``) and retracts the decision through its ring
(:meth:`balancer.service.processes.shared_prefix.PrefixShare.retract`); every reader drops the
blocks its router recorded for that decision, unless something touched them since.

Library level with real routers and rings (two or three "processes" in one interpreter), then a
real ``pdlb serve --processes 2`` in front of a decode engine that refuses everything. Expected
block counts are hand counts of the prompts' blocks (16-token blocks; comments give each)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import pytest

from balancer.router import Router
from balancer.service.processes.shared_prefix import PrefixShare
from balancer.types import Role
from balancer_factories import blocks, req, rid

BS = 16
M = rid("m", 0)


def prompt(n_blocks: int, tail: int = 0) -> tuple[int, ...]:
    """Chained hashes: a shared first block 7, then ``n_blocks - 1`` blocks (distinct per ``tail``)."""
    return blocks([7] + [1000 * (tail + 1) + i for i in range(n_blocks - 1)])


class Proc:
    """One router process: a router with one mixed replica and its side of the rings."""

    def __init__(self, directory: str, processes: int, index: int) -> None:
        self.share = PrefixShare(directory, processes, index,
                                 record=lambda reps, hs, t: self.router.record_routed(reps, hs, t),
                                 forget=lambda rep, hs, t: self.router.forget_recorded(rep, hs, t))
        self.router = Router("round_robin", "round_robin", block_size=BS, listeners=[self.share.publish],
                             reject_listeners=[self.share.retract])
        self.router.add_replica(M, Role.MIXED)

    def held(self) -> int:
        return self.router.index.num_blocks(M)


@pytest.fixture
def procs(tmp_path):
    made: list[Proc] = []

    def make(n: int) -> list[Proc]:
        made.extend(Proc(str(tmp_path), n, k) for k in range(n))
        return made

    yield make
    for p in made:
        asyncio.run(p.share.close())


def test_a_refused_prompt_is_forgotten_by_the_process_that_read_it(procs):
    a, b = procs(2)
    big = prompt(6)  # 6 blocks, nothing held before
    route = a.router.route(req("r1", 6 * BS, block_hashes=big), 1.0)
    assert b.share.drain() == 1 and b.held() == 6  # b recorded a's decision
    assert a.router.on_rejected(route, big, 1.0, by_prefill=False) == 6
    assert a.share.retracted == 1 and a.held() == 0
    assert b.share.drain() == 1  # the retraction
    assert b.held() == 0 and b.share.forgotten == 6


def test_the_blocks_the_replica_held_before_stay_everywhere(procs):
    a, b = procs(2)
    held = prompt(2)  # 2 blocks, served and accepted earlier
    a.router.route(req("r0", 2 * BS, block_hashes=held), 1.0)
    a.router.on_finished("r0", 1.5)
    big = held + prompt(6, tail=1)[2:]  # the same 2 blocks, then 4 new ones: 6 blocks
    route = a.router.route(req("r1", 6 * BS, block_hashes=big), 2.0)
    assert route.decode_matched_tokens == 2 * BS
    b.share.drain()
    assert b.held() == 6
    a.router.on_rejected(route, big, 2.0, by_prefill=False)
    b.share.drain()
    # kept: ceil(32 matched tokens / 16) = 2 blocks; the 4 new ones dropped, in both processes
    assert a.held() == 2 and b.held() == 2 and b.router.index.match_replica(M, big) == 2


def test_blocks_the_reader_routed_to_since_stay(procs):
    a, b = procs(2)
    big = prompt(4)
    route = a.router.route(req("r1", 4 * BS, block_hashes=big), 1.0)
    b.share.drain()
    b.router.route(req("own", 3 * BS, block_hashes=big[:3]), 5.0)  # b routes 3 of the blocks there later
    a.router.on_rejected(route, big, 1.0, by_prefill=False)
    b.share.drain()
    assert b.held() == 3 and b.router.index.match_replica(M, big) == 3  # only the 4th block dropped


def test_a_decision_folded_with_an_accepted_identical_one_keeps_its_blocks(procs):
    a, b, c = procs(3)
    big = prompt(5)
    route = a.router.route(req("r1", 5 * BS, block_hashes=big), 1.0)
    c.router.route(req("r2", 5 * BS, block_hashes=big), 1.1)  # the same prompt to the same replica, accepted
    assert b.share.drain() == 2 and b.share.folded == 1 and b.held() == 5
    a.router.on_rejected(route, big, 1.0, by_prefill=False)
    b.share.drain()
    assert b.held() == 5 and b.share.forgotten == 0  # c's request holds them
    c.share.drain()  # c read a's decision and its retraction in one drain: c's own record stays
    assert c.held() == 5


def test_a_retraction_of_a_decision_never_read_changes_nothing(procs):
    a, b = procs(2)
    big = prompt(3)
    route = a.router.route(req("r1", 3 * BS, block_hashes=big), 1.0)
    b.share.drain()
    b.share._applied.clear()  # as if forgotten (APPLIED_ENTRIES newer decisions applied since)
    b.router.route(req("own", 3 * BS, block_hashes=big), 2.0)  # b's own copy of the prompt
    a.router.on_rejected(route, big, 1.0, by_prefill=False)
    b.share.drain()
    assert b.held() == 3 and b.share.forgotten == 0


# ------------------------------------------------------------------ live: pdlb serve --processes 2


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert m is not None, f"{name}{{{labels}}} not in the scrape"
    return float(m.group(1))


def test_a_refused_prompt_is_cached_in_no_process_of_pdlb_serve():
    """The review's run: SGLang PD, a decode engine answering 400 to everything, ``pdlb serve
    --processes 2``, the same 699-token prompt 8 times (all 400), spread over both processes (the
    parent hands connections out in turn, ``--connection-placement round_robin``: one connection per
    request). Before: the decode pool's
    prefix match ratio summed to 6.41 over the 8 decisions (the other process's copy matched
    640/699 tokens); now every decision matches nothing (sum 0.0), as with one process."""
    from sim.emulator.testing import spawn_engines, _spawn

    engines = spawn_engines([("prefill", "--zero-delay"),  # bootstrap served on its HTTP port
                             ("decode", "--zero-delay", "--error-rate", "1", "--error-status", "400")])
    pre, dec = engines
    router = None
    try:
        router = _spawn(["serve", "--port", "0", "--pd-protocol", "sglang", "--processes", "2",
                         "--connection-placement", "round_robin",  # both processes route (a light load)
                         "--prefill", f"{pre.url},bootstrap={pre.port}", "--decode", dec.url,
                         "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware",
                         "--max-retries", "0"], timeout_s=120)
        body = json.dumps({"model": "pdlb-emulated", "prompt": list(range(1, 700)), "max_tokens": 2}).encode()
        statuses = []
        for _ in range(8):
            rq = urllib.request.Request(router.url + "/v1/completions", data=body,
                                        headers={"Content-Type": "application/json", "Connection": "close"})
            try:
                with urllib.request.urlopen(rq, timeout=30) as r:
                    statuses.append(r.status)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
            time.sleep(0.1)  # the other process drains the rings (after its next pass, at most 20 ms)
        assert statuses == [400] * 8
        with urllib.request.urlopen(router.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        assert _metric(text, "pdlb_prefix_match_ratio_count", 'pool="decode"') == 8
        assert _metric(text, "pdlb_prefix_match_ratio_sum", 'pool="decode"') == 0.0
        # the process that answered the scrape (its ring counters are brought up to date then) routed
        # and retracted some of the 8, not all: the other process routed the rest (connections are
        # handed to the processes in turn), so each read the other's decisions and retractions
        retracted = [float(x) for x in re.findall(r'^pdlb_shared_prefix_decisions_total\{kind="retracted",process="\d"\} (\S+)$',
                                                  text, re.M)]
        assert retracted and 1 <= retracted[0] <= 7, retracted
    finally:
        for p in ([router] if router else []) + engines:
            p.popen.terminate()
        for p in ([router] if router else []) + engines:
            p.popen.wait(15)


def test_malformed_records_are_skipped_and_the_reader_lives_on(procs):
    """Records a torn or foreign writer could leave: an empty body, a retraction-looking body that
    is not msgpack, a retraction of a decision that is not one, a retraction naming an unknown
    replica. Each is skipped (logged), and a good decision after them is still recorded."""
    import msgpack

    a, b = procs(2)
    a.share._append(b"", 1.0)  # record of 8 bytes: a time, no msgpack
    a.share._append(b"\x92\xc4\x03abc", 1.0)  # [bin(3), <missing>]: truncated
    a.share._append(msgpack.packb([b"not a decision", [["m", 0, 0]]]), 1.0)
    a.share._append(msgpack.packb([msgpack.packb([[["m", 0]], [1, 2]]), [["nowhere", 3, 0]]]), 1.0)
    good = prompt(3)
    a.router.route(req("r1", 3 * BS, block_hashes=good), 2.0)
    assert b.share.drain() == 5
    assert b.held() == 3 and b.share.forgotten == 0
