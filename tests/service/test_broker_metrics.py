"""The ``pdlb_broker_*`` metrics summed over the processes of a host (issue 28, open item 3).

Two real processes, each with prometheus-client's multiprocess mode on (``PROMETHEUS_MULTIPROC_DIR``,
as ``pdlb serve --processes N`` sets it), copy known broker counters into
:class:`balancer.service.broker_metrics.BrokerMetrics`; a scrape of the directory (prometheus-client's
own ``MultiProcessCollector``, what any process answering ``/metrics`` uses) must report the sums of
the counters and the histogram, the least ``up`` and the largest peer gauges. Expected values: the two
processes' numbers, added or compared by hand below. Also one process without multiprocess mode: the
values are its own, and a second update adds only what the counters gained.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from balancer.service.broker_metrics import BrokerMetrics
from balancer.service.broker_sync import DELIVERY_BUCKETS_S

_CHILD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from prometheus_client import CollectorRegistry
    from balancer.service.broker_metrics import BrokerMetrics
    from balancer.service.broker_sync import DELIVERY_BUCKETS_S
    v = json.loads(sys.argv[1])
    table = SimpleNamespace(peers=[None] * v["peers"], dropped=v["table_dropped"], expired=v["expired"])
    sync = SimpleNamespace(up=v["up"], table=table, sent=v["sent"], received=v["received"], dropped=v["dropped"],
                           decisions=v["decisions"], disconnects=v["disconnects"], reconnects=v["reconnects"],
                           connect_errors=v["connect_errors"], peer_requests_total=lambda: v["peer_requests"],
                           peer_load_age_s=lambda: v["age_s"])
    m = BrokerMetrics(CollectorRegistry(), DELIVERY_BUCKETS_S)
    m.update(sync)
    for d in v["deliveries"]:
        m.observe_delivery(d)
""")


def _values(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdlb_broker_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _child(directory: str, values: dict) -> None:
    import json

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory}
    subprocess.run([sys.executable, "-c", _CHILD, json.dumps(values)], env=env, check=True, timeout=120)


def test_two_processes_sum_on_one_scrape(tmp_path):
    a = {"up": True, "peers": 2, "peer_requests": 7, "age_s": 0.4, "sent": {"load": 10, "routed": 3},
         "received": {"load": 20, "routed": 0}, "dropped": {"old": 1}, "table_dropped": {"old": 2, "own_group": 5},
         "decisions": {"sent": 30, "recorded": 0, "dropped": 1}, "disconnects": 1, "reconnects": 1,
         "connect_errors": 0, "expired": 1, "deliveries": [0.0004, 0.002]}
    b = {"up": False, "peers": 1, "peer_requests": 4, "age_s": 1.5, "sent": {"load": 6, "routed": 0},
         "received": {"load": 9, "routed": 2}, "dropped": {}, "table_dropped": {"malformed": 3},
         "decisions": {"sent": 0, "recorded": 4, "dropped": 0}, "disconnects": 2, "reconnects": 1,
         "connect_errors": 3, "expired": 0, "deliveries": [0.03]}
    for v in (a, b):
        _child(str(tmp_path), v)
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    got = _values(generate_latest(reg).decode())
    # counters: the sums (by hand)
    assert got['pdlb_broker_messages_total{direction="sent",kind="load"}'] == 16  # 10 + 6
    assert got['pdlb_broker_messages_total{direction="received",kind="load"}'] == 29  # 20 + 9
    assert got['pdlb_broker_messages_total{direction="received",kind="routed"}'] == 2
    assert got['pdlb_broker_dropped_total{reason="old"}'] == 3  # a: 1 + 2 (its table's), b: none
    assert got['pdlb_broker_dropped_total{reason="own_group"}'] == 5
    assert got['pdlb_broker_dropped_total{reason="malformed"}'] == 3
    assert got['pdlb_broker_decisions_total{kind="sent"}'] == 30
    assert got['pdlb_broker_decisions_total{kind="recorded"}'] == 4
    assert got["pdlb_broker_disconnects_total"] == 3 and got["pdlb_broker_reconnects_total"] == 2
    assert got["pdlb_broker_connect_errors_total"] == 3 and got["pdlb_broker_peers_expired_total"] == 1
    # the histogram: 3 deliveries, sum 0.0324 s; <= 0.0005: 1, <= 0.0025: 2, <= 0.05: 3
    assert got["pdlb_broker_delivery_seconds_count"] == 3
    assert abs(got["pdlb_broker_delivery_seconds_sum"] - 0.0324) < 1e-9
    assert got['pdlb_broker_delivery_seconds_bucket{le="0.0005"}'] == 1
    assert got['pdlb_broker_delivery_seconds_bucket{le="0.0025"}'] == 2
    assert got['pdlb_broker_delivery_seconds_bucket{le="0.05"}'] == 3
    # gauges: up the least (b is down), peers / in flight / age the largest
    assert got["pdlb_broker_up"] == 0
    assert got["pdlb_broker_peers"] == 2 and got["pdlb_broker_peer_in_flight_requests"] == 7
    assert got["pdlb_broker_peer_load_age_seconds"] == 1.5
    # one number per series: no process label
    assert not [k for k in got if "process=" in k]


def test_one_process_and_counter_steps():
    reg = CollectorRegistry()
    m = BrokerMetrics(reg, DELIVERY_BUCKETS_S)
    table = SimpleNamespace(peers=[1], dropped={}, expired=0)
    sync = SimpleNamespace(up=True, table=table, sent={"load": 5}, received={"load": 0}, dropped={},
                           decisions={"sent": 0}, disconnects=0, reconnects=0, connect_errors=0,
                           peer_requests_total=lambda: 3, peer_load_age_s=lambda: 0.1)
    m.update(sync)
    sync.sent["load"] = 8
    sync.up = False
    m.update(sync)
    m.update(sync)  # nothing gained: nothing added
    got = _values(generate_latest(reg).decode())
    assert got['pdlb_broker_messages_total{direction="sent",kind="load"}'] == 8
    assert got["pdlb_broker_up"] == 0 and got["pdlb_broker_peers"] == 1
