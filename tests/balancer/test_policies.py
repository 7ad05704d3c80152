"""Policies on hand-built candidate views.

Every expected value below is worked out by hand (numbers in the comments) or from the formula the
anchor documents (ANCHORS.md: SGLang cache_aware, Dynamo kv cost, llm-d scorers), recomputed here
independently of the policy code.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import xxhash

from balancer.policies import available_policies, make_policy
from balancer.types import ReplicaId, Role
from balancer_factories import cands, ctx, req, rid, view

A, B, C, D, E = (rid(x) for x in "ABCDE")


# ---------------------------------------------------------------------------------- round_robin
def test_round_robin_cycles_by_decision_index():
    # hand: n = 3, pick index decision_index % 3 -> A B C A B C A
    cs = cands(view("A"), view("B"), view("C"))
    pol = make_policy("round_robin")
    got = [pol.select(req("r"), cs, ctx(seed=i, decision_index=i)).replica for i in range(7)]
    assert got == [A, B, C, A, B, C, A]
    # the rng does not matter, only the index: index 4 with any seed -> B
    assert {pol.select(req("r"), cs, ctx(seed=s, decision_index=4)).replica for s in range(10)} == {B}


# ---------------------------------------------------------------------------------- random
def test_random_deterministic_per_seed_and_covers_all():
    # formula: the pick is replicas[rng.randrange(n)] on the given Random
    cs = cands(*(view(x) for x in "ABCDE"))
    pol = make_policy("random")
    for seed in range(20):
        exp = cs.replicas[random.Random(seed).randrange(5)]
        assert pol.select(req("r"), cs, ctx(seed)).replica == exp
        assert pol.select(req("r"), cs, ctx(seed)).replica == exp  # same seed, same pick
    rng = random.Random(123)
    from balancer.policies import SelectContext

    c = SelectContext(rng, 0.0, 0)
    counts = Counter(pol.select(req("r"), cs, c).replica for _ in range(5000))
    assert set(counts) == {A, B, C, D, E}
    # uniform: expected 1000 each, sd = sqrt(5000*0.2*0.8) ~ 28; allow 5 sd
    assert all(abs(v - 1000) < 150 for v in counts.values())


# ---------------------------------------------------------------------------------- least_load
def test_least_load_auto_prefill_uses_prefill_tokens():
    # hand: prefill pool balances prefill_tokens: A 100, B 50, C 80 -> B (even though B has most requests)
    cs = cands(
        view("A", Role.PREFILL, prefill_tokens=100, num_requests=1),
        view("B", Role.PREFILL, prefill_tokens=50, num_requests=5),
        view("C", Role.PREFILL, prefill_tokens=80, num_requests=0, decode_kv_tokens=0),
    )
    ch = make_policy("least_load").select(req("r"), cs, ctx())
    assert ch.replica == B and ch.reason == "least_load"
    # formula: score = prefill_tokens + num_requests / (max_requests + 1) = x + nr/6
    assert ch.scores == pytest.approx({A: 100 + 1 / 6, B: 50 + 5 / 6, C: 80.0})


def test_least_load_auto_prefill_tie_broken_by_requests():
    # hand: equal prefill_tokens 50; requests 3 vs 2 -> B (50 + 2/4 < 50 + 3/4)
    cs = cands(
        view("A", Role.PREFILL, prefill_tokens=50, num_requests=3),
        view("B", Role.PREFILL, prefill_tokens=50, num_requests=2),
        view("C", Role.PREFILL, prefill_tokens=51, num_requests=0),
    )
    for seed in range(10):
        assert make_policy("least_load").select(req("r"), cs, ctx(seed)).replica == B


def test_least_load_auto_decode_uses_kv_tokens_then_requests():
    # hand: kv tokens A 1000, B 500, C 500 -> tie B/C broken by requests 9 vs 4 -> C
    cs = cands(
        view("A", Role.DECODE, decode_kv_tokens=1000, num_requests=1, prefill_tokens=0),
        view("B", Role.DECODE, decode_kv_tokens=500, num_requests=9, prefill_tokens=0),
        view("C", Role.DECODE, decode_kv_tokens=500, num_requests=4, prefill_tokens=999),
    )
    for seed in range(10):
        assert make_policy("least_load").select(req("r"), cs, ctx(seed)).replica == C


def test_least_load_auto_mixed_uses_requests():
    # hand: requests A 3, B 2, C 2 -> tie B/C broken by prefill tokens (900 vs 100) -> C;
    # A has the fewest prefill tokens and the least KV but more requests, so never A.
    cs = cands(
        view("A", Role.MIXED, num_requests=3, prefill_tokens=0, decode_kv_tokens=0),
        view("B", Role.MIXED, num_requests=2, prefill_tokens=900, decode_kv_tokens=5000),
        view("C", Role.MIXED, num_requests=2, prefill_tokens=100, decode_kv_tokens=5000),
    )
    for seed in range(10):
        assert make_policy("least_load").select(req("r"), cs, ctx(seed)).replica == C


def test_least_load_full_tie_is_random_among_tied_only():
    # hand: A and C tie on everything (kv 10, req 1); B is heavier -> only A or C, both seen
    cs = cands(
        view("A", Role.DECODE, decode_kv_tokens=10, num_requests=1),
        view("B", Role.DECODE, decode_kv_tokens=11, num_requests=0),
        view("C", Role.DECODE, decode_kv_tokens=10, num_requests=1),
    )
    got = {make_policy("least_load").select(req("r"), cs, ctx(s)).replica for s in range(40)}
    assert got == {A, C}


@pytest.mark.parametrize(
    "metric, expected",
    [
        # hand: requests A 5, B 1, C 3 -> B
        ("requests", B),
        # hand: prefill_tokens A 10, B 900, C 500 -> A
        ("prefill_tokens", A),
        # hand: kv_tokens A 700, B 800, C 100 -> C
        ("kv_tokens", C),
    ],
)
def test_least_load_explicit_metrics(metric, expected):
    cs = cands(
        view("A", Role.DECODE, num_requests=5, prefill_tokens=10, decode_kv_tokens=700),
        view("B", Role.DECODE, num_requests=1, prefill_tokens=900, decode_kv_tokens=800),
        view("C", Role.DECODE, num_requests=3, prefill_tokens=500, decode_kv_tokens=100),
    )
    assert make_policy("least_load", metric=metric).select(req("r"), cs, ctx()).replica == expected


@pytest.mark.parametrize("name", ["least_load", "power_of_two"])
def test_invalid_metric_raises(name):
    with pytest.raises(ValueError, match="metric"):
        make_policy(name, metric="gpu_temperature")


# ---------------------------------------------------------------------------------- power_of_two
def test_power_of_two_picks_lower_of_the_two_sampled():
    # formula: (a, b) = rng.sample(range(n), 2) on the same seed; pick b iff load[b] < load[a]
    loads = [5, 1, 4, 2, 3]
    cs = cands(*(view(x, Role.DECODE, num_requests=q) for x, q in zip("ABCDE", loads)))
    pol = make_policy("power_of_two", metric="requests")
    picked = set()
    for seed in range(60):
        a, b = random.Random(seed).sample(range(5), 2)
        exp = b if loads[b] < loads[a] else a
        ch = pol.select(req("r"), cs, ctx(seed))
        assert ch.replica == cs.replicas[exp]
        assert ch.scores == {cs.replicas[a]: float(loads[a]), cs.replicas[b]: float(loads[b])}
        picked.add(exp)
    # the heaviest (A, load 5) is never picked: it always loses its pair
    assert 0 not in picked and len(picked) == 4


def test_power_of_two_equal_loads_go_to_first_drawn_and_single_candidate():
    cs = cands(*(view(x, Role.DECODE, num_requests=2) for x in "ABCD"))
    pol = make_policy("power_of_two", metric="requests")
    for seed in range(20):
        a, _ = random.Random(seed).sample(range(4), 2)
        assert pol.select(req("r"), cs, ctx(seed)).replica == cs.replicas[a]
    one = cands(view("A", Role.DECODE, num_requests=99))
    ch = pol.select(req("r"), one, ctx())
    assert ch.replica == A and ch.reason == "single"


# ---------------------------------------------------------------------------------- consistent_hash
def _splitmix64(z: int) -> int:
    """SplitMix64 finaliser in plain Python ints (independent of the policy's numpy version)."""
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def rendezvous_order(key: bytes, replicas):
    """Independent rendezvous ranking: splitmix64(xxh3(key) ^ xxh3(engine | dp_rank LE32)), descending."""
    k = xxhash.xxh3_64_intdigest(key)
    w = {
        r: _splitmix64(k ^ xxhash.xxh3_64_intdigest(r.engine.encode() + b"|" + r.dp_rank.to_bytes(4, "little")))
        for r in replicas
    }
    return sorted(replicas, key=lambda r: w[r], reverse=True)


def test_rendezvous_weights_cached_per_key_and_candidate_set_equal_fresh_ones():
    # Expected: the plain-int splitmix64 above (independent of numpy), for a first (computed) and
    # a second (cached) call; a different candidate tuple with other replicas gets its own weights;
    # the shared cached array cannot be written by a caller.
    from balancer.policies.consistent_hash import rendezvous_weights
    a = tuple(rid("w", i) for i in range(5))
    b = tuple(rid("v", i) for i in range(5))
    key = b"s:sess-1"
    k = xxhash.xxh3_64_intdigest(key)

    def expected(reps):
        return [_splitmix64(k ^ xxhash.xxh3_64_intdigest(r.engine.encode() + b"|" + r.dp_rank.to_bytes(4, "little")))
                for r in reps]

    first = rendezvous_weights(key, a)
    assert first.tolist() == expected(a)
    assert rendezvous_weights(key, a) is first  # cached
    assert rendezvous_weights(key, b).tolist() == expected(b)
    with pytest.raises(ValueError):
        first[0] = 0


def test_consistent_hash_same_session_same_replica_and_matches_rendezvous():
    names = [("w", i) for i in range(6)]
    cs = cands(*(view(e, dp=d) for e, d in names))
    pol = make_policy("consistent_hash")
    winners = set()
    for s in range(30):
        sess = f"sess-{s}"
        exp = rendezvous_order(b"s:" + sess.encode(), list(cs.replicas))[0]
        got = {pol.select(req(f"r{s}-{k}", 100 + k, [k], session_id=sess), cs, ctx(k)).replica for k in range(5)}
        assert got == {exp}
        winners.add(exp)
    assert len(winners) > 1  # the hash actually spreads sessions


def test_consistent_hash_key_falls_back_to_first_block():
    # key_block=1: requests without a session but sharing their first block go together
    # (key b"b:" + LE64 hash of block 1)
    cs = cands(*(view(f"w{i}") for i in range(5)))
    pol = make_policy("consistent_hash", key_block=1)
    r1 = req("x", 100, [7, 1, 2])
    r2 = req("y", 300, [7, 9])
    exp = rendezvous_order(b"b:" + r1.block_hashes[0].to_bytes(8, "little"), list(cs.replicas))[0]
    assert pol.select(r1, cs, ctx()).replica == exp
    assert pol.select(r2, cs, ctx()).replica == exp


def test_consistent_hash_default_keys_on_the_second_block_or_the_last():
    # default key_block=2: the chained hash of block 2 names the prefix up to it; a one-block
    # prompt uses its only block
    cs = cands(*(view(f"w{i}") for i in range(7)))
    pol = make_policy("consistent_hash")
    r1 = req("x", 1500, [7, 1, 2])
    r2 = req("y", 1100, [7, 1, 5])
    r3 = req("z", 100, [7])
    k12 = rendezvous_order(b"b:" + r1.block_hashes[1].to_bytes(8, "little"), list(cs.replicas))[0]
    k3 = rendezvous_order(b"b:" + r3.block_hashes[0].to_bytes(8, "little"), list(cs.replicas))[0]
    assert pol.select(r1, cs, ctx()).replica == k12
    assert pol.select(r2, cs, ctx()).replica == k12
    assert pol.select(r3, cs, ctx()).replica == k3


def test_consistent_hash_removing_non_chosen_replica_does_not_move_keys():
    full = [view(f"w{i}") for i in range(5)]
    pol = make_policy("consistent_hash")
    moved_to_new = 0
    for s in range(40):
        r = req(f"r{s}", session_id=f"s{s}")
        chosen = pol.select(r, cands(*full), ctx()).replica
        for k, v in enumerate(full):
            if v.replica == chosen:
                continue
            rest = [x for j, x in enumerate(full) if j != k]
            assert pol.select(r, cands(*rest), ctx()).replica == chosen
        # adding a replica moves a key only onto the new replica
        after = pol.select(r, cands(*full, view("w5")), ctx()).replica
        assert after in (chosen, rid("w5"))
        moved_to_new += after == rid("w5")
    assert 0 < moved_to_new < 40


def _bounded_case(loads_by_rank):
    """4 replicas; loads assigned by rendezvous rank of session 'S'. Returns (order, cands)."""
    reps = [rid(f"w{i}") for i in range(4)]
    order = rendezvous_order(b"s:S", reps)
    load = dict(zip(order, loads_by_rank))
    cs = cands(*(view(r.engine, num_requests=load[r]) for r in reps))
    return order, cs


def test_consistent_hash_bounded_load_moves_to_next_in_rendezvous_order():
    pol = make_policy("consistent_hash", epsilon=0.25)
    r = req("r", session_id="S")
    # hand: loads by rank [2,1,0,0]: m=3, cap=ceil(1.25*4/4)=ceil(1.25)=2; rank0 2+1=3>2 -> rank1 (1+1<=2)
    order, cs = _bounded_case([2, 1, 0, 0])
    ch = pol.select(r, cs, ctx())
    assert ch.replica == order[1] and ch.reason == "bounded_load"
    assert ch.scores == {order[k]: float(k) for k in range(4)}
    # hand: [1,1,1,0]: m=3, cap=2; rank0 1+1=2<=2 -> stays
    order, cs = _bounded_case([1, 1, 1, 0])
    ch = pol.select(r, cs, ctx())
    assert ch.replica == order[0] and ch.reason == "affinity"
    # hand: [2,2,0,0]: m=4, cap=ceil(1.25*5/4)=ceil(1.5625)=2; rank0, rank1 full -> rank2
    order, cs = _bounded_case([2, 2, 0, 0])
    assert pol.select(r, cs, ctx()).replica == order[2]
    # hand: epsilon 1.0, [2,2,0,0]: cap=ceil(2*5/4)=3 -> rank0 2+1=3<=3 stays
    assert make_policy("consistent_hash", epsilon=1.0).select(r, cs, ctx()).replica == order[0]


def test_consistent_hash_bad_epsilon():
    with pytest.raises(ValueError):
        make_policy("consistent_hash", epsilon=0.0)


# ---------------------------------------------------------------------------------- cache_aware
def ca_cands(loads, matched_tokens, role=Role.PREFILL):
    return cands(
        *(
            view(n, role, num_requests=q, matched_blocks=m // 100, matched_tokens=m, block_size=100)
            for n, q, m in zip("ABCDE", loads, matched_tokens)
        )
    )


@pytest.mark.parametrize(
    "loads, expected, reason",
    [
        # hand: max-min = 65 > 64 and 100 > 35*1.5 = 52.5 -> imbalanced -> least loaded B
        ([100, 35, 50], B, "imbalanced"),
        # hand: max-min = 64, not > 64 -> not imbalanced -> full match on A wins
        ([100, 36, 50], A, "cache_hit"),
        # hand: only abs holds: 200-134 = 66 > 64 but 200 > 134*1.5 = 201 is false -> cache hit A
        ([200, 134, 150], A, "cache_hit"),
        # hand: rel exactly at the boundary: 198 > 132*1.5 = 198 false (diff 66 > 64) -> cache hit
        ([198, 132, 150], A, "cache_hit"),
        # hand: rel just over: 199 > 198 and 67 > 64 -> imbalanced -> B
        ([199, 132, 150], B, "imbalanced"),
        # hand: only rel holds: 10 > 1*1.5 but 10-1 = 9 <= 64 -> cache hit A
        ([10, 1, 5], A, "cache_hit"),
        # hand: min 0: 65 > 64 and 65 > 0 -> imbalanced -> C (load 0)
        ([65, 30, 0], C, "imbalanced"),
    ],
)
def test_cache_aware_imbalance_thresholds(loads, expected, reason):
    # A holds the whole 1000-token prompt, B and C nothing
    cs = ca_cands(loads, [1000, 0, 0])
    ch = make_policy("cache_aware").select(req("r", 1000), cs, ctx())
    assert (ch.replica, ch.reason) == (expected, reason)
    assert ch.scores == {A: 1000.0, B: 0.0, C: 0.0}  # scores = matched tokens


@pytest.mark.parametrize(
    "matched_a, expected, reason",
    [
        # hand: 400/1000 = 0.4 > 0.3 -> hit on A even though A is the most loaded
        (400, A, "cache_hit"),
        # hand: 301/1000 = 0.301 > 0.3 -> hit
        (301, A, "cache_hit"),
        # hand: 300/1000 = 0.3, not > 0.3 -> miss -> least loaded (C, load 1)
        (300, C, "cache_miss"),
        # hand: 0 -> miss -> C
        (0, C, "cache_miss"),
    ],
)
def test_cache_aware_match_rate_threshold(matched_a, expected, reason):
    # loads A 5, B 3, C 1; B holds 100 tokens (0.1, below threshold)
    cs = ca_cands([5, 3, 1], [matched_a, 100, 0])
    ch = make_policy("cache_aware").select(req("r", 1000), cs, ctx())
    assert (ch.replica, ch.reason) == (expected, reason)


def test_cache_aware_deepest_match_ties_go_to_least_loaded():
    # hand: A and B both match 600/1000 (> 0.3); loads 4 vs 2 -> B; C (load 0, 200 tokens) loses
    cs = ca_cands([4, 2, 0], [600, 600, 200])
    for seed in range(10):
        ch = make_policy("cache_aware").select(req("r", 1000), cs, ctx(seed))
        assert (ch.replica, ch.reason) == (B, "cache_hit")
    # hand: deeper match wins over load: A 700 vs B 600 -> A
    cs = ca_cands([4, 2, 0], [700, 600, 200])
    assert make_policy("cache_aware").select(req("r", 1000), cs, ctx()).replica == A


def test_cache_aware_miss_goes_to_least_loaded_not_smallest_cache():
    # hand: a miss (best rate 0.2) must go to the least-loaded replica B (load 1), never to
    # C, which holds nothing at all (the "smallest tree") but carries load 7.
    cs = ca_cands([3, 1, 7], [200, 100, 0])
    for seed in range(10):
        ch = make_policy("cache_aware").select(req("r", 1000), cs, ctx(seed))
        assert (ch.replica, ch.reason) == (B, "cache_miss")


def test_cache_aware_custom_thresholds():
    # hand: threshold 0.5: 500/1000 = 0.5 not > 0.5 -> miss -> C; 501 -> hit A
    pol = make_policy("cache_aware", cache_threshold=0.5, balance_abs=1000)
    assert pol.select(req("r", 1000), ca_cands([5, 3, 1], [500, 0, 0]), ctx()).replica == C
    assert pol.select(req("r", 1000), ca_cands([5, 3, 1], [501, 0, 0]), ctx()).replica == A
    # hand: balance_abs 2, rel 1.5: loads [5,3,1]: 4 > 2 and 5 > 1.5 -> imbalanced -> C despite hit
    pol = make_policy("cache_aware", balance_abs=2)
    ch = pol.select(req("r", 1000), ca_cands([5, 3, 1], [1000, 0, 0]), ctx())
    assert (ch.replica, ch.reason) == (C, "imbalanced")


# ---------------------------------------------------------------------------------- kv_cost
def kv_cands():
    # block_size 16, prompt 160 tokens (10 blocks). Hand costs, cost = w*prefill_blocks + decode_blocks:
    #   A: prefill 0, kv 160, matched 160 -> pb = (0+160-160)/16 = 0,  db = (160+160)/16 = 20
    #   B: prefill 0, kv 0,   matched 0   -> pb = (0+160-0)/16 = 10,   db = (0+160)/16   = 10
    #   C: prefill 96, kv 32, matched 64  -> pb = (96+160-64)/16 = 12, db = (32+160)/16  = 12
    return cands(
        view("A", Role.DECODE, prefill_tokens=0, decode_kv_tokens=160, matched_blocks=10, block_size=16),
        view("B", Role.DECODE, prefill_tokens=0, decode_kv_tokens=0, matched_blocks=0, block_size=16),
        view("C", Role.DECODE, prefill_tokens=96, decode_kv_tokens=32, matched_blocks=4, block_size=16),
    )


@pytest.mark.parametrize(
    "w, costs, expected",
    [
        # hand: w=2: A 0+20=20, B 20+10=30, C 24+12=36 -> A (cache wins)
        (2.0, [20, 30, 36], A),
        # hand: w=0.5: A 20, B 5+10=15, C 6+12=18 -> B
        (0.5, [20, 15, 18], B),
        # hand: w=0: A 20, B 10, C 12 -> B (pure KV load)
        (0.0, [20, 10, 12], B),
        # hand: w=1: A 20, B 20, C 24 -> tie A/B -> fewest matched blocks -> B (0 vs 10)
        (1.0, [20, 20, 24], B),
    ],
)
def test_kv_cost_hand_costs_and_argmin(w, costs, expected):
    pol = make_policy("kv_cost", overlap_weight=w)
    cs = kv_cands()
    assert pol.costs(req("r", 160), cs).tolist() == pytest.approx(costs)
    for seed in range(10):
        ch = pol.select(req("r", 160), cs, ctx(seed))
        assert ch.replica == expected and ch.reason == "min_cost"
        assert ch.scores == pytest.approx(dict(zip([A, B, C], map(float, costs))))


def test_kv_cost_overlap_weight_zero_ignores_cache():
    # formula with w=0: cost = (kv + prompt)/bs only; changing matched blocks changes nothing
    pol = make_policy("kv_cost", overlap_weight=0.0)
    base = pol.costs(req("r", 160), kv_cands())
    no_cache = cands(*(view(v.replica.engine, Role.DECODE, prefill_tokens=v.prefill_tokens,
                            decode_kv_tokens=v.decode_kv_tokens, block_size=16) for v in kv_cands().views()))
    assert pol.costs(req("r", 160), no_cache).tolist() == base.tolist() == [20.0, 10.0, 12.0]


def test_kv_cost_tie_among_equal_matches_is_random():
    # hand: all three identical -> all costs equal and matched equal -> random among all
    cs = cands(*(view(x, Role.DECODE, decode_kv_tokens=32, matched_blocks=1, block_size=16) for x in "ABC"))
    got = {make_policy("kv_cost").select(req("r", 160), cs, ctx(s)).replica for s in range(40)}
    assert got == {A, B, C}


def test_kv_cost_temperature_sampling_matches_softmax():
    # costs (w=2) [20, 30, 36], T = 0.5; formula p_i ~ exp(-(c_i - 20) / (16 * 0.5)):
    #   weights 1, exp(-10/8) = 0.2865, exp(-16/8) = 0.1353; sum 1.4218 -> p = 0.7033, 0.2015, 0.0952
    pol = make_policy("kv_cost", overlap_weight=2.0, temperature=0.5)
    cs = kv_cands()
    w = [math.exp(-(c - 20) / (16 * 0.5)) for c in (20, 30, 36)]
    p = [x / sum(w) for x in w]
    assert p == pytest.approx([0.7033, 0.2015, 0.0952], abs=1e-3)
    from balancer.policies import SelectContext

    c = SelectContext(random.Random(2024), 0.0, 0)
    n = 20000
    counts = Counter(pol.select(req("r", 160), cs, c).replica for _ in range(n))
    # tolerance: sd of a frequency <= sqrt(0.25/20000) = 0.0035; allow 0.015 (> 4 sd)
    for r, pi in zip([A, B, C], p):
        assert counts[r] / n == pytest.approx(pi, abs=0.015)
    ch = pol.select(req("r", 160), cs, c)
    assert ch.reason == "sampled"


def test_kv_cost_temperature_all_equal_costs_uniform():
    # hand: equal costs -> uniform 1/3 each; 20k draws, sd 0.0033, tolerance 0.015
    cs = cands(*(view(x, Role.DECODE, decode_kv_tokens=64, block_size=16) for x in "ABC"))
    pol = make_policy("kv_cost", temperature=1.0)
    from balancer.policies import SelectContext

    c = SelectContext(random.Random(7), 0.0, 0)
    n = 20000
    counts = Counter(pol.select(req("r", 160), cs, c).replica for _ in range(n))
    for r in (A, B, C):
        assert counts[r] / n == pytest.approx(1 / 3, abs=0.015)


def test_kv_cost_higher_temperature_flattens():
    # formula: T=5: weights 1, exp(-10/80)=0.8825, exp(-16/80)=0.8187 -> p_C = 0.8187/2.7012 = 0.303
    pol = make_policy("kv_cost", overlap_weight=2.0, temperature=5.0)
    from balancer.policies import SelectContext

    c = SelectContext(random.Random(1), 0.0, 0)
    n = 20000
    counts = Counter(pol.select(req("r", 160), kv_cands(), c).replica for _ in range(n))
    assert counts[C] / n == pytest.approx(0.8187 / 2.7012, abs=0.015)


# ---------------------------------------------------------------------------------- scored
def scored_cands():
    # 8-block prompt; kv capacity 1000 (C unknown = 0)
    return cands(
        view("A", Role.DECODE, num_requests=4, decode_kv_tokens=500, kv_capacity_tokens=1000, matched_blocks=6),
        view("B", Role.DECODE, num_requests=0, decode_kv_tokens=900, kv_capacity_tokens=1000, matched_blocks=0),
        view("C", Role.DECODE, num_requests=2, decode_kv_tokens=0, kv_capacity_tokens=0, matched_blocks=2),
    )


def test_scored_components_by_hand():
    r = req("r", 800, list(range(8)))
    comp = make_policy("scored").component_scores(r, scored_cands())
    # prefix = matched / 8: 6/8, 0, 2/8
    assert comp["prefix"].tolist() == pytest.approx([0.75, 0.0, 0.25])
    # queue: q = [4, 0, 2], max 4, min 0: (4-q)/4 -> 0, 1, 0.5
    assert comp["queue"].tolist() == pytest.approx([0.0, 1.0, 0.5])
    # kv_utilization: 1 - 500/1000, 1 - 900/1000, 1 - 0 (unknown capacity)
    assert comp["kv_utilization"].tolist() == pytest.approx([0.5, 0.1, 1.0])
    # load: 0.5 * (1 - q/128): 0.5*(124/128) = 0.484375, 0.5, 0.5*(126/128) = 0.4921875
    assert comp["load"].tolist() == pytest.approx([0.484375, 0.5, 0.4921875])


def test_scored_queue_all_equal_is_one_and_load_cap():
    r = req("r", 100, [1])
    cs = cands(*(view(x, Role.DECODE, num_requests=200) for x in "AB"))
    comp = make_policy("scored").component_scores(r, cs)
    assert comp["queue"].tolist() == [1.0, 1.0]
    # q = 200 > 128 -> min(q,128)/128 = 1 -> load 0
    assert comp["load"].tolist() == [0.0, 0.0]
    # prompt with no blocks -> prefix 0
    assert make_policy("scored").component_scores(req("x", 5), cs)["prefix"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "weights, totals, expected",
    [
        # hand (default 3,2,2,0): A 3*.75+2*0+2*.5 = 3.25; B 0+2+0.2 = 2.2; C .75+1+2 = 3.75 -> C
        (dict(), [3.25, 2.2, 3.75], C),
        # hand prefix only: .75, 0, .25 -> A
        (dict(prefix_weight=1, queue_weight=0, kv_utilization_weight=0), [0.75, 0.0, 0.25], A),
        # hand queue only: 0, 1, .5 -> B
        (dict(prefix_weight=0, queue_weight=1, kv_utilization_weight=0), [0.0, 1.0, 0.5], B),
        # hand load only: .484375, .5, .4921875 -> B
        (dict(prefix_weight=0, queue_weight=0, kv_utilization_weight=0, load_weight=1),
         [0.484375, 0.5, 0.4921875], B),
        # hand prefix 10, kv 1: A 7.5+.5 = 8; B .1; C 2.5+1 = 3.5 -> A
        (dict(prefix_weight=10, queue_weight=0, kv_utilization_weight=1), [8.0, 0.1, 3.5], A),
    ],
)
def test_scored_weighted_pick(weights, totals, expected):
    ch = make_policy("scored", **weights).select(req("r", 800, list(range(8))), scored_cands(), ctx())
    assert ch.replica == expected and ch.reason == "max_score"
    assert ch.scores == pytest.approx(dict(zip([A, B, C], totals)))


# ---------------------------------------------------------------------------------- registry
def test_available_policies():
    assert available_policies() == [
        "cache_aware", "consistent_hash", "dp_consistent_hash", "ep_aware", "kv_cost", "least_load",
        "power_of_two", "random", "round_robin", "scored",
    ]


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError) as ei:
        make_policy("least_loaded")
    msg = str(ei.value)
    assert "least_loaded" in msg
    for name in available_policies():
        assert name in msg


def test_unknown_parameter_lists_accepted():
    with pytest.raises(ValueError) as ei:
        make_policy("cache_aware", cache_thresh=0.5)
    msg = str(ei.value)
    assert "cache_thresh" in msg
    for p in ("cache_threshold", "balance_abs", "balance_rel"):
        assert p in msg
    with pytest.raises(ValueError, match="none"):
        make_policy("round_robin", foo=1)


@pytest.mark.parametrize(
    "name, params",
    [
        ("cache_aware", dict(cache_threshold=1.5)),
        ("cache_aware", dict(cache_threshold=-0.1)),
        ("cache_aware", dict(balance_abs=-1)),
        ("cache_aware", dict(balance_rel=0.5)),
        ("kv_cost", dict(temperature=-1.0)),
        ("kv_cost", dict(overlap_weight=-0.5)),
        ("scored", dict(prefix_weight=0, queue_weight=0, kv_utilization_weight=0, load_weight=0)),
        ("scored", dict(queue_weight=-1)),
        ("scored", dict(load_queue_cap=0)),
        ("consistent_hash", dict(epsilon=-1)),
        ("least_load", dict(metric="")),
    ],
)
def test_invalid_parameter_values_rejected(name, params):
    with pytest.raises(ValueError):
        make_policy(name, **params)


def test_policy_params_roundtrip():
    assert make_policy("kv_cost", temperature=0.5).params() == {"overlap_weight": 1.0, "temperature": 0.5}
    assert isinstance(rid("x"), ReplicaId)
