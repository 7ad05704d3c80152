"""Engine load reports from the engines' Prometheus metrics (``GET {worker}/metrics``).

Every ``interval_s`` each worker's ``/metrics`` is fetched and parsed (``prometheus_client``'s
text parser) into a :class:`~balancer.load.LoadReport` per DP rank, given to
:meth:`balancer.router.Router.on_load_report`. So several independent routers (or router
processes) in front of the same engines see the engines' whole load, not only their own share.

Metric names (the emulator, ``pdlb engine``, exposes the vLLM ones):

=================  ===============================  ==========================
report field       vLLM                             SGLang
=================  ===============================  ==========================
``num_running``    ``vllm:num_requests_running``    ``sglang:num_running_reqs``
``num_waiting``    ``vllm:num_requests_waiting``    ``sglang:num_queue_reqs``
``kv_usage``       ``vllm:kv_cache_usage_perc``     ``sglang:token_usage``
                   (older ``vllm:gpu_cache_usage_perc``)
=================  ===============================  ==========================

DP rank: a sample's ``dp_rank``, ``data_parallel_rank`` or ``engine`` label (an integer) names
it; samples without one are rank 0. Samples of the same rank (e.g. several ``model_name``
series) are summed (usage: the largest). A worker that does not answer, or answers without
any of these metrics, gets no report (its last one ages out after ``max_age_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from balancer.load import LoadReport
from balancer.router import Router
from balancer.types import ReplicaId

__all__ = ["RUNNING_METRICS", "WAITING_METRICS", "KV_USAGE_METRICS", "parse_load_metrics", "scrape_loop"]

log = logging.getLogger("pdlb.load_scraper")

RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_RANK_LABELS = ("dp_rank", "data_parallel_rank", "engine")


def _rank(labels: dict[str, str]) -> int:
    for k in _RANK_LABELS:
        v = labels.get(k)
        if v is not None and v.isdigit():
            return int(v)
    return 0


def parse_load_metrics(text: str) -> dict[int, LoadReport]:
    """``{dp_rank: LoadReport}`` from one Prometheus text exposition (see the module table);
    empty when none of the metrics is there.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    running: dict[int, float] = {}
    waiting: dict[int, float] = {}
    usage: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            name = sample.name
            if name in RUNNING_METRICS:
                target = running
            elif name in WAITING_METRICS:
                target = waiting
            elif name in KV_USAGE_METRICS:
                r = _rank(sample.labels)
                usage[r] = max(usage.get(r, 0.0), float(sample.value))
                continue
            else:
                continue
            r = _rank(sample.labels)
            target[r] = target.get(r, 0.0) + float(sample.value)
    out: dict[int, LoadReport] = {}
    for r in set(running) | set(waiting) | set(usage):
        u = usage.get(r)
        out[r] = LoadReport(max(0, int(running.get(r, 0))), max(0, int(waiting.get(r, 0))),
                            None if u is None else min(1.0, max(0.0, u)))
    return out


def _no_metrics(warned: set[str] | None, url: str, why: str) -> None:
    """An engine that answered but has no load metrics: one WARNING per engine until it has them."""
    if warned is not None and url not in warned:
        if len(warned) < 65_536:
            warned.add(url)
        log.warning("--scrape-load: %s %s; its load is not scraped (this router counts only its own in-flight "
                    "requests there). Said once per engine.", url, why)


async def scrape_once(session: aiohttp.ClientSession, router: Router, workers: list[tuple[str, int]],
                      timeout_s: float, clock: Callable[[], float] = time.monotonic,
                      warned: set[str] | None = None) -> int:
    """Scrape each ``(url, dp_size)`` once (concurrently) and feed the router; returns the number
    of reports given. ``warned``: engines already reported as having no load metrics (an engine
    that answers ``/metrics`` with an error status, or without any metric of the module table, is
    logged once at WARNING and added; one that has them again is logged at INFO and removed)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one(url: str, dp_size: int) -> int:
        try:
            async with session.get(url + "/metrics", timeout=timeout) as r:
                if r.status != 200:
                    _no_metrics(warned, url, f"answers GET /metrics with HTTP {r.status}")
                    return 0
                text = await r.text()
            reports = parse_load_metrics(text)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, UnicodeDecodeError) as e:
            log.debug("load scrape of %s failed: %s", url, e)
            return 0
        except ValueError:
            _no_metrics(warned, url, "answers GET /metrics with something that is not Prometheus text")
            return 0
        if not reports:
            _no_metrics(warned, url, "has none of the load metrics " + ", ".join(RUNNING_METRICS + WAITING_METRICS))
            return 0
        if warned is not None and url in warned:
            warned.discard(url)
            log.info("--scrape-load: %s has load metrics now", url)
        now = clock()
        n = 0
        for rank, rep in reports.items():
            if rank < dp_size:
                router.on_load_report(ReplicaId(url, rank), rep, now)
                n += 1
        return n

    return sum(await asyncio.gather(*(one(u, d) for u, d in workers)))


async def scrape_loop(session: aiohttp.ClientSession, router: Router, workers: Callable[[], list[tuple[str, int]]],
                      interval_s: float, timeout_s: float) -> None:
    """Scrape every ``interval_s`` until cancelled (``workers()`` is read each round)."""
    warned: set[str] = set()
    while True:
        try:
            await scrape_once(session, router, workers(), timeout_s, warned=warned)
        except Exception:  # never let the scraper die
            log.exception("load scrape round failed")
        await asyncio.sleep(interval_s)
