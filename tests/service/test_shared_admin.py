"""Several processes of one ``pdlb serve``: admin changes applied everywhere or nowhere
(:mod:`balancer.service.processes.shared_admin`), shared-load columns of workers added and removed at run
time (:mod:`balancer.service.processes.shared_load`), per-process KV-event metrics
(:class:`balancer.service.kv_subscriber.KvEventsFilesCollector`) and the default process count."""

from __future__ import annotations

import asyncio
import os
import threading
from multiprocessing import Pipe
from pathlib import Path

import aiohttp
import pytest

from balancer.parts import LoadSources
from balancer.router import Router
from balancer.service.processes import shared_admin
from balancer.service.processes.shared_admin import AdminChannel, AdminCoordinator, AdminRefused
from balancer.service.processes.shared_load import SharedLoad, create_shared_load_block
from balancer.types import ReplicaId, Request


def _req(rid: str, tokens: int = 64) -> Request:
    return Request(rid, 0.0, tokens, tuple(range(tokens // 64)))


# ---------------------------------------------------------------------- shared load columns
def test_columns_of_a_worker_added_and_removed_at_run_time():
    """Two processes' views of a block of 8 columns: e0, e1 in columns 0, 1 (config order); e2
    added at column 5 in both. A routes 2 requests to e2: B reads 2 on e2 from A's row. Removing
    e2 zeroes each process's own column; a new worker given column 5 afterwards starts at 0."""
    e0, e1, e2, e3 = (ReplicaId(f"e{i}", 0) for i in range(4))
    shm = create_shared_load_block(2, 8)
    try:
        va, vb = (SharedLoad(shm.name, 2, i, columns=8) for i in range(2))
        routers = [Router("least_load", "least_load", block_size=64, load_sources=LoadSources(peer=v)) for v in (va, vb)]
        for r, v in zip(routers, (va, vb)):
            r.add_replica(e0, "mixed")
            r.add_replica(e1, "mixed")
            v.add([e0, e1])
        a, b = routers
        for r, v in ((a, va), (b, vb)):
            r.add_replica(e2, "mixed")
            v.add({e2: 5})
        assert va.columns == {e0: 0, e1: 1, e2: 5}
        a.set_healthy(e0, False)
        a.set_healthy(e1, False)
        for i in range(2):
            assert a.route(_req(f"a{i}"), 1.0).decode == e2
        b.route(_req("b0"), 1.0)  # refreshes B's peer arrays before deciding
        assert int(b.load.peer_requests[b.load.slot(e2)]) == 2
        assert int(b.load.peer_requests[b.load.slot(e0)]) == 0
        with pytest.raises(ValueError, match="outside"):
            vb.add({e3: 8})
        with pytest.raises(ValueError, match="already used"):
            vb.add({e3: 5})
        # remove e2 everywhere (each process zeroes its own row), then reuse column 5 for e3
        for r, v in ((a, va), (b, vb)):
            v.remove([e2])
            r.remove_replica(e2)
            r.add_replica(e3, "mixed")
            v.add({e3: 5})
        b.route(_req("b1"), 2.0)
        assert int(b.load.peer_requests[b.load.slot(e3)]) == 0  # A's 2 requests on e2 did not carry over
        va.close()
        vb.close()
    finally:
        shm.close()
        shm.unlink()


# ---------------------------------------------------------------------- coordinator
class _FakeProcess:
    """A router process's admin side in a thread: a worker set; refuses adds of ``refuse``
    (409), never answers when ``silent``."""

    def __init__(self, conn, refuse: str | None = None, silent: bool = False) -> None:  # noqa: ANN001
        self.conn, self.refuse, self.silent = conn, refuse, silent
        self.urls: dict[str, list[int]] = {"http://a": [0, 1]}
        self.results: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "result":
                self.results.append(msg)
                continue
            _, op_id, op, payload, cols = msg
            if self.silent:
                continue
            if op == "add" and payload["url"] == self.refuse:
                self.conn.send(("ack", op_id, False, [409, "refused here"]))
                continue
            if op == "add":
                self.urls[payload["url"]] = cols
            elif self.urls.pop(payload, None) is None:
                self.conn.send(("ack", op_id, False, [404, f"no worker {payload}"]))
                continue
            self.conn.send(("ack", op_id, True, None))


def _coordinator(*fakes_kw):  # noqa: ANN002, ANN202
    mine, fakes = [], []
    for kw in fakes_kw:
        a, b = Pipe(duplex=True)
        mine.append(a)
        fakes.append(_FakeProcess(b, **kw))
    return AdminCoordinator(mine, {"http://a": [0, 1]}, capacity=6), fakes


def test_coordinator_applies_everywhere_or_nowhere(monkeypatch):
    coord, fakes = _coordinator({}, {}, {"refuse": "http://bad"})
    # an add reaches all three, with the same fresh columns
    coord.apply_everywhere("add", {"url": "http://b", "dp_size": 2})
    assert all(f.urls == {"http://a": [0, 1], "http://b": [2, 3]} for f in fakes)
    # process 2 refuses: the two that applied it remove it again; its columns are free again
    with pytest.raises(AdminRefused) as e:
        coord.apply_everywhere("add", {"url": "http://bad", "dp_size": 1})
    assert (e.value.status, e.value.message) == (409, "refused here")
    _settle(fakes)
    assert all("http://bad" not in f.urls for f in fakes) and "http://bad" not in coord.columns
    coord.apply_everywhere("add", {"url": "http://c", "dp_size": 1})
    assert coord.columns["http://c"] == [4]  # the refused add's column, reused
    # removals free columns; unknown URLs and duplicates are refused before any process sees them
    coord.apply_everywhere("remove", "http://b")
    assert all(set(f.urls) == {"http://a", "http://c"} for f in fakes)
    with pytest.raises(AdminRefused, match="no worker") as e:
        coord.apply_everywhere("remove", "http://b")
    assert e.value.status == 404
    with pytest.raises(AdminRefused, match="already registered"):
        coord.apply_everywhere("add", {"url": "http://c"})
    # capacity 6: columns 2, 3 (freed) and 5 are left
    coord.apply_everywhere("add", {"url": "http://d", "dp_size": 3})
    assert sorted(coord.columns["http://d"]) == [2, 3, 5]
    with pytest.raises(AdminRefused, match="no room") as e:
        coord.apply_everywhere("add", {"url": "http://e", "dp_size": 1})
    assert e.value.status == 409
    assert coord.changes == 4


def test_a_removal_that_finds_the_worker_gone_counts_as_done():
    coord, fakes = _coordinator({}, {})
    coord.apply_everywhere("add", {"url": "http://b"})
    del fakes[1].urls["http://b"]  # process 1 answers 404
    coord.apply_everywhere("remove", "http://b")
    assert "http://b" not in coord.columns and all("http://b" not in f.urls for f in fakes)


async def test_a_worker_is_not_left_half_added_when_following_its_events_fails(monkeypatch):
    """apply_admin_change: the pool add succeeded but subscribing to the worker's KV events
    raised: the worker is removed again before the error propagates (the parent then undoes the
    add in the other processes)."""
    from balancer.service import app as app_mod
    from balancer.service.config import ServiceConfig

    async def broken(svc, wcfg):  # noqa: ANN001, ANN202
        raise RuntimeError("subscriber did not start")

    monkeypatch.setattr(app_mod, "_follow_kv_events", broken)
    svc = app_mod.Service(ServiceConfig(decode_policy={"name": "round_robin"}))
    with pytest.raises(RuntimeError, match="did not start"):
        await app_mod.apply_admin_change(svc, "add", {"url": "http://127.0.0.1:9", "role": "mixed"}, [])
    assert svc.pool.workers == {} and svc.router.replicas() == []


def test_coordinator_undoes_an_add_a_process_never_confirmed(monkeypatch):
    monkeypatch.setattr(shared_admin, "APPLY_TIMEOUT_S", 0.5)
    coord, fakes = _coordinator({}, {"silent": True})
    with pytest.raises(AdminRefused, match="did not apply") as e:
        coord.apply_everywhere("add", {"url": "http://b"})
    assert e.value.status == 503
    _settle(fakes[:1])
    assert "http://b" not in fakes[0].urls and "http://b" not in coord.columns


def test_coordinator_answers_the_asking_process_after_all_applied():
    coord, fakes = _coordinator({}, {})
    fakes[1].conn.send(("admin", 7, "add", {"url": "http://b"}))
    coord.poll(2.0)
    _settle(fakes)
    assert fakes[1].results == [("result", 7, True, None)] and fakes[0].results == []
    assert all("http://b" in f.urls for f in fakes)
    fakes[0].conn.send(("admin", 8, "remove", "http://zzz"))
    coord.poll(2.0)
    _settle(fakes)
    assert fakes[0].results == [("result", 8, False, [404, "no worker http://zzz"])]


def _settle(fakes, timeout_s: float = 2.0) -> None:  # noqa: ANN001
    """Let the fake processes' threads handle what is in their pipes."""
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(f.conn.poll() for f in fakes):
        time.sleep(0.01)
    time.sleep(0.05)


async def test_admin_channel_applies_in_order_and_reports_refusals():
    """The process side: applies "apply" messages one at a time in arrival order and acks each
    (a refusal with its status); request() returns the parent's result."""
    parent, child = Pipe(duplex=True)
    applied = []

    async def apply(op, payload, cols):  # noqa: ANN001, ANN202
        await asyncio.sleep(0.01 if payload == "slow" else 0)
        if payload == "no":
            raise AdminRefused(409, "nope")
        applied.append((op, payload, cols))

    ch = AdminChannel(child, apply)
    ch.start()
    try:
        for i, p in enumerate(["slow", "fast", "no"]):
            parent.send(("apply", i, "add", p, [i]))
        acks = [await asyncio.to_thread(parent.recv) for _ in range(3)]
        assert applied == [("add", "slow", [0]), ("add", "fast", [1])]
        assert acks == [("ack", 0, True, None), ("ack", 1, True, None), ("ack", 2, False, [409, "nope"])]
        task = asyncio.create_task(ch.request("remove", "http://x"))
        msg = await asyncio.to_thread(parent.recv)
        assert msg == ("admin", 0, "remove", "http://x")
        parent.send(("result", 0, False, [404, "no worker http://x"]))
        with pytest.raises(AdminRefused, match="no worker") as e:
            await task
        assert e.value.status == 404
    finally:
        await ch.close()


# ---------------------------------------------------------------------- KV-event metrics per process
class _Stats:
    def __init__(self, batches: int) -> None:
        self.batches = batches

    def stats(self):  # noqa: ANN201
        from balancer.service.kv_metrics import KvEventsCollector

        d = {k: 0 for k in KvEventsCollector.COUNTERS} | {"batches": self.batches, "stale": False, "last_seq": 9,
                                                            "translator_engine_blocks": 3}
        return {ReplicaId("http://e", 0): d}


def test_kv_event_counters_of_each_process_carry_its_index(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from balancer.service.kv_metrics import KvEventsFilesCollector, write_stats_file

    write_stats_file(str(tmp_path), 0, _Stats(4))
    write_stats_file(str(tmp_path), 1, _Stats(5))
    (tmp_path / "kv-events-2.json").write_text("{trunc")  # a process mid-start: skipped
    reg = CollectorRegistry()
    reg.register(KvEventsFilesCollector(str(tmp_path)))
    text = generate_latest(reg).decode()
    assert 'pdlb_kv_events_batches_total{dp_rank="0",process="0",worker="http://e"} 4.0' in text
    assert 'pdlb_kv_events_batches_total{dp_rank="0",process="1",worker="http://e"} 5.0' in text
    assert 'pdlb_kv_events_last_seq{dp_rank="0",process="1",worker="http://e"} 9.0' in text
    assert 'process="2"' not in text


# ---------------------------------------------------------------------- default process count
def test_default_process_count_is_the_cores_this_process_may_use():
    from balancer.service.launch import default_processes
    from balancer.service.config import ServiceConfig

    assert ServiceConfig().processes is None
    cores = len(os.sched_getaffinity(0))
    assert default_processes() == min(256, cores)
    assert default_processes(["http://10.1.2.3:8000"]) == min(256, cores)
    # an engine on this host (issue 30): one process per 4 cores, at least one
    for local in ("http://127.0.0.1:8000", "http://localhost:9", "http://[::1]:9"):
        assert default_processes(["http://10.1.2.3:8000", local]) == max(1, cores // 4)


async def test_pdlb_serve_default_process_count_leaves_cores_to_a_local_engine():
    from sim.emulator.testing import _spawn, spawn_engines

    engines = spawn_engines([("mixed", "--zero-delay")])
    router = _spawn(["serve", "--port", "0", "--pd-protocol", "none", "--mixed", engines[0].url])
    try:
        async with aiohttp.ClientSession() as s, s.get(router.url + "/health") as r:
            # the engine is on this host: one process per 4 cores (at least one)
            assert (await r.json())["process"]["count"] == max(1, len(os.sched_getaffinity(0)) // 4)
    finally:
        router.stop()
        engines[0].stop()


def test_a_failed_multiprocess_start_leaves_the_environment_as_it_was(tmp_path, capsys):
    """main() in process with several router processes that fail to start (bad tokenizer path):
    status 2, one clear line, and PROMETHEUS_MULTIPROC_DIR not left set for the caller."""
    from pdlb_cli.serve import main

    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    code = main(["--processes", "2", "--port", "0", "--pd-protocol", "none", "--mixed", "http://127.0.0.1:9",
                 "--tokenizer", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2 and "error: tokenizer_path" in err and "(router process " in err and "Traceback" not in err
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == before


def test_multiprocess_metrics_take_the_pid_from_a_cache(tmp_path):
    """A router process's metric updates in multiprocess mode take its id from a cache, not from
    os.getpid() (a system call, ~10 per request), and the cache follows fork: in a fresh
    interpreter with PROMETHEUS_MULTIPROC_DIR set, 3 increments land in counter_<pid>.db; with the
    cache set to 424242 the next one opens counter_424242.db (so the id came from the cache); a
    forked child's increment lands in counter_<child pid>.db; the collector sums all: 3 + 1 + 1."""
    import subprocess
    import sys

    code = """
import os
from balancer.service import metrics
m = metrics.ServiceMetrics(multiprocess=True)
c = m.child(m.requests, "/v1/completions", "200")
for _ in range(3):
    c.inc()
real = os.getpid()
metrics._PID["value"] = 424242
c.inc()
metrics._PID["value"] = real
child = os.fork()
if child == 0:
    c.inc()
    os._exit(0)
os.waitpid(child, 0)
from prometheus_client import CollectorRegistry, multiprocess
reg = CollectorRegistry(); multiprocess.MultiProcessCollector(reg)
total = [s.value for f in reg.collect() for s in f.samples if s.name == "pdlb_requests_total"]
files = sorted(f for f in os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]) if f.startswith("counter_"))
print(total, files == sorted([f"counter_{real}.db", "counter_424242.db", f"counter_{child}.db"]))
"""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[5.0]", "True"]


def test_multiprocess_counts_outside_an_event_loop_are_not_lost(tmp_path):
    """ServiceMetrics.count with several processes and no running event loop applies each count at
    once (it flushes right away): 3 counts -> 3.0 in the files the collector sums. It used to
    increment the batch that the immediate flush had just swapped out, losing every count."""
    import subprocess
    import sys

    code = """
from balancer.service import metrics
m = metrics.ServiceMetrics(multiprocess=True)
for _ in range(3):
    m.count(m.requests, "/v1/completions", "200")
from prometheus_client import CollectorRegistry, multiprocess
reg = CollectorRegistry(); multiprocess.MultiProcessCollector(reg)
print([s.value for f in reg.collect() for s in f.samples if s.name == "pdlb_requests_total"])
"""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[3.0]"]
