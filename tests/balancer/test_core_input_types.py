"""The library's inputs of the wrong type: a ``Request``'s counts and hashes, ``Router`` settings,
the index TTL. Expected exceptions and messages are written out by hand.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("field, value, exc, message", [
    # were accepted (True as 1 token, 10.5 tokens counted as load) or a bare "'<' not supported ..."
    ("prompt_tokens", "10", TypeError, "request r1: prompt_tokens must be an integer >= 1, got str '10'"),
    ("prompt_tokens", True, TypeError, "request r1: prompt_tokens must be an integer >= 1, got bool True"),
    ("prompt_tokens", 10.5, TypeError, "got float 10.5"),
    ("prompt_tokens", 10.0, TypeError, "got float 10.0"),
    ("max_output_tokens", "4", TypeError, "request r1: max_output_tokens must be an integer >= 1, got str '4'"),
    ("max_output_tokens", 0, ValueError, "request r1: max_output_tokens must be an integer >= 1, got 0"),
    # expected_output_tokens was not checked at all: -50 output tokens released -50 tokens of load
    ("expected_output_tokens", -50, ValueError, "request r1: expected_output_tokens must be an integer >= 1, got -50"),
    ("expected_output_tokens", 0, ValueError, "got 0"),
    ("expected_output_tokens", 2.5, TypeError, "got float 2.5"),
    # a string was indexed as blocks 'a', 'b'; floats as float keys
    ("block_hashes", "ab", TypeError, "request r1: block_hashes must be a sequence of integers, got str 'ab'"),
    ("block_hashes", (1.5, 2.5), TypeError, "request r1: block_hashes[0] must be an integer, got float 1.5"),
    ("block_hashes", [1, None], TypeError, "block_hashes[1] must be an integer, got NoneType None"),  # a list: every hash
    ("block_hashes", 7, TypeError, "block_hashes must be a sequence of integers, got int 7"),
])
def test_request_refuses_counts_and_hashes_of_the_wrong_type(field, value, exc, message) -> None:
    from balancer.types import Request

    kw = {"request_id": "r1", "arrival_time_s": 0.0, "prompt_tokens": 32} | {field: value}
    with pytest.raises(exc) as ei:
        Request(**kw)
    assert message in str(ei.value)


def test_request_takes_numpy_integers_and_lists_as_plain_ints_and_a_tuple() -> None:
    import numpy as np

    from balancer.types import Request

    r = Request("r1", 0.0, np.int64(32), [np.uint64(5), 7], max_output_tokens=np.int32(3), expected_output_tokens=np.int64(2))
    assert r.block_hashes == (5, 7) and all(type(h) is int for h in r.block_hashes)
    assert (type(r.prompt_tokens), type(r.max_output_tokens), type(r.expected_output_tokens)) == (int, int, int)
    assert (r.prompt_tokens, r.max_output_tokens, r.output_tokens) == (32, 3, 2)
    assert Request("r2", 0.0, 32, np.array([1, 2], dtype=np.uint64)).block_hashes == (1, 2)
    hash(Request("r3", 0.0, 32, [1, 2]))  # a list made the frozen request unhashable


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"block_size": "16"}, TypeError, "block_size must be an integer >= 1, got str '16'"),
    ({"block_size": 16.5}, TypeError, "block_size must be an integer >= 1, got float 16.5"),  # was taken as is
    ({"pd_min_uncached_tokens": 0.5}, TypeError, "pd_min_uncached_tokens must be an integer >= 0, got float 0.5"),
    # NaN compares False with everything: "ttl_s <= 0" let it through and no entry ever expired
    ({"index_ttl_s": float("nan")}, ValueError, "index_ttl_s must be a number of seconds > 0 or None, got nan"),
    ({"shared_store": True, "store_ttl_s": float("nan")}, ValueError, "store_ttl_s must be a number of seconds > 0"),
    ({"index_ttl_s": "60"}, ValueError, "index_ttl_s must be a number of seconds > 0 or None, got '60'"),
    ({"index_capacity_blocks": 1e6}, TypeError, "capacity_blocks must be an integer >= 1, got float 1000000.0"),
])
def test_router_refuses_settings_of_the_wrong_type(kwargs, exc, message) -> None:
    from balancer import Router

    with pytest.raises(exc) as ei:
        Router(**kwargs)
    assert message in str(ei.value)


def test_router_index_ttl_still_expires_entries_and_inf_means_never() -> None:
    # the TTL check itself: a prompt routed at t=0 with index_ttl_s=10 matches at t=5, not at t=20
    from balancer import ReplicaId, Request, Router

    for ttl, hit_at_20 in ((10.0, 0), (float("inf"), 32)):
        r = Router("cache_aware", "cache_aware", block_size=16, index_ttl_s=ttl)
        r.add_replica(ReplicaId("d", 0), "decode")
        r.route(Request("a", 0.0, 32, (1, 2)), now_s=0.0)
        assert r.route(Request("b", 5.0, 32, (1, 2)), now_s=5.0).decode_matched_tokens == 32
        assert r.route(Request("c", 20.0, 32, (1, 2)), now_s=20.0).decode_matched_tokens == hit_at_20
