"""Bench-only switches for ``bench/router_scaling.py --phases ablate`` (never on a normal path):
this folder is put on ``PYTHONPATH`` of the ``pdlb serve`` it measures, so that the spawned
router processes import it too. ``PDLB_BENCH_ABLATE`` is a comma list of

* ``peer_refresh``: a decision does not read the other processes' load rows (``SharedLoad.refresh``
  only publishes this process's row), as a policy that reads no load would need;
* ``prefix_share``: no decision rings (``PrefixShare.publish`` and ``drain`` do nothing), as a
  pool whose policy reads no prefix index would need.

It measures what those costs are; it is not a fix (load-aware and prefix-aware policies need both).

``bench/proxy_floor.py --ablate`` uses these, which take whole parts of one request's work away
(the answers stay 200; only for measuring, with a round-robin mixed pool):

* ``route``: ``Router.route`` returns the next decode replica in turn (no load or prefix index
  read or updated, no candidates) and its hooks (``on_first_token``, ``on_finished``, ...) do nothing;
* ``timeouts``: the proxy's ``asyncio.timeout`` / ``timeout_at`` and its deadline queues
  (``balancer.service.deadlines``) set no deadline;
* ``hash``: ``PromptHasher.hash`` answers (100 tokens, no blocks) without reading the prompt;
* ``checks``: the proxy's request checks (``check_request``, ``session_id_of``,
  ``client_request_id``) accept everything;
* ``metrics``: ``ServiceMetrics.count``, ``request_done`` and the histogram observations do nothing;
* ``proxy``: ``Proxy.handle`` forwards the client's body to the next worker in turn with the
  proxy's lean client and answers with the engine's body (no checks, hashing, routing, retries,
  timers, request context or id rewriting): what the service's structure around the proxy costs;
* ``service``: the server's request handler does that itself for a generation ``POST`` (no
  ``_observed`` / ``_generate`` either: no metrics, JSON parse, in-flight count): what is left is
  pdlb's aiohttp server as configured (runner, connection limit, keep-alive, handler
  cancellation) and its background tasks, against ``proxy_floor.py``'s minimal aiohttp proxy;
* ``candidates``: ``Router._candidates`` builds no load, capacity or match columns (zeros: right
  for round robin, which reads only the replicas; the match-ratio metric then reads 0): what a
  path for policies that read no column could save;
* ``index``: the prefix index matches nothing and records nothing (``PrefixIndex.match_depths`` /
  ``insert``);
* ``load``: the load tracker counts nothing (``LoadTracker.on_dispatch`` / ``on_prefill_done`` /
  ``on_finished`` do nothing; round robin reads no load).
"""

import os

_what = {w.strip() for w in os.environ.get("PDLB_BENCH_ABLATE", "").split(",") if w.strip()}
if "peer_refresh" in _what:
    from balancer.service.processes import shared_load as _sl
    _sl.SharedLoad.refresh = _sl.SharedLoad.publish
if "prefix_share" in _what:
    from balancer.service.processes import shared_prefix as _sp
    _sp.PrefixShare.publish = lambda self, replicas, block_hashes, now_s: None
    _sp.PrefixShare.drain = lambda self: 0
if "route" in _what:
    import itertools

    from balancer.router import Router
    from balancer.types import Route

    _turn = itertools.count()

    def _route(self, request, now_s, exclude_engines=()):  # noqa: ANN001, ANN202
        reps = self.registry.pools()["decode"].replicas
        return Route(request.request_id, None, reps[next(_turn) % len(reps)], 0, 0, None, None)

    Router.route = _route
    for _hook in ("on_prefill_done", "on_first_token", "on_finished"):
        setattr(Router, _hook, lambda self, *a, **k: None)
if "timeouts" in _what:
    import asyncio
    import types

    from balancer.service import proxy as _px

    class _NoTimer:
        async def __aenter__(self):  # noqa: ANN204
            return self

        async def __aexit__(self, *exc):  # noqa: ANN002, ANN204
            return False

    _shim = types.SimpleNamespace(**{k: getattr(asyncio, k) for k in dir(asyncio) if not k.startswith("__")})
    _shim.timeout = _shim.timeout_at = lambda *a, **k: _NoTimer()
    _px.asyncio = _shim
    from balancer.service.deadlines import DeadlineQueue

    DeadlineQueue.at = DeadlineQueue.after = lambda self, *a: _NoTimer()
if "hash" in _what:
    from balancer.service.prompt import PromptHasher

    PromptHasher.hash = lambda self, prompt, root_hash=None: (100, ())
if "checks" in _what:
    from balancer.service import proxy as _px

    _px.check_request = _px.session_id_of = _px.client_request_id = lambda *a, **k: None
if "metrics" in _what:
    from balancer.service.metrics import ServiceMetrics

    class _NoMetric:
        def inc(self, *a):  # noqa: ANN002, ANN202
            pass

        observe = inc

    ServiceMetrics.count = ServiceMetrics.request_done = lambda self, *a: None
    ServiceMetrics.child = lambda self, *a: _NoMetric()
if "proxy" in _what or "service" in _what:
    import itertools

    from aiohttp import web

    from balancer.service import app as _app
    from balancer.service import proxy as _px

    _next = itertools.count()

    async def _bare_forward(proxy, request, raw):  # noqa: ANN001, ANN202
        workers = list(proxy.pool.workers.values())
        resp = await proxy.client.post(workers[next(_next) % len(workers)].endpoint(request.path), raw,
                                       {"Content-Type": "application/json"})
        return web.Response(body=await resp.read(), content_type="application/json")

    if "proxy" in _what:
        async def _handle(self, request, endpoint, body, raw=None, pre=None):  # noqa: ANN001, ANN202
            return await _bare_forward(self, request, raw)

        _px.Proxy.handle = _handle
    if "service" in _what:
        def _fast_path(app, fallback):  # noqa: ANN001, ANN202
            svc = app[_app.SERVICE]

            async def handle(request):  # noqa: ANN001, ANN202
                if request.method != "POST" or request.path not in _app.ENDPOINTS:
                    return await fallback(request)
                return await _bare_forward(svc.proxy, request, await request.read())

            return handle

        _app._fast_path = _fast_path
if "candidates" in _what:
    import numpy as np

    from balancer.candidates import Candidates
    from balancer.router import Router

    _zeros: dict[int, np.ndarray] = {}

    def _light(self, request, pool, depths, matches, spec_depths=None):  # noqa: ANN001, ANN202
        n = len(pool.replicas)
        z = _zeros.get(n)
        if z is None:
            z = _zeros[n] = np.zeros(n, dtype=np.int64)
        return Candidates(pool.role, pool.replicas, z, z, z, z, z, z, self.block_size)

    Router._candidates = _light
if "index" in _what:
    import numpy as np

    from balancer.prefix_index import PrefixIndex

    _empty = np.zeros(0, dtype=np.int64)
    PrefixIndex.match_depths = lambda self, block_hashes: _empty  # every match reads 0
    PrefixIndex.insert = lambda self, replica, block_hashes, now_s: None
if "load" in _what:
    from balancer.load import LoadTracker

    for _hook in ("on_dispatch", "on_prefill_done", "on_finished"):
        setattr(LoadTracker, _hook, lambda self, *a, **k: None)
