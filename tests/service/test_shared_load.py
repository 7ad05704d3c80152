"""The in-flight load block of ``pdlb serve --processes N`` (:mod:`balancer.service.processes.shared_load`):
each process's peer counters are the sum of the other processes' rows, on both of its paths
(slots 0..n-1 in columns 0..n-1: slices; columns mapped elsewhere: a gather). Expected values are
counted by hand from the requests dispatched below."""

from balancer.parts import LoadSources
from balancer.router import Router
from balancer.service.processes.shared_load import SharedLoad, create_shared_load_block
from balancer.types import ReplicaId, Request

REPS = [ReplicaId(f"e{i}", 0) for i in range(3)]


def _peers(r: Router) -> list[tuple[int, int, int]]:
    t = r.load
    return [(int(t.peer_requests[t.slot(x)]), int(t.peer_prefill_tokens[t.slot(x)]), int(t.peer_kv_tokens[t.slot(x)]))
            for x in REPS]


def _with_views(shm, processes: int, policy: str, columns=None) -> tuple[list[Router], list[SharedLoad]]:  # noqa: ANN001
    """``processes`` routers, each built with its view of ``shm`` (8 columns) as its peer load
    source, REPS registered and mapped to ``columns`` (default: 0, 1, 2)."""
    views = [SharedLoad(shm.name, processes, i, columns=8) for i in range(processes)]
    routers = [Router(policy, policy, block_size=64, load_sources=LoadSources(peer=v)) for v in views]
    for r, v in zip(routers, views):
        for x in REPS:
            r.add_replica(x, "mixed")
        v.add(columns or REPS)
    return routers, views


def test_peer_counters_are_the_other_rows_sums_on_both_paths():
    for columns in (None, {REPS[0]: 6, REPS[1]: 2, REPS[2]: 4}):  # slices, then a gather
        shm = create_shared_load_block(3, 8)
        routers, views = _with_views(shm, 3, "round_robin", columns)
        try:
            assert views[0]._fast is (columns is None)  # noqa: SLF001 - the path under test
            # process 0: 2 requests of 100 prompt tokens; process 1: 1 of 300; round robin from e0
            for i in range(2):
                routers[0].route(Request(f"a{i}", 0.0, 100, (), max_output_tokens=10), 0.0)
            routers[1].route(Request("b0", 0.0, 300, (), max_output_tokens=10), 0.0)
            for v in views:
                v.refresh()
            own0 = [(int(routers[0].load.num_requests[routers[0].load.slot(x)])) for x in REPS]
            assert own0 == [1, 1, 0]  # e0, e1 (round robin)
            # process 2 sees both others: e0 holds a0 (100) and b0 (300), e1 holds a1 (100)
            p2 = _peers(routers[2])
            assert [p[0] for p in p2] == [2, 1, 0]
            # process 0 sees only process 1's request, process 1 only process 0's two
            assert [p[0] for p in _peers(routers[0])] == [1, 0, 0]
            assert [p[0] for p in _peers(routers[1])] == [1, 1, 0]
            kv2 = [p[2] for p in p2]
            kv0, kv1 = [p[2] for p in _peers(routers[0])], [p[2] for p in _peers(routers[1])]
            assert [a + b for a, b in zip(kv0, kv1)] == kv2  # each process's own KV counted once in p2
            assert kv0[0] > kv1[0] > 0  # b0's 300-token prompt outweighs a0's 100 on e0
        finally:
            for v in views:
                v.close()
            shm.close()
            shm.unlink()


async def test_coalesced_views_write_and_read_once_per_event_loop_pass():
    """coalesce_in(loop), as pdlb serve runs it: process 0's two dispatches in one pass reach
    the block once, when the pass ends (until then process 1 reads its old row, 0); process 1's
    peer sums are read at its first decision of a pass and not again in that pass (a change of
    process 0 made meanwhile shows from the next pass on), except by a forced refresh (a
    scrape). Expected counts by hand: round robin over e0, e1, e2 from e0."""
    import asyncio

    shm = create_shared_load_block(2, 8)
    routers, views = _with_views(shm, 2, "round_robin")
    loop = asyncio.get_running_loop()
    writes = [0, 0]
    for i, v in enumerate(views):
        v.coalesce_in(loop)
        write = v._write  # noqa: SLF001 - counted: the behaviour under test

        def counted(i=i, write=write) -> None:
            writes[i] += 1
            write()

        v._write = counted  # type: ignore[method-assign]  # noqa: SLF001
    try:
        routers[0].route(Request("a0", 0.0, 100, (), max_output_tokens=10), 0.0)
        routers[0].route(Request("a1", 0.0, 100, (), max_output_tokens=10), 0.0)
        views[1].refresh()
        assert [p[0] for p in _peers(routers[1])] == [0, 0, 0]  # process 0's row not written yet
        await asyncio.sleep(0)  # the pass ends
        await asyncio.sleep(0)
        assert writes[0] == 1  # two dispatches (and two refreshes), one write
        views[1].refresh()  # a new pass: read afresh
        assert [p[0] for p in _peers(routers[1])] == [1, 1, 0]
        routers[0].route(Request("a2", 0.0, 100, (), max_output_tokens=10), 0.0)
        views[0].refresh(force=True)  # writes nothing: only reads (its row is written at the pass's end)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        views[1].refresh()
        views[1].refresh()
        assert [p[0] for p in _peers(routers[1])] == [1, 1, 1]
        routers[0].on_finished("a0", 1.0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        views[1].refresh()  # a new pass: a0's release seen
        assert [p[0] for p in _peers(routers[1])] == [0, 1, 1]
        # within that same pass: process 0 releases a1 and its row is written at once (as by a
        # pass of its own): process 1's second refresh of the pass does not read it, a forced one does
        routers[0].on_finished("a1", 2.0)
        views[0]._write()  # noqa: SLF001
        views[1].refresh()
        assert [p[0] for p in _peers(routers[1])] == [0, 1, 1]
        views[1].refresh(force=True)
        assert [p[0] for p in _peers(routers[1])] == [0, 0, 1]
        assert writes[1] == 0  # process 1 never changed its counts: its row was never rewritten
    finally:
        for v in views:
            v.close()
        shm.close()
        shm.unlink()


def test_policies_that_read_no_load_skip_the_peer_refresh_and_peer_sums():
    """round_robin and random read no load (Policy.uses_load False): the router neither refreshes
    the shared view before a decision nor adds the peers' counts to the candidates; a load-aware
    policy (least_load) does both. Counted with a stand-in peer view whose arrays hold 7s."""
    from balancer.policies import make_policy

    class Peer:
        def __init__(self) -> None:
            self.refreshes = self.publishes = 0

        def bind(self, tracker) -> None:  # noqa: ANN001
            pass

        def refresh(self, force: bool = False) -> None:
            self.refreshes += 1

        def publish(self) -> None:
            self.publishes += 1

    seen: list[list[int]] = []

    class Spy(type(make_policy("least_load"))):  # type: ignore[misc]
        name = "spy_least_load"

        def select(self, request, cands, ctx):  # noqa: ANN001, ANN201
            seen.append([int(x) for x in cands.num_requests])
            return super().select(request, cands, ctx)

    for policy, uses in (("round_robin", False), ("random", False), ("least_load", True)):
        peer = Peer()
        r = Router(policy, policy, block_size=64, load_sources=LoadSources(peer=peer))
        assert r.uses_load() is uses
        assert r.uses_prefix_index() is (policy == "least_load")
        for x in REPS:
            r.add_replica(x, "mixed")
        r.load.peer_requests[:] = 7
        r.route(Request("q", 0.0, 100, (), max_output_tokens=10), 0.0)
        assert peer.refreshes == (1 if uses else 0)
        assert peer.publishes >= 1  # its own row is still written (other processes and scrapes read it)
    r = Router("round_robin", "round_robin", block_size=64, load_sources=LoadSources(peer=Peer()))
    r.decode_policy = r.prefill_policy = Spy()  # a policy object set later is honoured
    for x in REPS:
        r.add_replica(x, "mixed")
    r.load.peer_requests[:] = 7
    r.route(Request("s", 0.0, 100, (), max_output_tokens=10), 0.0)
    assert seen == [[7, 7, 7]] and r.load.peer.refreshes == 1


def test_prefill_policy_counts_only_with_prefill_replicas():
    """A router of mixed replicas never runs its prefill policy, so that policy's reads do not
    count: ``pdlb serve --mixed ... --decode-policy round_robin`` (the prefill policy left at its
    default, ep_aware, which reads both) refreshes no peer load per decision and starts no decision
    rings (issue 26: 2 processes on one CPU, 258-270 us per request as before against 212-228 with
    both off, one process 206). Registering a prefill replica makes the prefill policy count."""
    class Peer:
        refreshes = 0

        def bind(self, tracker) -> None:  # noqa: ANN001
            pass

        def refresh(self, force: bool = False) -> None:
            Peer.refreshes += 1

        def publish(self) -> None:
            pass

    r = Router("ep_aware", "round_robin", block_size=64, load_sources=LoadSources(peer=Peer()))
    for x in REPS:
        r.add_replica(x, "mixed")
    assert r.uses_load() is False and r.uses_prefix_index() is False
    r.route(Request("q", 0.0, 100, (), max_output_tokens=10), 0.0)
    assert Peer.refreshes == 0
    pre = ReplicaId("http://p:1", 0)
    r2 = Router("ep_aware", "round_robin", block_size=64)
    r2.add_replica(pre, "prefill")
    r2.add_replica(ReplicaId("http://d:1", 0), "decode")
    assert r2.uses_load() is True and r2.uses_prefix_index() is True
    r2.set_healthy(pre, False)  # registered, unhealthy: still counts (health flaps must not switch sharing)
    assert r2.uses_load() is True
    r2.remove_replica(pre)
    assert r2.uses_load() is False and r2.uses_prefix_index() is False
    restored = Router.restore(r2.snapshot())
    assert restored.uses_load() is False
