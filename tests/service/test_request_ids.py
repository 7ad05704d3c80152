"""The router's request ids (``Proxy.new_upstream_id``): OS random bytes, drawn a batch per
``os.urandom`` call, each byte used once, and never shared with a forked child.

Expected values: the ids must be exactly the hex of consecutive 12-byte slices of what
``os.urandom`` returned (recorded here), one call per 256 ids; a child's ids must differ from the
parent's next ones (with the batch kept across the fork both would be the same bytes).
"""

from __future__ import annotations

import multiprocessing
import os
import re

import pytest

from balancer.service import proxy


def test_ids_are_consecutive_slices_of_os_random_bytes(monkeypatch) -> None:
    calls: list[bytes] = []
    real = os.urandom

    def recording(n: int) -> bytes:
        b = real(n)
        calls.append(b)
        return b

    monkeypatch.setattr(proxy, "_IDS", proxy._RandomIds())
    monkeypatch.setattr(proxy.os, "urandom", recording)
    ids = [proxy.random_id_hex() for _ in range(3 * proxy._ID_BATCH + 5)]
    assert len(calls) == 4 and all(len(c) == proxy.ID_BYTES * proxy._ID_BATCH for c in calls)
    stream = b"".join(calls)
    assert ids == [stream[k * 12:(k + 1) * 12].hex() for k in range(len(ids))]
    assert all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)


def _child_ids(q) -> None:  # noqa: ANN001
    q.put([proxy.random_id_hex() for _ in range(4)])


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork")
def test_a_forked_child_draws_its_own_bytes() -> None:
    proxy.random_id_hex()  # the parent holds a batch now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_ids, args=(q,))
    p.start()
    child = q.get(timeout=30)
    p.join(30)
    parent = [proxy.random_id_hex() for _ in range(4)]
    assert not set(child) & set(parent)
