"""Prometheus export of the KV-event subscriber's counters (``pdlb_kv_events_*``), without
importing ZMQ (a router with several processes reads its processes' counters from files even when
it subscribes to no engine).

Subscribers: :mod:`balancer.service.kv_subscriber`.
"""

from __future__ import annotations

from typing import Any

from balancer.types import ReplicaId

__all__ = ["KvEventsCollector", "KvEventsFilesCollector", "STATS_FILE_PREFIX", "write_stats_file"]


class KvEventsCollector:
    """Prometheus collector of a subscriber's per-DP-rank counters (``pdlb_kv_events_*``)."""

    COUNTERS = ("batches", "events", "pdlb_events", "duplicates", "gaps", "gaps_unrecovered", "replays",
                "replay_failures", "restarts", "decode_errors", "refused_batches", "held_dropped", "disconnects",
                "dp_rank_mismatches", "translator_unknown_parent_blocks", "translator_extra_key_blocks",
                "translator_skipped_group_events", "translator_valid_ends", "translator_invalidated_ends")

    def __init__(self, subscriber: Any, delivery: Any = None) -> None:
        """``subscriber``: the one-process service's ``SupervisedSubscriber`` (``stats()``,
        ``alive()``, ``restarts``); ``delivery``: its ``LoopDelivery`` (``pending``), or None."""
        self.subscriber = subscriber
        self.delivery = delivery

    def collect(self):  # noqa: ANN201
        queued = None if self.delivery is None else float(self.delivery.pending)
        yield from _kv_families([((), self.subscriber.stats(), queued)], ())
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        # the supervisor's own state
        up = GaugeMetricFamily("pdlb_kv_events_subscriber_up",
                               "1 while the KV event subscriber runs (0: dead, being started again)")
        up.add_metric([], 1.0 if self.subscriber.alive() else 0.0)
        restarts = CounterMetricFamily("pdlb_kv_events_subscriber_restarts",
                                       "Times the KV event subscriber died and was started again")
        restarts.add_metric([], float(self.subscriber.restarts))
        yield up
        yield restarts


def _kv_families(sources, extra_labels: tuple[str, ...]):  # noqa: ANN001, ANN202
    """The ``pdlb_kv_events_*`` families of ``sources``: ``[(extra label values, stats by replica,
    queued events or None), ...]`` (one per router process; ``extra_labels`` name the values)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["worker", "dp_rank", *extra_labels]
    fams = {k: CounterMetricFamily(f"pdlb_kv_events_{k}", f"KV events: {k.replace('_', ' ')}", labels=labels)
            for k in KvEventsCollector.COUNTERS}
    stale = GaugeMetricFamily("pdlb_kv_events_stale", "1 if the DP rank published nothing for stale_after_s, "
                              "or a batch of it was refused and none applied in sequence since", labels=labels)
    inconsistent = GaugeMetricFamily("pdlb_kv_events_inconsistent", "1 if a batch of the DP rank was refused (bad "
                                     "timestamp or sequence number) and none applied in sequence since", labels=labels)
    replaying = GaugeMetricFamily("pdlb_kv_events_replaying", "1 while a replay of the DP rank runs or waits",
                                  labels=labels)
    seq = GaugeMetricFamily("pdlb_kv_events_last_seq", "Last applied batch sequence number", labels=labels)
    blocks = GaugeMetricFamily("pdlb_kv_events_translator_blocks", "Engine blocks remembered for hash translation",
                               labels=labels)
    q = GaugeMetricFamily("pdlb_kv_events_queued", "Translated KV events waiting for the event loop",
                          labels=list(extra_labels))
    any_queue = False
    for extra, stats, queued in sources:
        for rep, d in stats.items():
            lv = [rep.engine, str(rep.dp_rank), *extra]
            for k, fam in fams.items():
                fam.add_metric(lv, float(d.get(k, 0)))
            stale.add_metric(lv, 1.0 if d["stale"] else 0.0)
            inconsistent.add_metric(lv, 1.0 if d.get("inconsistent") else 0.0)
            replaying.add_metric(lv, 1.0 if d.get("replaying") else 0.0)
            seq.add_metric(lv, float(d["last_seq"]))
            blocks.add_metric(lv, float(d["translator_engine_blocks"]))
        if queued is not None:
            q.add_metric(list(extra), queued)
            any_queue = True
    yield from fams.values()
    yield from (stale, inconsistent, replaying, seq, blocks)
    if any_queue:
        yield q


STATS_FILE_PREFIX = "kv-events-"
"""Several router processes: process ``i`` writes its subscriber's counters to
``<PROMETHEUS_MULTIPROC_DIR>/kv-events-<i>.json`` (:func:`write_stats_file`)."""


def write_stats_file(directory: str, index: int, subscriber: Any, delivery: Any = None,
                     fanout: dict[str, int] | None = None) -> None:
    """Write process ``index``'s subscriber counters where :class:`KvEventsFilesCollector` reads
    them (replaced atomically: a reader never sees half a file); ``fanout``: this process's
    fan-out counters (``KvFanout.fanout_stats()``) when the feed is a fan-out, else ``None``."""
    import json
    import os

    rows = [[rep.engine, rep.dp_rank, d] for rep, d in subscriber.stats().items()]
    data: dict[str, Any] = {"stats": rows, "queued": None if delivery is None else delivery.pending}
    if fanout is not None:  # balancer.service.processes.kv_fanout.KvFanout: this process's reader of the ring
        data["fanout"] = fanout
        data["queued"] = None
    path = os.path.join(directory, f"{STATS_FILE_PREFIX}{index}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


FANOUT_COUNTERS = ("applied", "apply_errors", "records", "lost_records", "lost_bytes", "corrupt_records", "laps",
                   "resyncs", "snapshot_records")
"""Per-process counters of the KV fan-out ring's reader (:class:`balancer.service.processes.kv_fanout.FanoutFollower`)."""


class KvEventsFilesCollector:
    """Several router processes (``pdlb serve --processes N``): one subscriber, in process 0,
    decodes and translates every engine batch once and fans the result out to every process
    (:mod:`balancer.service.processes.kv_fanout`). Its ``pdlb_kv_events_*`` series (batches, gaps, replays,
    stale, ...) count each batch once and carry ``process="0"``, the process that runs it; every
    process exports ``pdlb_kv_events_fanout_*{process}``: pdlb events applied to its own index,
    ring records read, lost (lapped) and corrupt, laps, resync snapshots asked for and their
    records applied, its lag in bytes (and process 0 its subscriber's restarts and its ring
    writer's resync mirror: ``pdlb_kv_events_fanout_mirror_blocks``,
    ``..._mirror_evicted_total``, ``..._snapshots_written_total``). Reads the files of :func:`write_stats_file` (each process rewrites its own every
    second, and the answering process just before the scrape)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self):  # noqa: ANN201
        import json
        import os

        sources = []
        fanouts = []
        try:
            names = sorted(n for n in os.listdir(self.directory)
                           if n.startswith(STATS_FILE_PREFIX) and n.endswith(".json"))
        except OSError:
            names = []
        for name in names:
            index = name[len(STATS_FILE_PREFIX):-len(".json")]
            try:
                with open(os.path.join(self.directory, name)) as f:
                    data = json.load(f)
                stats = {ReplicaId(str(e), int(r)): d for e, r, d in data["stats"]}
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a process that is just starting or stopping
            q = data.get("queued")
            sources.append(((index,), stats, None if q is None else float(q)))
            if isinstance(data.get("fanout"), dict):
                fanouts.append((index, data["fanout"]))
        if sources:
            yield from _kv_families(sources, ("process",))
        if fanouts:
            yield from _fanout_families(fanouts)


def _fanout_families(fanouts: list[tuple[str, dict]]):  # noqa: ANN202
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fams = {k: CounterMetricFamily(f"pdlb_kv_events_fanout_{k}", f"KV fan-out ring reader: {k.replace('_', ' ')}",
                                   labels=["process"]) for k in FANOUT_COUNTERS}
    lag = GaugeMetricFamily("pdlb_kv_events_fanout_lag_bytes", "Fan-out ring bytes written and not yet applied",
                            labels=["process"])
    restarts = CounterMetricFamily("pdlb_kv_events_fanout_subscriber_restarts",
                                   "Times the one KV event subscriber died and was started again",
                                   labels=["process"])
    evicted = CounterMetricFamily("pdlb_kv_events_fanout_mirror_evicted",
                                  "Blocks the ring writer's resync mirror dropped at its bound (a reader "
                                  "resynced afterwards misses them)", labels=["process"])
    mirror = GaugeMetricFamily("pdlb_kv_events_fanout_mirror_blocks",
                               "Blocks held by the ring writer's resync mirror", labels=["process"])
    snapshots = CounterMetricFamily("pdlb_kv_events_fanout_snapshots_written",
                                    "Resync snapshots the ring writer wrote", labels=["process"])
    up = GaugeMetricFamily("pdlb_kv_events_subscriber_up",
                           "1 while the KV event subscriber runs (0: dead, being started again)", labels=["process"])
    any_restarts = any_writer = False
    for index, d in fanouts:
        for k, fam in fams.items():
            fam.add_metric([index], float(d.get(k, 0)))
        lag.add_metric([index], float(d.get("lag_bytes", 0)))
        if "subscriber_restarts" in d:
            restarts.add_metric([index], float(d["subscriber_restarts"]))
            up.add_metric([index], float(d.get("subscriber_up", 1)))
            any_restarts = True
        if "mirror_blocks" in d:
            evicted.add_metric([index], float(d.get("mirror_evicted", 0)))
            mirror.add_metric([index], float(d["mirror_blocks"]))
            snapshots.add_metric([index], float(d.get("snapshots_written", 0)))
            any_writer = True
    yield from fams.values()
    yield lag
    if any_restarts:
        yield restarts
        yield up
    if any_writer:
        yield from (evicted, mirror, snapshots)
