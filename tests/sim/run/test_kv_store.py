"""KvStore: hand-worked LRU orders and TTL boundaries, per-class TTL, conservation, and a
Hypothesis property test against an independent brute-force reference model (``RefStore``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.run.engine.kv_store import KvStore

DAY = 86400.0


class RefStore:
    """Independent reference: a plain list of [hash, last_access_s, ttl], least recent first.

    Same documented rules, written the obvious way: live iff now - t <= ttl; TTL of a block =
    max of the classes that stored/touched it while held; deepest-first access; when over
    capacity sweep expired blocks, then pop the front of the list."""

    def __init__(self, cap, ttl, class_ttl):
        self.cap, self.ttl, self.class_ttl = cap, ttl, dict(class_ttl or {})
        self.lst: list[list] = []
        self.inserted = self.evicted = self.expired = 0

    def _ttl(self, cls):
        t = self.class_ttl.get(cls, self.ttl) if cls is not None else self.ttl
        return math.inf if t is None else t

    def _find(self, h):
        for e in self.lst:
            if e[0] == h:
                return e
        return None

    def match(self, hs, now):
        k = 0
        for h in hs:
            e = self._find(h)
            if e is None or now - e[1] > e[2]:
                break
            k += 1
        return k

    def insert(self, hs, now, cls):
        hs = list(hs) if self.cap is None else list(hs)[: self.cap]
        t_new = self._ttl(cls)
        for h in reversed(hs):
            e = self._find(h)
            ttl = t_new
            if e is not None:
                self.lst.remove(e)
                if now - e[1] > e[2]:
                    self.expired += 1
                    self.inserted += 1
                else:
                    ttl = max(e[2], t_new)
            else:
                self.inserted += 1
            self.lst.append([h, now, ttl])
        removed = []
        if self.cap is not None and len(self.lst) > self.cap:
            removed = self._sweep(now)
            while len(self.lst) > self.cap:
                removed.append(self.lst.pop(0)[0])
                self.evicted += 1
        return removed

    def touch(self, hs, now, cls):
        for h in reversed(list(hs)):
            e = self._find(h)
            if e is None or now - e[1] > e[2]:
                continue
            self.lst.remove(e)
            ttl = e[2] if cls is None else max(e[2], self._ttl(cls))
            self.lst.append([h, now, ttl])

    def _sweep(self, now):
        dead = [e for e in self.lst if now - e[1] > e[2]]
        self.lst = [e for e in self.lst if now - e[1] <= e[2]]
        self.expired += len(dead)
        return [e[0] for e in dead]

    def expire(self, now):
        return self._sweep(now)


# ---------------------------------------------------------------------------------- hand cases
def test_deepest_first_lru_eviction_by_hand():
    s = KvStore(capacity_blocks=3)
    assert s.insert([1, 2, 3], 0.0) == []
    # hand: accessed 3, 2, 1 -> LRU (oldest first) 3, 2, 1: the root is most recent
    assert s.lru_order() == [3, 2, 1]
    # hand: insert [1, 4] accesses 4 then 1 -> 3, 2, 4, 1 -> over 3 -> evict 3 (a leaf)
    assert s.insert([1, 4], 1.0) == [3]
    assert s.lru_order() == [2, 4, 1]
    assert s.match([1, 2, 3], 1.0) == 2
    assert s.match([2], 1.0) == 1  # match does not require starting at a root; it walks the list
    # hand: a touch of [1, 2] accesses 2 then 1 -> 4, 2, 1
    s.touch([1, 2], 2.0)
    assert s.lru_order() == [4, 2, 1]
    assert (s.inserted_blocks, s.evicted_blocks, s.expired_blocks, len(s)) == (4, 1, 0, 3)


def test_prompt_longer_than_capacity_keeps_its_first_blocks():
    s = KvStore(capacity_blocks=2)
    assert s.insert([10, 11, 12, 13], 0.0) == []
    assert s.lru_order() == [11, 10]
    assert s.match([10, 11, 12], 0.0) == 2


def test_zero_capacity_stores_nothing():
    s = KvStore(capacity_blocks=0)
    assert s.insert([1, 2], 0.0) == []
    assert len(s) == 0 and s.match([1], 0.0) == 0 and s.inserted_blocks == 0


def test_ttl_boundary_is_inclusive_and_one_ulp_later_expires():
    ttl = 3 * DAY
    t0 = 1234.5678
    s = KvStore(capacity_blocks=None, ttl_s=ttl)
    s.insert([7, 8], t0)
    at = t0 + ttl
    assert at - t0 == ttl  # the boundary is exactly representable here, so the test is exact
    assert s.match([7, 8], at) == 2  # now - t == ttl: live
    after = math.nextafter(at, math.inf)
    assert after - t0 > ttl
    assert s.match([7, 8], after) == 0  # expired but not yet swept: a miss
    assert len(s) == 2
    assert s.expire(at) == []  # nothing expired at the boundary
    assert sorted(s.expire(after)) == [7, 8]
    assert len(s) == 0 and s.expired_blocks == 2


def test_ttl_counts_from_last_access():
    s = KvStore(capacity_blocks=None, ttl_s=10.0)
    s.insert([1, 2], 0.0)
    s.touch([1], 8.0)  # a hit on the root refreshes it only
    assert s.last_access_s(1) == 8.0 and s.last_access_s(2) == 0.0
    assert s.expire(15.0) == [2]  # hand: 15 - 0 > 10, 15 - 8 <= 10
    assert s.match([1, 2], 18.0) == 1
    s.touch([1], 19.0)  # 19 - 8 = 11 > 10: already expired, a touch does not revive it
    assert s.match([1], 19.0) == 0
    assert s.expire(19.0) == [1]


def test_per_class_ttl_and_shared_block_takes_the_max():
    s = KvStore(capacity_blocks=None, ttl_s=100.0, class_ttl_s={"agent": 3 * DAY, "chatbot": 7 * DAY})
    assert s.ttl_for("agent") == 3 * DAY and s.ttl_for("chatbot") == 7 * DAY
    assert s.ttl_for(None) == 100.0 and s.ttl_for("batch") == 100.0
    s.insert([1, 2], 0.0, "agent")  # system prompt [1], agent call [2]
    s.insert([1, 3], 0.0, "chatbot")  # the same system prompt [1], a chat [3]
    s.insert([4], 0.0)  # no class: the default TTL
    assert s.block_ttl_s(1) == 7 * DAY and s.block_ttl_s(2) == 3 * DAY and s.block_ttl_s(3) == 7 * DAY
    assert s.expire(100.0) == []
    assert s.expire(math.nextafter(100.0, math.inf)) == [4]
    assert s.expire(3 * DAY) == []
    assert s.expire(3 * DAY + 1) == [2]  # agent block after 3 days; the shared root stays
    assert s.match([1, 2], 3 * DAY + 1) == 1
    assert sorted(s.expire(7 * DAY + 1)) == [1, 3]
    # a chatbot hit (touch) raises an agent block's TTL to 7 days
    s.insert([5], 8 * DAY, "agent")
    s.touch([5], 8 * DAY, "chatbot")
    assert s.block_ttl_s(5) == 7 * DAY
    s.touch([5], 8 * DAY, "agent")  # a shorter class never lowers it
    assert s.block_ttl_s(5) == 7 * DAY


def test_no_ttl_never_expires_and_reinsert_of_expired_block_counts_it():
    s = KvStore(capacity_blocks=None)
    s.insert([1], 0.0)
    assert s.expire(1e12) == [] and s.match([1], 1e12) == 1 and s.block_ttl_s(1) is None
    s2 = KvStore(capacity_blocks=None, ttl_s=5.0)
    s2.insert([1], 0.0)
    s2.insert([1], 6.0)  # expired but unswept: dies (expired) and is stored anew
    assert (s2.inserted_blocks, s2.expired_blocks, len(s2)) == (2, 1, 1)
    assert s2.last_access_s(1) == 6.0


def test_over_capacity_sweeps_expired_before_evicting_live():
    s = KvStore(capacity_blocks=2, class_ttl_s={"agent": 10.0, "chatbot": 100.0})
    s.insert([1], 0.0, "chatbot")
    s.insert([2], 5.0, "agent")  # more recent than 1, but expires first
    assert s.insert([3], 20.0, "chatbot") == [2]  # hand: 2 expired at 15, so it goes, not LRU 1
    assert s.expired_blocks == 1 and s.evicted_blocks == 0
    assert s.insert([4], 21.0, "chatbot") == [1]  # now an LRU eviction
    assert s.evicted_blocks == 1


def test_bad_arguments_and_backwards_clock():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="capacity_blocks"):
            KvStore(capacity_blocks=bad)
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="ttl_s"):
            KvStore(None, ttl_s=bad)
    with pytest.raises(ValueError, match=r"class_ttl_s\['agent'\]"):
        KvStore(None, class_ttl_s={"agent": 0})
    s = KvStore(None)
    s.insert([1], 5.0)
    with pytest.raises(ValueError, match="backwards"):
        s.insert([2], 4.0)
    with pytest.raises(ValueError, match="backwards"):
        s.expire(4.999)


# ---------------------------------------------------------------------------------- properties
_CLASSES = st.sampled_from([None, "agent", "chatbot"])
_op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 12), max_size=6, unique=True), _CLASSES),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 12), max_size=6, unique=True), _CLASSES),
    st.tuples(st.just("expire"), st.just([]), st.just(None)),
    st.tuples(st.just("match"), st.lists(st.integers(0, 12), max_size=6, unique=True), st.just(None)),
)


@settings(max_examples=300, deadline=None)
@given(
    cap=st.one_of(st.none(), st.integers(0, 6)),
    ttl=st.sampled_from([None, 2.0, 5.0]),
    class_ttl=st.sampled_from([None, {"agent": 3.0, "chatbot": 7.0}, {"agent": 4.0}]),
    steps=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), _op), max_size=40),
)
def test_matches_reference_model_and_conserves_blocks(cap, ttl, class_ttl, steps):
    s, ref = KvStore(cap, ttl, class_ttl), RefStore(cap, ttl, class_ttl)
    now = 0.0
    for dt, (kind, hs, cls) in steps:
        now += dt  # small integer steps hit TTL boundaries exactly
        if kind == "insert":
            assert s.insert(hs, now, cls) == ref.insert(hs, now, cls)
        elif kind == "touch":
            s.touch(hs, now, cls)
            ref.touch(hs, now, cls)
        elif kind == "expire":
            assert s.expire(now) == ref.expire(now)
        else:
            assert s.match(hs, now) == ref.match(hs, now)
        assert s.lru_order() == [e[0] for e in ref.lst]
        assert {h: s.block_ttl_s(h) or math.inf for h in s} == {e[0]: e[2] for e in ref.lst}
        assert (s.inserted_blocks, s.evicted_blocks, s.expired_blocks) == (ref.inserted, ref.evicted, ref.expired)
        assert s.inserted_blocks == len(s) + s.evicted_blocks + s.expired_blocks
        if cap is not None:
            assert len(s) <= cap
