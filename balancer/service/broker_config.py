"""The ``broker:`` section of ``pdlb serve``'s config: routers on several hosts (issue 28).

Off by default (``url`` unset). With a NATS URL every router (every process of every
``pdlb serve`` that names the same broker and ``cluster``) publishes its in-flight load and, in
approximate mode, its routing decisions, and adds the others' to its own view
(:mod:`balancer.service.broker_sync` says how, and what staleness that gives).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["BrokerConfig", "MAX_MESSAGE_BYTES_LIMIT"]

MAX_MESSAGE_BYTES_LIMIT = 1024 * 1024
"""nats-server's default ``max_payload`` (1 MiB): a larger ``max_message_bytes`` could not be sent."""

_CLUSTER = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class BrokerConfig(BaseModel):
    """Several router hosts sharing state through a NATS broker.

    Attributes:
        url: NATS server URL(s), comma-separated (``nats://HOST:PORT``, ``tls://...``); ``None``:
            no broker (each router only knows its own load and decisions).
        cluster: the routers sharing state: subjects are ``pdlb.<cluster>.load`` and
            ``pdlb.<cluster>.routed`` (letters, digits, ``_``, ``-``; at most 64).
        publish_interval_s: how often a router publishes its load when it changed and sends its
            batch of decisions; the staleness bound is this plus the broker's delivery time.
        heartbeat_s: a router whose load did not change re-publishes it this often (a peer that
            joined or reconnected has everyone's load within this time).
        peer_ttl_s: a peer not heard for this long is dropped (its load no longer counts); must
            exceed ``heartbeat_s``.
        share_decisions: approximate index mode: publish routing decisions and record the
            others' (off: only load is shared).
        max_message_bytes: largest message sent or accepted (larger incoming ones are dropped
            and counted; outgoing decisions beyond it wait for the next interval, then drop).
        max_peers: most peers tracked at once (more are ignored and counted).
        max_decisions_per_message: most decisions one message may carry (sent or accepted).
        reconnect_wait_s: wait between connection attempts while the broker is unreachable.
        connect_timeout_s: one connection attempt's timeout.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    url: str | None = None
    cluster: str = "pdlb"
    publish_interval_s: float = Field(0.05, gt=0, le=10.0)
    heartbeat_s: float = Field(1.0, gt=0, le=60.0)
    peer_ttl_s: float = Field(3.0, gt=0, le=600.0)
    share_decisions: bool = True
    max_message_bytes: int = Field(256 * 1024, ge=4096, le=MAX_MESSAGE_BYTES_LIMIT)
    max_peers: int = Field(64, ge=1, le=4096)
    max_decisions_per_message: int = Field(4096, ge=1, le=1_000_000)
    reconnect_wait_s: float = Field(1.0, gt=0, le=60.0)
    connect_timeout_s: float = Field(2.0, gt=0, le=60.0)

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is None:
            return None
        urls = [u.strip() for u in v.split(",") if u.strip()]
        if not urls:
            raise ValueError("broker url is empty (give nats://HOST:PORT, or leave it unset for no broker)")
        for u in urls:
            scheme, sep, rest = u.partition("://")
            if not sep or scheme not in ("nats", "tls", "ws", "wss") or not rest:
                raise ValueError(f"broker url {u!r} is not nats://HOST:PORT (or tls://, ws://, wss://)")
        return ",".join(urls)

    @field_validator("cluster")
    @classmethod
    def _check_cluster(cls, v: str) -> str:
        if not _CLUSTER.match(v):
            raise ValueError(f"broker cluster {v!r}: use 1-64 letters, digits, '_' or '-'")
        return v

    @model_validator(mode="after")
    def _check_times(self) -> BrokerConfig:
        if self.peer_ttl_s <= self.heartbeat_s:
            raise ValueError(f"broker peer_ttl_s ({self.peer_ttl_s:g}) must exceed heartbeat_s ({self.heartbeat_s:g}), "
                             "or live peers would expire between heartbeats")
        if self.heartbeat_s < self.publish_interval_s:
            raise ValueError(f"broker heartbeat_s ({self.heartbeat_s:g}) must be at least publish_interval_s "
                             f"({self.publish_interval_s:g})")
        return self

    @property
    def enabled(self) -> bool:
        return self.url is not None

    @property
    def servers(self) -> list[str]:
        return [] if self.url is None else self.url.split(",")
