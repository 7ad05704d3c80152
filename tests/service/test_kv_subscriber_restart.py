"""The KV event subscriber resyncs an engine that restarted and lost its first batches while the
socket reconnected, and its child process logs in the router's format. Expected values are worked
out by hand from the inputs.
"""

from __future__ import annotations

import time

import pytest


def test_a_restarted_engine_whose_first_batches_were_lost_while_reconnecting_is_resynced():
    """Tried by hand (SGLang 0.5.23's own publisher behind `pdlb serve --index-mode events`): an
    engine restarted and published a few batches (numbered below the old last one) before the SUB
    socket reconnected, then nothing more. The predecessor's view stayed credited to it for
    minutes (until something else cleared it): the restart check waited for a next live batch.
    Now the reconnect itself asks a replay from the last applied number; the new engine holds
    nothing from there on, so its view is cleared and rebuilt from its buffer (replay from 0).
    Expected routes by construction: the prompts each engine was given. About 2 s."""
    pytest.importorskip("zmq")
    from tests.service.test_engine_conformance import PROBES_PER_ENGINE, Cluster, _fill, prompt
    c = Cluster("sglang")
    try:
        c.connected()
        want = _fill(c)
        c.wait_routed(want, time.monotonic(), what="before the restart")
        old_a = want["a"]
        c.a.restart()
        fresh = [prompt(600 + i, tag=5) for i in range(2)]  # 2 batches: numbers 0, 1 < the old last
        assert c.stats("a")["last_seq"] >= PROBES_PER_ENGINE  # the old numbering went past them
        c.a.drop_next(len(fresh))  # lost on the wire, as while the SUB socket reconnects
        for t in fresh:
            c.a.store(t)
        c.a.wait_sent(len(fresh))
        want["a"] = fresh
        c.wait_routed(want, time.monotonic(), bound_s=5.0, what="restart, its batches lost, nothing after")
        assert all(c.held_blocks("a", t) == 0 for t in old_a), "the old engine's blocks are still credited to it"
        assert c.stats("a")["restarts"] == 1
    finally:
        c.close()


def test_the_subscriber_child_process_logs_in_the_routers_format(capfd):
    """`pdlb serve` (runner: process, the default) printed the child's lines bare, e.g.
    `KV events of http://127.0.0.1:31100/dp0: nothing for 60 s (stale)` beside the router's
    `2026-12-04 21:56:33,188 ERROR pdlb.kv_events: ...`, and dropped its INFO lines: a spawned child
    starts with no logging set up. It now takes the router's format and level. Expected line by
    hand: the format below applied to the stale warning of a source that never publishes."""
    pytest.importorskip("zmq")
    import logging
    import re

    from balancer.service.kv_subscriber import KvEventSource, KvEventSubscriberProcess
    from balancer.types import ReplicaId
    from tests.kv_publisher import free_port

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    sub = KvEventSubscriberProcess([KvEventSource(ReplicaId("http://silent", 0), f"tcp://127.0.0.1:{free_port()}")],
                                   64, lambda items: None, stale_after_s=0.3)
    try:
        sub.start()
        deadline = time.monotonic() + 10
        err = ""
        while time.monotonic() < deadline and "stale" not in err:
            time.sleep(0.2)
            err += capfd.readouterr().err
    finally:
        sub.stop()
        root.handlers, _ = saved[0], root.setLevel(saved[1])
    line = next((ln for ln in err.splitlines() if "stale" in ln), "")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING pdlb\.kv_events: KV events of "
                        r"http://silent/dp0: nothing for \d+ s \(stale\)", line), err
