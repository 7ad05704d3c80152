"""Per-request stage timeline and GC pauses inside ``pdlb serve``'s router processes, for
``bench/pd_tail.py`` only (issue 26): that bench puts this folder first on the router's
``PYTHONPATH`` with ``PDLB_TAIL_DIR`` set, so every interpreter it starts imports this module
first (Python's ``sitecustomize`` hook). Nothing in pdlb imports it; without ``PDLB_TAIL_DIR``
it does nothing.

What it records, on ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the
host, so the bench lines them up with its clients' send and receive times):

* per request carrying the header ``X-Tail-Seq``: the process, when ``Proxy.handle`` began and
  returned, and per leg (``Proxy._open``: the prefill leg's and the decode leg's request until
  their response headers) its role, start and end, and each new upstream TCP connection made
  for it (``_HostPool.connect``: a pool miss) and their seconds, and the client connection's port;
* every garbage collection (``gc.callbacks``): its start, duration and generation;
* in ``pdlb serve``'s parent, the load-following placement: each change of the active count ``k``
  and each connection placed (the process picked).

The records go to ``$PDLB_TAIL_DIR/<pid>.json`` when the process exits (``pdlb serve`` exits its
router processes with ``sys.exit`` after draining). The wrappers cost CPU of their own (a few
microseconds per request): timings of an instrumented run are for attribution, not for the table.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("PDLB_TAIL_DIR")


def _install(out_dir: str) -> None:
    import atexit
    import contextvars
    import gc
    import json
    import time

    from array import array

    mono = time.monotonic
    current: contextvars.ContextVar[list | None] = contextvars.ContextVar("pdlb_tail", default=None)
    # flat arrays of floats, not Python objects: what the probe keeps must not feed the collector it
    # measures (a dict and two lists kept per request made a young collection every ~1,700 requests)
    requests = array("d")  # per request _REC floats: seq, h0, h1, p0, p1, d0, d1, pool misses, miss s, client port
    gcs = array("d")  # per collection: start, duration, generation
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = mono()
        else:
            t = gc_start[0]
            gcs.extend((t, mono() - t, info.get("generation", -1)))

    gc.callbacks.append(on_gc)

    garbage = os.environ.get("PDLB_TAIL_GARBAGE") == "1"
    if garbage:  # keep what the collector finds unreachable, to name it at exit
        gc.set_debug(gc.DEBUG_SAVEALL)

    placement = array("d")  # the parent: per pass with a change (time, -1, k before, k after), per pick (time, index, k, n)

    def dump() -> None:
        if not requests and not gcs and not placement:
            return
        found: dict[str, int] = {}
        if garbage:
            for gen in (0, 1, 2):  # what survived in each generation (not the frozen start-up heap)
                for o in gc.get_objects(gen):
                    name = f"gen{gen} {type(o).__module__}.{type(o).__qualname__}"
                    found[name] = found.get(name, 0) + 1
            gc.collect()
            for o in gc.garbage:
                name = f"garbage {type(o).__module__}.{type(o).__qualname__}"
                found[name] = found.get(name, 0) + 1
        path = os.path.join(out_dir, f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"pid": os.getpid(), "requests": requests.tolist(), "gc": gcs.tolist(), "garbage": found,
                       "placement": placement.tolist()}, f)

    atexit.register(dump)

    def patch() -> None:
        from balancer.service import proxy, upstream

        handle, open_, connect = proxy.Proxy.handle, proxy.Proxy._open, upstream._HostPool.connect

        async def handle_w(self, request, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            seq = request.headers.get("X-Tail-Seq")
            if seq is None:
                return await handle(self, request, *a, **k)
            tr = getattr(getattr(request, "protocol", None), "transport", None)
            peer = tr.get_extra_info("peername") if tr is not None else None
            rec = [float(seq), mono(), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, float(peer[1] if peer else 0)]
            token = current.set(rec)
            try:
                return await handle(self, request, *a, **k)
            finally:
                rec[2] = mono()
                current.reset(token)
                requests.extend(rec)

        async def open_w(self, w, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            rec = current.get()
            t0 = mono()
            try:
                return await open_(self, w, *a, **k)
            finally:
                if rec is not None:
                    i = 3 if w.cfg.role == "prefill" else 5
                    rec[i], rec[i + 1] = t0, mono()

        async def connect_w(self):  # noqa: ANN001, ANN202
            rec = current.get()
            t0 = mono()
            try:
                return await connect(self)
            finally:
                if rec is not None:
                    rec[7] += 1
                    rec[8] += mono() - t0

        proxy.Proxy.handle, proxy.Proxy._open, upstream._HostPool.connect = handle_w, open_w, connect_w

        from balancer.service.processes import placement as pl

        pick, tick = pl.PlacementControl.pick, pl.PlacementControl.tick

        def pick_w(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            i = pick(self, *a, **k)
            b = self.block
            seen = 0.0  # the loads pick saw, of the first 8 processes, as one number (base 100)
            for j in range(min(8, b.processes)):
                seen = seen * 100 + min(99, b.field(j, 2) + max(0, self.sent[j] - b.field(j, 3)))
            placement.extend((mono(), -2.0 if i is None else float(i), float(b.active), seen))
            return i

        def tick_w(self, now_s, cpu_s):  # noqa: ANN001, ANN202
            k0 = self.block.active
            k1 = tick(self, now_s, cpu_s)
            if k1 != k0:
                placement.extend((mono(), -1.0, float(k0), float(k1)))
            return k1

        pl.PlacementControl.pick, pl.PlacementControl.tick = pick_w, tick_w

    patch()  # imports pdlb's proxy now (the router would import it anyway)


if _DIR:
    _install(_DIR)
