"""PrefixIndex (radix tree) and BlockIndex (flat): hand-worked LRU orders, exact TTL boundaries,
and Hypothesis properties checked against an independent list-based reference model
(``RefIndex`` below). Both indexes must give the same answers on prompts inserted whole; the
tree's own structure (runs splitting and merging) is tested at the end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.block_index import BlockIndex
from balancer.prefix_index import PrefixIndex
from balancer_factories import blocks, rid

R0, R1, R2 = rid("r", 0), rid("r", 1), rid("r", 2)
REPLICAS = [R0, R1, R2]
INDEXES = [PrefixIndex, BlockIndex]
both = pytest.mark.parametrize("Index", INDEXES)


class RefIndex:
    """Independent reference: per replica a plain list of [hash, time], oldest first."""

    def __init__(self, cap, ttl):
        self.cap, self.ttl = cap, ttl
        self.lists = {r: [] for r in REPLICAS}

    def insert(self, r, hs, now):
        lst = self.lists[r]
        hs = list(hs) if self.cap is None else list(hs)[: self.cap]
        for h in reversed(hs):  # deepest first -> root ends most recent
            for e in lst:
                if e[0] == h:
                    lst.remove(e)
                    break
            lst.append([h, now])
        evicted = []
        while self.cap is not None and len(lst) > self.cap:
            evicted.append(lst.pop(0)[0])
        return evicted

    def remove(self, r, hs):
        lst = self.lists[r]
        before = len(lst)
        self.lists[r] = [e for e in lst if e[0] not in set(hs)]
        return before - len(self.lists[r])

    def clear(self, r):
        n = len(self.lists[r])
        self.lists[r] = []
        return n

    def expire(self, now):
        if self.ttl is None:
            return 0
        n = 0
        for r in REPLICAS:
            keep = [e for e in self.lists[r] if now - e[1] <= self.ttl]
            n += len(self.lists[r]) - len(keep)
            self.lists[r] = keep
        return n

    def match(self, r, query):
        held = {e[0] for e in self.lists[r]}
        k = 0
        for h in query:
            if h not in held:
                break
            k += 1
        return k


# ---------------------------------------------------------------------------------- hand cases
@both
def test_deepest_first_touch_and_lru_eviction_by_hand(Index):
    a, b, c = blocks([1, 2, 3])  # prompt X = [a, b, c]
    _, d = blocks([1, 4])  # prompt Y = [a, d] shares root a
    idx = Index(capacity_blocks=3)
    assert idx.insert(R0, [a, b, c], 0.0) == []
    # hand: touched c, b, a -> LRU (oldest first) c, b, a: root most recent
    assert idx.lru_order(R0) == [c, b, a]
    # hand: insert Y touches d then a -> c, b, d, a -> over cap 3 -> evict c (a leaf of X)
    assert idx.insert(R0, [a, d], 1.0) == [c]
    assert idx.lru_order(R0) == [b, d, a]
    assert idx.match([a, b, c]) == {R0: 2}
    assert idx.match([a, d]) == {R0: 2}
    # hand: X again touches c, b, a -> evicts d (oldest) only: order... b,d,a + c -> b,d,a,c -> evict b?
    # walk: touch c (new) -> [b,d,a,c]; touch b -> [d,a,c,b]; touch a -> [d,c,b,a]; evict d
    assert idx.insert(R0, [a, b, c], 2.0) == [d]
    assert idx.lru_order(R0) == [c, b, a]


@both
def test_prompt_longer_than_capacity_keeps_its_first_blocks(Index):
    hs = blocks(range(6))
    idx = Index(capacity_blocks=4)
    old = blocks([9])
    idx.insert(R0, old, 0.0)
    # hand: keeps hs[:4], touched deepest-first -> [h3, h2, h1, h0]; the old block is evicted
    assert idx.insert(R0, hs, 1.0) == [old[0]]
    assert idx.lru_order(R0) == [hs[3], hs[2], hs[1], hs[0]]
    assert idx.match(hs) == {R0: 4}


@both
def test_match_multiple_replicas_and_restriction(Index):
    hs = blocks([1, 2, 3, 4])
    idx = Index()
    idx.insert(R0, hs, 0.0)  # full 4
    idx.insert(R1, hs[:2], 0.0)  # 2
    idx.insert(R2, blocks([7, 8]), 0.0)  # other root: no match
    assert idx.match(hs) == {R0: 4, R1: 2}
    assert idx.match(hs, replicas=[R1, R2]) == {R1: 2}
    assert idx.match(hs[:3]) == {R0: 3, R1: 2}
    assert idx.match(()) == {}
    assert idx.match_replica(R0, hs) == 4 and idx.match_replica(R1, hs) == 2 and idx.match_replica(R2, hs) == 0
    # a different prompt diverging at block 2 matches only the shared prefix
    assert idx.match(blocks([1, 2, 9, 9])) == {R0: 2, R1: 2}


@both
def test_remove_and_clear_update_holders(Index):
    hs = blocks([1, 2, 3, 4])
    idx = Index()
    idx.insert(R0, hs, 0.0)
    idx.insert(R1, hs, 0.0)
    # hand: removing blocks 2,3 on R0 (plus one it never held) -> 2 removed; R0 now matches 2
    assert idx.remove(R0, [hs[2], hs[3], 12345]) == 2
    assert idx.match(hs) == {R0: 2, R1: 4}
    assert idx.holds(R1, hs[3]) and not idx.holds(R0, hs[3])
    assert idx.num_unique_blocks() == 4  # R1 still holds all 4
    # removing the root on R1 drops its whole match even though deeper blocks stay
    assert idx.remove(R1, [hs[0]]) == 1
    assert idx.match(hs) == {R0: 2}
    assert idx.clear(R0) == 2
    assert idx.match(hs) == {}
    # hand: only R1's hs[1..3] remain
    assert idx.num_unique_blocks() == 3 and idx.num_blocks() == 3 and idx.replicas() == [R1]
    assert idx.clear(R1) == 3 and idx.num_unique_blocks() == 0
    assert idx.clear(R2) == 0 and idx.remove(R2, hs) == 0


@both
def test_replica_churn_reuses_holder_numbers_and_keeps_matches_apart(Index):
    # Holders are bit sets; a cleared replica's number is reused by the next new replica, so the
    # index does not grow with replica churn. The new replica must not inherit the old one's blocks.
    hs = blocks([1, 2, 3])
    idx = Index()
    for k in range(50):  # 50 generations of a replica that comes and goes
        gone = rid("tmp", k)
        idx.insert(gone, hs, 0.0)
        idx.insert(R0, hs[:1], 0.0)
        # hand: R0 holds block 0 only, the temporary replica all 3
        assert idx.match(hs) == {gone: 3, R0: 1}
        assert idx.clear(gone) == 3
        assert idx.match(hs) == {R0: 1}
    if Index is PrefixIndex:  # (the tree's numbers are public: the router's hot path reads them)
        # hand: the first temporary replica took number 0, R0 number 1; every later one reused 0
        assert idx.numbers((R0,)).tolist() == [1] and len(idx.match_depths(hs)) == 2


@both
def test_match_with_many_replicas_beyond_one_machine_word(Index):
    # 200 replicas (bit numbers up to 199): replica i holds the first i % 7 blocks of one prompt.
    hs = blocks(list(range(1, 7)))
    idx = Index()
    reps = [rid("w", i) for i in range(200)]
    for i, r in enumerate(reps):
        if i % 7:
            idx.insert(r, hs[: i % 7], float(i))
    # expected by construction, independent of the index: {replica i: i % 7} for i % 7 > 0
    assert idx.match(hs) == {r: i % 7 for i, r in enumerate(reps) if i % 7}
    if Index is PrefixIndex:  # the vectorised form the router reads
        nums = idx.numbers(tuple(reps))
        depths = idx.match_depths(hs)
        assert [int(depths[k]) if k >= 0 else 0 for k in nums] == [i % 7 for i in range(200)]
    # restricted to a subset of candidates
    sub = reps[150:160]
    assert idx.match(hs, sub) == {r: i % 7 for i, r in enumerate(reps) if 150 <= i < 160 and i % 7}


@both
@pytest.mark.parametrize("t", [0.0, 5.0, 0.3, 0.1, 1.7, 123.5, 1e6 + 0.3])
def test_ttl_exact_boundary(Index, t):
    # documented rule: a block touched at t survives while now - t <= ttl, dropped once > ttl.
    # now = t + 10 (rounded as a float); pick cases where (t + 10) - t == 10 exactly in floats.
    ttl = 10.0
    now = t + ttl
    assert now - t == ttl  # precondition: the boundary is exact for this t
    hs = blocks([1, 2])
    idx = Index(ttl_s=ttl)
    idx.insert(R0, hs, t)
    assert idx.expire(now) == 0
    assert idx.match(hs) == {R0: 2}
    eps = max(1e-9, abs(now) * 1e-12)
    assert idx.expire(now + eps) == 2
    assert idx.match(hs) == {} and idx.num_unique_blocks() == 0


@both
def test_ttl_touch_refreshes_and_expires_per_block(Index):
    a, b, c = blocks([1, 2, 3])
    idx = Index(ttl_s=10.0)
    idx.insert(R0, [a, b, c], 0.0)
    idx.insert(R0, [a], 6.0)  # refresh root only
    # hand: at 12: b, c touched at 0 (12 > 10) go; a touched at 6 stays
    assert idx.expire(12.0) == 2
    assert idx.lru_order(R0) == [a] and idx.match([a, b, c]) == {R0: 1}
    assert Index().expire(1e9) == 0  # no TTL: nothing expires


@both
def test_constructor_validation(Index):
    for kw in (dict(capacity_blocks=0), dict(ttl_s=0), dict(ttl_s=-1.0)):
        with pytest.raises(ValueError):
            Index(**kw)


# ---------------------------------------------------------------------------------- properties
# prompts are paths in a small tree (ids 0..2, length 0..6) so prompts share prefixes often
prompt_ids = st.lists(st.integers(0, 2), min_size=0, max_size=6)
op = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 2), prompt_ids, st.integers(0, 3)),
    st.tuples(st.just("remove"), st.integers(0, 2), prompt_ids, st.integers(0, 3)),
    st.tuples(st.just("clear"), st.integers(0, 2), prompt_ids, st.integers(0, 3)),
    st.tuples(st.just("expire"), st.integers(0, 2), prompt_ids, st.integers(0, 3)),
)


@settings(max_examples=150, deadline=None)
@given(
    cap=st.one_of(st.none(), st.integers(1, 8)),
    ttl=st.one_of(st.none(), st.sampled_from([1.0, 2.5, 4.0])),
    ops=st.lists(op, max_size=40),
    queries=st.lists(prompt_ids, min_size=1, max_size=5),
)
@both
def test_index_matches_reference_model(Index, cap, ttl, ops, queries):
    idx = Index(capacity_blocks=cap, ttl_s=ttl)
    ref = RefIndex(cap, ttl)
    ever = {r: [] for r in REPLICAS}  # every prompt ever inserted per replica
    now = 0.0
    for kind, ri, ids, dt in ops:
        now += dt * 0.5  # monotone clock in exact binary fractions
        r = REPLICAS[ri]
        hs = blocks(ids)
        if kind == "insert":
            assert idx.insert(r, hs, now) == ref.insert(r, hs, now)  # evicted = exactly the LRU ones
            ever[r].append(hs)
        elif kind == "remove":
            sub = hs[len(hs) // 2 :]
            assert idx.remove(r, sub) == ref.remove(r, sub)
        elif kind == "clear":
            assert idx.clear(r) == ref.clear(r)
        else:
            assert idx.expire(now) == ref.expire(now)
        for rr in REPLICAS:
            assert idx.lru_order(rr) == [e[0] for e in ref.lists[rr]]
            if cap is not None:
                assert idx.num_blocks(rr) <= cap
        if cap is not None:
            assert idx.num_unique_blocks() <= len(REPLICAS) * cap
        held = set().union(*(set(idx.lru_order(rr)) for rr in REPLICAS))
        assert idx.num_unique_blocks() == len(held)
        assert idx.num_blocks() == sum(len(ref.lists[rr]) for rr in REPLICAS)
    for ids in queries:
        q = blocks(ids)
        got = idx.match(q)
        for r in REPLICAS:
            exp = ref.match(r, q)
            assert got.get(r, 0) == exp
            assert idx.match_replica(r, q) == exp
            # never more than the query, nor than the longest common prefix with an inserted prompt
            lcp = max((sum(1 for _ in _common(p, q)) for p in ever[r]), default=0)
            assert got.get(r, 0) <= min(len(q), lcp)
        assert all(v >= 1 for v in got.values())
        if Index is PrefixIndex:  # the vectorised form (the router's hot path) agrees too
            depths, nums = idx.match_depths(q), idx.numbers(tuple(REPLICAS))
            for k, r in enumerate(REPLICAS):
                assert (int(depths[nums[k]]) if nums[k] >= 0 else 0) == ref.match(r, q)


def _common(p, q):
    for x, y in zip(p, q):
        if x != y:
            return
        yield x


@settings(max_examples=60, deadline=None)
@given(
    cap=st.integers(1, 5),
    ops=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 50), max_size=10)), max_size=60),
)
@both
def test_memory_bounded_with_many_distinct_blocks(Index, cap, ops):
    idx = Index(capacity_blocks=cap)
    for ri, ids in ops:
        idx.insert(REPLICAS[ri], blocks(ids), 0.0)
        assert max(idx.num_blocks(r) for r in REPLICAS) <= cap
        assert idx.num_unique_blocks() <= len(REPLICAS) * cap
        assert idx.num_blocks() <= len(REPLICAS) * cap


@settings(max_examples=100, deadline=None)
@given(
    cap=st.integers(2, 12),
    ops=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1, max_size=10), st.booleans()),
        max_size=50,
    ),
)
@both
def test_evicted_order_matches_reference_for_interleaved_partial_evictions(Index, cap, ops):
    # Prompts longer than a third of the capacity, interleaved over 3 replicas, so most inserts
    # evict part of one earlier insert and part of another (and re-touch shared prefixes in
    # between); some steps also remove the second half of the prompt (stale LRU entries).
    # Expected: the independent list model RefIndex, evicted hashes oldest first, after every step.
    idx = Index(capacity_blocks=cap)
    ref = RefIndex(cap, None)
    for step, (ri, ids, remove_tail) in enumerate(ops):
        r = REPLICAS[ri]
        hs = blocks(ids)
        assert idx.insert(r, hs, float(step)) == ref.insert(r, hs, float(step))
        if remove_tail:
            tail = hs[len(hs) // 2 :]
            assert idx.remove(r, tail) == ref.remove(r, tail)
        assert idx.lru_order(r) == [e[0] for e in ref.lists[r]]
    # the same prompt re-inserted many times keeps exactly its blocks, in the reference order
    hs = blocks([0, 1, 2, 3, 0, 1])
    for step in range(200):
        assert idx.insert(R0, hs, 100.0 + step) == ref.insert(R0, hs, 100.0 + step)
    assert idx.lru_order(R0) == [e[0] for e in ref.lists[R0]] and idx.num_blocks(R0) == len(ref.lists[R0])
    # hand: the last insert keeps the prompt's first min(cap, 6) blocks, all most recently used
    assert idx.match(hs).get(R0, 0) == min(cap, len(hs))


# ---------------------------------------------------------------------------------- the tree
def check_tree(idx: PrefixIndex) -> None:
    """Structural invariants of the radix tree, from its parts (independent of how it got there):
    every block maps to the node whose run holds it; holders == the replicas with an entry;
    every non-root node is held or has children; each replica's LRU list holds exactly its nodes
    and its block count, with non-decreasing times; unique blocks == blocks of held runs."""
    seen_blocks, unique, stack = 0, 0, [idx._root]
    node_of = idx._node_of  # None until built (block_map=False and no remove()/holds() yet)
    per_replica: dict[int, set] = {}
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and child.blocks[0] == key
            stack.append(child)
        if node is idx._root:
            continue
        assert node.blocks and (node.holders or node.children)
        if node_of is not None:
            for h in node.blocks:
                assert node_of[h] is node
        seen_blocks += len(node.blocks)
        assert node.holders == sum(1 << num for num in node.entries)
        unique += len(node.blocks) if node.holders else 0
        for num, e in node.entries.items():
            assert e.node is node
            per_replica.setdefault(num, set()).add(id(node))
    assert unique == idx.num_unique_blocks()
    assert node_of is None or seen_blocks == len(node_of)
    for rs in idx._state.values():
        nodes, count, e, last = set(), 0, rs.head.next, float("-inf")
        while e is not rs.head:
            assert e.next.prev is e and e.node.entries[rs.num] is e
            assert e.time >= last  # LRU order is time order (expire() stops at the first live one)
            last = e.time
            nodes.add(id(e.node))
            count += len(e.node.blocks)
            e = e.next
        assert nodes == per_replica.get(rs.num, set()) and count == rs.blocks


def test_runs_split_where_prompts_diverge_and_end():
    # hand: X = 6 blocks, Y shares X's first 3, Z is X's first 2: runs [x0 x1] [x2] [x3..x5] [y3 y4]
    x = blocks([1, 2, 3, 4, 5, 6])
    y = blocks([1, 2, 3, 7, 8])
    z = x[:2]
    idx = PrefixIndex()
    idx.insert(R0, x, 0.0)
    assert idx.num_nodes() == 1
    idx.insert(R1, y, 1.0)
    assert idx.num_nodes() == 3  # [x0..x2] [x3..x5] [y3 y4]
    idx.insert(R2, z, 2.0)
    assert idx.num_nodes() == 4  # [x0 x1] [x2] [x3..x5] [y3 y4]
    check_tree(idx)
    assert idx.match(x) == {R0: 6, R1: 3, R2: 2}
    assert idx.match(y) == {R0: 3, R1: 5, R2: 2}
    assert idx.match(x[:4] + (12345,)) == {R0: 4, R1: 3, R2: 2}  # diverges inside a run
    # splits keep each holder's block order: R0 still sees X touched deepest-first
    assert idx.lru_order(R0) == list(reversed(x))
    assert idx.lru_order(R1) == list(reversed(y))


def test_eviction_split_then_retouch_merges_the_run_back():
    # hand (LRU lists oldest first): R0 and R1 hold X = [a..f] (cap 6). Y = [g, h] on R0:
    # R0 = f e d c b a h g -> 8 > 6 -> evicts f, e; X splits into [a..d] [e f] (R1 holds both).
    x = blocks([1, 2, 3, 4, 5, 6])
    y = blocks([9, 10])
    idx = PrefixIndex(capacity_blocks=6)
    idx.insert(R0, x, 0.0)
    idx.insert(R1, x, 0.0)
    assert idx.insert(R0, y, 1.0) == [x[5], x[4]]
    assert idx.num_nodes() == 3 and idx.match(x) == {R0: 4, R1: 6}
    check_tree(idx)
    # X again on R0: touches f e d c b a -> h g f e d c b a -> evicts h, g. R0 and R1 now hold
    # [e f] just before [a..d] in their lists, so nobody can tell the runs apart: merged.
    assert idx.insert(R0, x, 2.0) == [y[1], y[0]]
    assert idx.num_nodes() == 1 and idx.match(x) == {R0: 6, R1: 6}
    check_tree(idx)


def test_insert_of_a_chain_fragment_is_refused_and_changes_no_answer():
    x = blocks([1, 2, 3])
    idx = PrefixIndex(block_map=True)
    idx.insert(R0, x, 0.0)
    with pytest.raises(ValueError, match="leading blocks"):
        idx.insert(R1, x[1:], 1.0)  # blocks 1.. without block 0: already indexed under block 0
    assert idx.lru_order(R0) == list(reversed(x)) and idx.lru_order(R1) == []
    assert idx.match(x) == {R0: 3}
    check_tree(idx)
    # without the map (the router's approximate mode) the check is off; with it built by a
    # holds() or remove() it is on again
    lazy = PrefixIndex()
    lazy.insert(R0, x, 0.0)
    assert lazy._node_of is None
    assert not lazy.holds(R1, x[0]) and lazy._node_of is not None
    with pytest.raises(ValueError, match="leading blocks"):
        lazy.insert(R1, x[1:], 1.0)


@settings(max_examples=600, deadline=None)
@given(
    cap=st.one_of(st.none(), st.integers(1, 8)),
    ttl=st.one_of(st.none(), st.sampled_from([1.0, 2.5])),
    ops=st.lists(op, max_size=40),
)
@pytest.mark.parametrize("block_map", [False, True])
def test_tree_invariants_hold_after_every_operation(block_map, cap, ttl, ops):
    # the same random operations as the reference-model test, checking structure after each
    # (without the map, the first remove() builds it from the tree and it is kept after that)
    idx = PrefixIndex(capacity_blocks=cap, ttl_s=ttl, block_map=block_map)
    now = 0.0
    for kind, ri, ids, dt in ops:
        now += dt * 0.5
        r, hs = REPLICAS[ri], blocks(ids)
        if kind == "insert":
            idx.insert(r, hs, now)
        elif kind == "remove":
            idx.remove(r, hs[len(hs) // 2:])
        elif kind == "clear":
            idx.clear(r)
        else:
            idx.expire(now)
        check_tree(idx)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 2), prompt_ids, st.lists(st.integers(0, 5), max_size=6)),
                   min_size=1, max_size=25),
    cap=st.one_of(st.none(), st.integers(2, 10)),
)
@both
def test_removing_any_subset_of_blocks_matches_reference(Index, steps, cap):
    # Engines evict arbitrary blocks (a run's middle, scattered blocks, repeats); the index must
    # forget exactly those on that replica. Expected: the list model RefIndex after every step.
    idx = Index(capacity_blocks=cap)
    ref = RefIndex(cap, None)
    for step, (ri, ids, picks) in enumerate(steps):
        r = REPLICAS[ri]
        hs = blocks(ids)
        assert idx.insert(r, hs, float(step)) == ref.insert(r, hs, float(step))
        other = REPLICAS[(ri + 1) % 3]  # remove on another replica too (blocks it may not hold)
        for who in (r, other):
            sub = [hs[k] for k in picks if k < len(hs)]
            assert idx.remove(who, sub) == ref.remove(who, sub)
        for rr in REPLICAS:
            assert idx.lru_order(rr) == [e[0] for e in ref.lists[rr]]
        if Index is PrefixIndex:
            check_tree(idx)
    for ids in ([0, 1, 2, 3], [0, 1], [1, 2, 0]):
        q = blocks(ids)
        got = idx.match(q)
        assert {r: got.get(r, 0) for r in REPLICAS} == {r: ref.match(r, q) for r in REPLICAS}


def test_clear_survives_merges_its_own_drops_cause():
    # Found by Hypothesis: X = [a, b, c] then Y = [a, b, d] on one replica splits X into [a b] [c]
    # and adds [d]; clearing drops [c] first, which lets [a b] and [d] merge (same holder,
    # adjacent, same time) while clear() is walking that replica's list. Hand: 4 blocks held.
    x, y = blocks([0, 0, 0]), blocks([0, 0, 1])
    idx = PrefixIndex()
    idx.insert(R2, x, 0.0)
    idx.insert(R2, y, 0.0)
    assert idx.num_nodes() == 3
    assert idx.clear(R2) == 4
    assert idx.num_nodes() == 0 and idx.num_unique_blocks() == 0 and idx.match(x) == {}
    check_tree(idx)


def test_registered_replicas_are_numbered_before_their_first_insert():
    # hand: numbers are given in registration order; the cached array for a pool stays the same
    # object while registered replicas receive their first prompts (no re-numbering)
    idx = PrefixIndex()
    pool = (R0, R1, R2)
    assert [idx.register(r) for r in pool] == [0, 1, 2] and idx.register(R1) == 1
    nums = idx.numbers(pool)
    assert nums.tolist() == [0, 1, 2]
    idx.insert(R2, blocks([1, 2]), 0.0)
    assert idx.numbers(pool) is nums
    assert idx.match_depths(blocks([1, 2])).tolist() == [0, 0, 2]


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 2), prompt_ids, st.integers(0, 6), st.booleans()),
                   min_size=1, max_size=25),
    cap=st.one_of(st.none(), st.integers(6, 12)),
)
@both
def test_continuations_with_a_parent_hash_match_reference(Index, steps, cap):
    # An engine announces a prompt in two events: its first k blocks, then the rest naming block
    # k-1 as parent (vLLM's BlockStored). Expected: the list model given the same blocks, after
    # every step; the capacity (>= 6) keeps the parent just stored. The prefix tree touches the
    # chain the continuation hangs from as well (the engine's sequence uses those blocks; it lets
    # the chain's runs merge, issue 14 item 15), so its model is the whole prompt's insert; the
    # flat BlockIndex touches only the continuation's own blocks.
    idx = Index(capacity_blocks=cap)
    ref = RefIndex(cap, None)
    for step, (ri, ids, k, also_remove) in enumerate(steps):
        r, hs = REPLICAS[ri], blocks(ids)
        k = min(k, len(hs))
        now = float(step)
        if 0 < k < len(hs):
            assert idx.insert(r, hs[:k], now) == ref.insert(r, hs[:k], now)
            assert (idx.insert(r, hs[k:], now, parent_block_hash=hs[k - 1])
                    == ref.insert(r, hs if Index is PrefixIndex else hs[k:], now))
        else:
            assert idx.insert(r, hs, now) == ref.insert(r, hs, now)
        if also_remove:
            sub = hs[: len(hs) // 2]
            assert idx.remove(r, sub) == ref.remove(r, sub)
        for rr in REPLICAS:
            assert idx.lru_order(rr) == [e[0] for e in ref.lists[rr]]
        if Index is PrefixIndex:
            check_tree(idx)
    for ids in ([0, 1, 2, 3], [0, 1], [2, 1, 0, 1]):
        q = blocks(ids)
        got = idx.match(q)
        assert {r: got.get(r, 0) for r in REPLICAS} == {r: ref.match(r, q) for r in REPLICAS}


def test_continuation_of_an_unknown_parent_is_dropped():
    # hand: nothing indexed has hash 12345, so blocks hanging from it can never be matched
    idx = PrefixIndex(block_map=True)
    x = blocks([1, 2, 3])
    assert idx.insert(R0, x[1:], 0.0, parent_block_hash=12345) == []
    assert idx.num_blocks() == 0 and idx.num_nodes() == 0
    # a known parent in the middle of a run splits it there: R1 holds [x0] + [y1], R0 all of x
    idx.insert(R0, x, 1.0)
    y = blocks([1, 7])
    idx.insert(R1, x[:1], 2.0)
    idx.insert(R1, y[1:], 2.0, parent_block_hash=x[0])
    assert idx.match(y) == {R0: 1, R1: 2} and idx.match(x) == {R0: 3, R1: 1}
    check_tree(idx)


@both
def test_clearing_replicas_leaves_no_cyclic_garbage(Index):
    # issue 25 item 1 (found with GET /debug/memory in bench/hostile_soak.py): a router that adds
    # and removes workers of 1,024 DP ranks left each removed rank's empty LRU list (a sentinel
    # pointing to itself) as cyclic garbage until a full collection. Expected by construction:
    # everything a cleared replica held is freed by reference counting, so the collector finds 0
    # unreachable objects (gc.collect() returns that count); before the fix it found one per replica.
    import gc

    gc.collect()
    gc.disable()
    try:
        idx = Index()
        replicas = [rid(f"http://w{i // 4}", i % 4) for i in range(64)]
        for i, r in enumerate(replicas):
            idx.insert(r, blocks([i % 3, 7, i]), float(i))
            idx.insert(r, blocks([i % 3, 8]), float(i))
        for r in replicas[:32]:
            idx.clear(r)
        assert gc.collect() == 0
        for r in replicas[32:]:
            idx.clear(r)
        assert idx.num_unique_blocks() == 0
        assert gc.collect() == 0
        # and a random mix of inserts, removals, evictions (capacity 6) and expiry (seeded): splits
        # and merges detach nodes; none may be left in a cycle
        import random

        rng = random.Random(5)
        idx = Index(capacity_blocks=6, ttl_s=50.0)
        for t in range(400):
            r = replicas[rng.randrange(8)]
            ids = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            op = rng.random()
            if op < 0.6:
                idx.insert(r, blocks(ids), float(t))
            elif op < 0.8:
                idx.remove(r, blocks(ids)[rng.randrange(len(ids)):])
            elif op < 0.9:
                idx.expire(float(t))
            else:
                idx.clear(r)
        assert gc.collect() == 0
    finally:
        gc.enable()
