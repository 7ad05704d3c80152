"""The ``pdlb_broker_*`` metrics (:mod:`balancer.service.broker_sync`), summed over the processes of a host.

Each router process keeps its own broker counters (:class:`~balancer.service.broker_sync.BrokerSync`:
messages, drops, decisions, disconnects, delivery times). :class:`BrokerMetrics` copies them into
prometheus-client metrics of the app's registry every :data:`REFRESH_S` (and its delivery
histogram at each message), so that with ``pdlb serve --processes N`` (prometheus-client's
multiprocess mode, as every other ``pdlb_*`` series) a scrape answered by any one process reports
the host:

* counters and the histogram (``pdlb_broker_messages_total{direction,kind}``,
  ``pdlb_broker_dropped_total{reason}``, ``pdlb_broker_decisions_total{kind}``,
  ``pdlb_broker_disconnects_total``, ``pdlb_broker_reconnects_total``,
  ``pdlb_broker_connect_errors_total``, ``pdlb_broker_peers_expired_total``,
  ``pdlb_broker_delivery_seconds``): the sum over the host's processes (a replaced process's counts
  stay in the sum, as for the other counters);
* ``pdlb_broker_up``: the least over the live processes (1 only while every process is connected);
* ``pdlb_broker_peers``, ``pdlb_broker_peer_in_flight_requests`` (summed over the peers' ranks: a PD
  request counts on its prefill and its decode rank) and ``pdlb_broker_peer_load_age_seconds``: the
  largest over the live processes (every process of a host hears the same peers; a sum would count
  them once per process).

No ``process`` label: a scrape is one number per series for the host, at most :data:`REFRESH_S`
behind each process's own counters. With one process the values are that process's.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["REFRESH_S", "BrokerMetrics"]

#: Seconds between copies of a process's broker counters into its metrics.
REFRESH_S = 0.25


class BrokerMetrics:
    """The ``pdlb_broker_*`` series in ``registry`` (the module docstring says how they combine).

    Args:
        registry: the app's registry (:attr:`balancer.service.metrics.ServiceMetrics.registry`).
        buckets_s: the delivery histogram's bucket bounds, seconds.
    """

    def __init__(self, registry: Any, buckets_s: tuple[float, ...]) -> None:
        r = registry
        self.up = Gauge("pdlb_broker_up", "1 while every router process of this host is connected to the broker "
                        "(the least over the processes)", registry=r, multiprocess_mode="livemin")
        self.peers = Gauge("pdlb_broker_peers", "Other routers whose load snapshot is live (heard within "
                           "peer_ttl_s; the most any process of this host hears)", registry=r,
                           multiprocess_mode="livemax")
        self.peer_in_flight = Gauge("pdlb_broker_peer_in_flight_requests", "Requests the live peers report in "
                                    "flight, summed over ranks (a PD request counts on its prefill and its decode "
                                    "rank)", registry=r, multiprocess_mode="livemax")
        self.peer_age = Gauge("pdlb_broker_peer_load_age_seconds", "Age of the oldest live peer's load snapshot "
                              "(send time to now, wall clocks)", registry=r, multiprocess_mode="livemax")
        self.messages = Counter("pdlb_broker_messages", "Broker messages by direction and kind",
                                ["direction", "kind"], registry=r)
        self.dropped = Counter("pdlb_broker_dropped", "Broker messages dropped, by reason", ["reason"], registry=r)
        self.decisions = Counter("pdlb_broker_decisions", "Approximate mode: routing decisions sent, recorded from "
                                 "peers, or dropped", ["kind"], registry=r)
        self.disconnects = Counter("pdlb_broker_disconnects", "Times the broker connection was lost", registry=r)
        self.reconnects = Counter("pdlb_broker_reconnects", "Times the broker connection came back", registry=r)
        self.connect_errors = Counter("pdlb_broker_connect_errors", "Failed connection attempts and connection "
                                      "errors", registry=r)
        self.peers_expired = Counter("pdlb_broker_peers_expired", "Peers dropped after peer_ttl_s without a message",
                                     registry=r)
        self.delivery = Histogram("pdlb_broker_delivery_seconds", "Publish-to-receipt time of peers' messages "
                                  "(wall clocks; meaningful when the hosts' clocks agree)", buckets=buckets_s,
                                  registry=r)
        self._seen: dict[tuple[str, ...], float] = {}

    def observe_delivery(self, delay_s: float) -> None:
        """One peer message's publish-to-receipt time (``BrokerSync.on_delivery``)."""
        self.delivery.observe(delay_s)

    def _add(self, key: tuple[str, ...], value: float, child: Any) -> None:
        step = value - self._seen.get(key, 0.0)
        if step > 0:
            child.inc(step)
        self._seen[key] = value

    def update(self, sync: Any) -> None:
        """Copy ``sync``'s (:class:`~balancer.service.broker_sync.BrokerSync`) counters and gauges
        into the metrics (counters by what they gained since the last call)."""
        self.up.set(1 if sync.up else 0)
        self.peers.set(len(sync.table.peers))
        self.peer_in_flight.set(sync.peer_requests_total())
        self.peer_age.set(sync.peer_load_age_s())
        for kind, n in sync.sent.items():
            self._add(("sent", kind), n, self.messages.labels("sent", kind))
        for kind, n in sync.received.items():
            self._add(("received", kind), n, self.messages.labels("received", kind))
        dropped = dict(sync.table.dropped)
        for reason, n in sync.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
        for reason, n in dropped.items():
            self._add(("dropped", reason), n, self.dropped.labels(reason))
        for kind, n in sync.decisions.items():
            self._add(("decisions", kind), n, self.decisions.labels(kind))
        self._add(("disconnects",), sync.disconnects, self.disconnects)
        self._add(("reconnects",), sync.reconnects, self.reconnects)
        self._add(("connect_errors",), sync.connect_errors, self.connect_errors)
        self._add(("peers_expired",), sync.table.expired, self.peers_expired)
