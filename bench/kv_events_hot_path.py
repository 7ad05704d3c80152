"""Does consuming engine KV events slow routing down? Routing latency while events stream in.

A publisher *process* (standing in for an engine) sends vLLM-format ``BlockStored`` batches of
``--event-tokens`` tokens (default 32k, engine block size 16) at ``--events-per-s`` over ZMQ. The
measured process runs an asyncio loop that routes a 4k-token request every millisecond (events
index mode, 8 replicas, router block size 64) and records, per request, the loop's lateness
(the wake-up delay a real request would also see) plus ``route()`` itself. Three modes, in one run:

* ``baseline``: no events;
* ``inline``: a subscriber inside the event loop (``zmq.asyncio``): decode, translate and apply
  in the loop's callback, as a naive integration would;
* ``thread``: :class:`~balancer.service.kv_subscriber.KvEventSubscriber` (decode and translate
  in a thread of the router process) + :class:`~balancer.service.kv_subscriber.LoopDelivery`
  (apply in the loop);
* ``process``: :class:`~balancer.service.kv_subscriber.KvEventSubscriberProcess` (decode and
  translate in a child process) + ``LoopDelivery``, as ``pdlb serve`` runs it.

Prints p50 / p99 / max of the added latency per mode and the ratios to the baseline.
Run: ``.venv/bin/python bench/kv_events_hot_path.py [--seconds 8]``.

``--processes N`` (N >= 2) compares instead, in one run, N router processes (each routing as
above, like ``pdlb serve --processes N``) in three modes:

* ``baseline``: no events;
* ``per-process``: every process runs its own ``KvEventSubscriberProcess`` (what ``pdlb serve``
  did before :mod:`balancer.service.processes.kv_fanout`): each batch decoded and translated N times;
* ``fanout``: process 0's subscriber writes the translated events to the fan-out ring and every
  process applies them from it (:class:`~balancer.service.processes.kv_fanout.KvFanout`, as ``pdlb serve``
  runs now): decoded once.

It prints the routing p50/p99 per mode and the CPU seconds per engine batch spent on events,
summed over every router process and subscriber child (each mode's CPU less the baseline's,
divided by the batches published in the window; CPU from ``time.process_time`` in each router
process and ``/proc/<pid>/stat`` for the subscriber children), and the ratio fanout / per-process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from balancer.hashing import hash_token_blocks  # noqa: E402
from balancer.kv_translate import KvEventTranslator  # noqa: E402
from balancer.kv_wire import decode_batch  # noqa: E402
from balancer.router import Router  # noqa: E402
from balancer.service.kv_subscriber import KvEventSource, KvEventSubscriber, KvEventSubscriberProcess, LoopDelivery  # noqa: E402,E501
from balancer.types import ReplicaId, Request  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publisher(port: int, events_per_s: float, event_tokens: int, seconds: float, ready, sent=None) -> None:  # noqa: ANN001
    """Engine stand-in: positional vLLM batches, one BlockStored of ``event_tokens`` tokens each
    (``sent``: a pipe that gets the ``time.monotonic()`` of every batch sent, at the end)."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    rng = random.Random(1)
    seq = 0
    bs = 16
    payloads = []  # made up front: the stand-in engine must not eat the measured process's CPU
    for _ in range(16):
        tokens = [rng.randrange(100_000) for _ in range(event_tokens)]
        hashes = [rng.getrandbits(64) for _ in range(event_tokens // bs)]
        ev = ["BlockStored", hashes, None, tokens, bs, None, "GPU", None]
        payloads.append(msgpack.packb([time.time(), [ev], 0]))
    ready.send(True)
    time.sleep(0.5)
    end = time.monotonic() + seconds
    times = []
    while time.monotonic() < end:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payloads[seq % len(payloads)]])
        times.append(time.monotonic())
        seq += 1
        time.sleep(1.0 / events_per_s)
    pub.close(0)
    ctx.term()
    if sent is not None:
        sent.send(times)


def make_router() -> tuple[Router, list[ReplicaId]]:
    r = Router("cache_aware", "cache_aware", block_size=64, index_mode="events", index_capacity_blocks=100_000)
    reps = [ReplicaId(f"http://e{i}", 0) for i in range(8)]
    for rep in reps:
        r.add_replica(rep, "mixed")
    return r, reps


async def route_loop(router: Router, seconds: float) -> np.ndarray:
    """Route one request per millisecond; per request: loop lateness + route() time, in ms."""
    rng = random.Random(2)
    prompts = [tuple(hash_token_blocks([rng.randrange(100_000) for _ in range(4096)], 64)) for _ in range(32)]
    out = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        t1 = time.perf_counter()
        req = Request(f"r{i}", 0.0, 4096, prompts[i % len(prompts)])
        router.route(req, t1)
        router.on_finished(req.request_id, t1)
        t2 = time.perf_counter()
        out.append((t1 - t0 - 0.001) + (t2 - t1))
        i += 1
    return np.array(out) * 1000.0


async def run_mode(mode: str, seconds: float, events_per_s: float, event_tokens: int) -> tuple[np.ndarray, int]:
    router, reps = make_router()
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    proc = None
    applied = [0]
    stop_inline = asyncio.Event()
    tasks = []
    sub = None
    if mode != "baseline":
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=publisher, args=(port, events_per_s, event_tokens, seconds + 1.0, send))
        proc.start()
        recv.recv()
    loop = asyncio.get_running_loop()
    if mode == "inline":
        import zmq
        import zmq.asyncio

        actx = zmq.asyncio.Context()
        s = actx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{port}")
        tr = KvEventTranslator(64)

        async def consume() -> None:
            while not stop_inline.is_set():
                try:
                    frames = await asyncio.wait_for(s.recv_multipart(), 0.2)
                except asyncio.TimeoutError:
                    continue
                for ev in decode_batch(frames[2]).events:
                    for pe in tr.translate(ev):
                        router.on_kv_event(reps[applied[0] % len(reps)], pe)
                applied[0] += 1
        tasks.append(asyncio.create_task(consume()))
    elif mode in ("thread", "process"):
        def apply(rep, ev):  # noqa: ANN001, ANN202
            router.on_kv_event(rep, ev)
            applied[0] += 1
        cls = KvEventSubscriber if mode == "thread" else KvEventSubscriberProcess
        sub = cls([KvEventSource(reps[0], f"tcp://127.0.0.1:{port}")], 64, LoopDelivery(loop, apply))
        sub.start()
    if mode != "baseline":
        await asyncio.sleep(1.0)  # publisher's warm-up
    lat = await route_loop(router, seconds)
    stop_inline.set()
    for t in tasks:
        await t
    if sub is not None:
        sub.stop()
    if proc is not None:
        proc.join(10)
    return lat, applied[0]


# ---------------------------------------------------------------------- --processes N
def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``; 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


async def _router_process(mode: str, index: int, port: int, ring_dir: str, seconds: float, go, out) -> None:  # noqa: ANN001
    from balancer.service.config import KvEventsConfig
    from balancer.service.processes.kv_fanout import KvFanout
    from balancer.service.processes.kv_ring import fanout_ring_path

    router, reps = make_router()
    loop = asyncio.get_running_loop()
    src = KvEventSource(reps[0], f"tcp://127.0.0.1:{port}")
    applied = [0]

    def apply(rep, ev):  # noqa: ANN001, ANN202
        router.on_kv_event(rep, ev)
        applied[0] += 1

    sub = fan = None
    if mode == "per-process":
        sub = KvEventSubscriberProcess([src], 64, LoopDelivery(loop, apply))
        sub.start()
    elif mode == "fanout":
        fan = KvFanout(fanout_ring_path(ring_dir), apply, index == 0, [src], 64, KvEventsConfig())
        if fan.owner:
            await loop.run_in_executor(None, fan.start_subscriber)
        fan.follower.start()
    child = sub.pid if sub is not None else (fan.subscriber.pid if fan is not None and fan.subscriber else None)
    out.send(("ready", index))
    await loop.run_in_executor(None, go.wait)
    t0, cpu0 = time.monotonic(), time.process_time()
    child0 = _proc_cpu_s(child) if child else 0.0
    applied0 = applied[0]
    lat = await route_loop(router, seconds)
    t1, cpu1 = time.monotonic(), time.process_time()
    child1 = _proc_cpu_s(child) if child else 0.0
    out.send(("done", index, t0, t1, cpu1 - cpu0, child1 - child0, applied[0] - applied0, lat))
    if sub is not None:
        await loop.run_in_executor(None, sub.stop)
    if fan is not None:
        await loop.run_in_executor(None, fan.stop)


def _router_process_main(*args) -> None:  # noqa: ANN002
    asyncio.run(_router_process(*args))


def run_processes_mode(mode: str, n: int, seconds: float, events_per_s: float, event_tokens: int) -> dict:
    """One mode with ``n`` router processes; returns latencies, CPU and the batches in the window."""
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    ring_dir = tempfile.mkdtemp(prefix="pdlb-bench-kv-", dir=shm)
    go = ctx.Event()
    conns, procs = [], []
    for i in range(n):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_router_process_main, args=(mode, i, port, ring_dir, seconds, go, send))
        p.start()
        conns.append(recv)
        procs.append(p)
    for c in conns:
        assert c.recv()[0] == "ready"
    pub = times_recv = None
    if mode != "baseline":
        ready_r, ready_s = ctx.Pipe(duplex=False)
        times_recv, times_send = ctx.Pipe(duplex=False)
        pub = ctx.Process(target=publisher, args=(port, events_per_s, event_tokens, seconds + 3.0, ready_s, times_send))
        pub.start()
        ready_r.recv()
        time.sleep(1.5)  # the publisher starts sending after 0.5 s: warm up for a second
    go.set()
    done = [c.recv() for c in conns]
    for p in procs:
        p.join(30)
    times = []
    if pub is not None:
        assert times_recv is not None
        times = times_recv.recv()
        pub.join(10)
    import shutil

    shutil.rmtree(ring_dir, ignore_errors=True)
    t0, t1 = min(d[2] for d in done), max(d[3] for d in done)
    return {"lat": np.concatenate([d[7] for d in done]), "cpu_s": sum(d[4] + d[5] for d in done),
            "router_cpu_s": sum(d[4] for d in done), "child_cpu_s": sum(d[5] for d in done),
            "applied": [d[6] for d in done], "batches": sum(1 for t in times if t0 <= t <= t1),
            "p99_by_process": [float(np.percentile(d[7], 99)) for d in sorted(done, key=lambda d: d[1])]}


def main_processes(args: argparse.Namespace) -> int:
    n = args.processes
    print(f"{n} router processes, each routing a 4k-token request every 1 ms for {args.seconds:g} s per mode; "
          f"events: {args.events_per_s:g}/s x {args.event_tokens} tokens (engine block 16, router block 64), "
          f"{os.cpu_count()} CPUs")
    res = {}
    for mode in ("baseline", "per-process", "fanout"):
        r = res[mode] = run_processes_mode(mode, n, args.seconds, args.events_per_s, args.event_tokens)
        lat = r["lat"]
        print(f"{mode:>12}: {len(lat):6d} routes, {r['batches']:4d} batches in the window, pdlb events applied per "
              f"process {r['applied']}; routing added latency ms p50 {np.percentile(lat, 50):.3f}  "
              f"p99 {np.percentile(lat, 99):.3f}  max {lat.max():.2f}; CPU s: routers {r['router_cpu_s']:.2f} "
              f"+ subscribers {r['child_cpu_s']:.2f}; p99 by process {[round(x, 2) for x in r['p99_by_process']]}")
    base = res["baseline"]
    per_batch = {}
    for mode in ("per-process", "fanout"):
        r = res[mode]
        extra = r["cpu_s"] - base["cpu_s"]
        per_batch[mode] = extra / max(1, r["batches"])
        print(f"{mode:>12}: CPU on events, summed over processes: {extra:.2f} s = {per_batch[mode] * 1000:.2f} ms "
              f"per batch; routing p99 x{np.percentile(r['lat'], 99) / np.percentile(base['lat'], 99):.2f} baseline")
    if per_batch["per-process"] > 0:
        print(f"fanout / per-process CPU per batch: x{per_batch['fanout'] / per_batch['per-process']:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import positive_float, positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=positive_float, default=8.0, help="routing time per mode (default: %(default)s)")
    ap.add_argument("--events-per-s", type=positive_float, default=50.0, help="BlockStored batches per second (default: %(default)s)")
    ap.add_argument("--event-tokens", type=positive_int, default=32768, help="tokens per BlockStored (default: %(default)s)")
    ap.add_argument("--processes", type=positive_int, default=1, metavar="N",
                    help="N >= 2: compare N router processes with a subscriber each against one subscriber "
                         "fanned out to all (default: %(default)s, the single-process modes)")
    args = ap.parse_args(argv)
    if args.processes > 1:
        return main_processes(args)
    print(f"routing a 4k-token request every 1 ms for {args.seconds:g} s per mode; events: "
          f"{args.events_per_s:g}/s x {args.event_tokens} tokens (engine block 16, router block 64), "
          f"{os.cpu_count()} CPUs")
    res = {}
    for mode in ("baseline", "inline", "thread", "process"):
        lat, n = asyncio.run(run_mode(mode, args.seconds, args.events_per_s, args.event_tokens))
        res[mode] = lat
        print(f"{mode:>10}: {len(lat):6d} routes, {n:6d} pdlb events applied; added latency ms "
              f"p50 {np.percentile(lat, 50):.3f}  p99 {np.percentile(lat, 99):.3f}  max {lat.max():.2f}")
    b50, b99 = np.percentile(res["baseline"], 50), np.percentile(res["baseline"], 99)
    for mode in ("inline", "thread", "process"):
        print(f"{mode:>10} / baseline: p50 x{np.percentile(res[mode], 50) / b50:.2f}  "
              f"p99 x{np.percentile(res[mode], 99) / b99:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
