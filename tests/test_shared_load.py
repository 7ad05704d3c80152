"""The in-flight load block of ``pdlb serve --processes N`` (:mod:`balancer.service.shared_load`):
each process's peer counters are the sum of the other processes' rows, on both of its paths
(slots 0..n-1 in columns 0..n-1: slices; columns mapped elsewhere: a gather). Expected values are
counted by hand from the requests dispatched below."""

from balancer.router import Router
from balancer.service.shared_load import SharedLoad, create_shared_load_block
from balancer.types import ReplicaId, Request

REPS = [ReplicaId(f"e{i}", 0) for i in range(3)]


def _peers(r: Router) -> list[tuple[int, int, int]]:
    t = r.load
    return [(int(t.peer_requests[t.slot(x)]), int(t.peer_prefill_tokens[t.slot(x)]), int(t.peer_kv_tokens[t.slot(x)]))
            for x in REPS]


def test_peer_counters_are_the_other_rows_sums_on_both_paths():
    for columns in (None, {REPS[0]: 6, REPS[1]: 2, REPS[2]: 4}):  # slices, then a gather
        routers = [Router("round_robin", "round_robin", block_size=64) for _ in range(3)]
        for r in routers:
            for x in REPS:
                r.add_replica(x, "mixed")
        shm = create_shared_load_block(3, 8)
        views = [SharedLoad(shm.name, 3, i, columns or REPS, r.load, columns=8) for i, r in enumerate(routers)]
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
