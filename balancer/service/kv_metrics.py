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
                "replay_failures", "restarts", "decode_errors", "dp_rank_mismatches",
                "translator_unknown_parent_blocks", "translator_extra_key_blocks")

    def __init__(self, subscriber: Any, delivery: Any = None) -> None:
        """``subscriber``: a ``KvEventSubscriber`` or ``KvEventSubscriberProcess`` (its ``stats()``);
        ``delivery``: its ``LoopDelivery`` (``pending``), or None."""
        self.subscriber = subscriber
        self.delivery = delivery

    def collect(self):  # noqa: ANN201
        queued = None if self.delivery is None else float(self.delivery.pending)
        yield from _kv_families([((), self.subscriber.stats(), queued)], ())


def _kv_families(sources, extra_labels: tuple[str, ...]):  # noqa: ANN001, ANN202
    """The ``pdlb_kv_events_*`` families of ``sources``: ``[(extra label values, stats by replica,
    queued events or None), ...]`` (one per router process; ``extra_labels`` name the values)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["worker", "dp_rank", *extra_labels]
    fams = {k: CounterMetricFamily(f"pdlb_kv_events_{k}", f"KV events: {k.replace('_', ' ')}", labels=labels)
            for k in KvEventsCollector.COUNTERS}
    stale = GaugeMetricFamily("pdlb_kv_events_stale", "1 if the DP rank published nothing for stale_after_s",
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
                fam.add_metric(lv, float(d[k]))
            stale.add_metric(lv, 1.0 if d["stale"] else 0.0)
            seq.add_metric(lv, float(d["last_seq"]))
            blocks.add_metric(lv, float(d["translator_engine_blocks"]))
        if queued is not None:
            q.add_metric(list(extra), queued)
            any_queue = True
    yield from fams.values()
    yield from (stale, seq, blocks)
    if any_queue:
        yield q


STATS_FILE_PREFIX = "kv-events-"
"""Several router processes: process ``i`` writes its subscriber's counters to
``<PROMETHEUS_MULTIPROC_DIR>/kv-events-<i>.json`` (:func:`write_stats_file`)."""


def write_stats_file(directory: str, index: int, subscriber: Any, delivery: Any = None) -> None:
    """Write process ``index``'s subscriber counters where :class:`KvEventsFilesCollector` reads
    them (replaced atomically: a reader never sees half a file)."""
    import json
    import os

    rows = [[rep.engine, rep.dp_rank, d] for rep, d in subscriber.stats().items()]
    data = {"stats": rows, "queued": None if delivery is None else delivery.pending}
    path = os.path.join(directory, f"{STATS_FILE_PREFIX}{index}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class KvEventsFilesCollector:
    """Several router processes (``pdlb serve --processes N``): every process runs its own
    subscriber of the same engines, so the ``pdlb_kv_events_*`` series carry a ``process`` label
    (the process's index) instead of being summed (N processes each receive every batch once:
    a sum would count each N times). Reads the files of :func:`write_stats_file` (each process
    rewrites its own every second, and the answering process just before the scrape)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self):  # noqa: ANN201
        import json
        import os

        sources = []
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
        if sources:
            yield from _kv_families(sources, ("process",))
