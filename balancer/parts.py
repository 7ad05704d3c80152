"""The protocols of the parts a :class:`~balancer.router.Router` is given at construction.

A router is built once with everything that feeds it or listens to it
(:meth:`~balancer.router.Router.from_config`'s ``load_sources``, ``listeners`` and ``learner``);
nothing is assigned to a built router. The parts:

**Load sources** (:class:`LoadSources`): where the in-flight load a policy sees comes from. Per DP
rank, a candidate's load (:class:`~balancer.candidates.Candidates`: requests, prefill tokens,
decode KV tokens) is the sum of three kinds:

=========  ==========================================================  =============================
kind       what                                                        fed by
=========  ==========================================================  =============================
own        this router's own decisions, counted at dispatch and        the router's hooks
           released on the progress hooks (:class:`~balancer.load.    (``route``, ``on_finished``,
           LoadTracker`)                                               ...)
peer       what other routers have in flight: the other processes of   a :class:`PeerLoad` (given at
           one ``pdlb serve`` (shared memory), routers on other hosts  construction), read before
           (a broker)                                                  each decision
external   what engines report beyond the routers' counts (other       :meth:`~balancer.router.Router.
           gateways' traffic)                                          on_load_report`
=========  ==========================================================  =============================

The counters of all three live in the own tracker's arrays (indexed by the tracker's slot of each
replica, so a decision gathers a pool's load in one vectorised read); a :class:`PeerLoad` is bound
to that tracker once (:meth:`PeerLoad.bind`) and writes its ``peer_*`` arrays. Several routers
given one ``own`` tracker share one load view (the simulator's bound for routers that share load
instantly).

**Route listeners** (:class:`RouteListener`): approximate and hybrid index modes call each, in the
order given, after a decision recorded a prompt on its replicas, e.g. to send the decision to other
router processes (:class:`balancer.service.processes.shared_prefix.PrefixShare`) or hosts
(:class:`balancer.service.broker_sync.BrokerSync`). **Reject listeners** (:class:`RejectListener`)
hear when an engine refused a routed prompt and the router forgot it, e.g. to retract it there.

**Cost learner** (:class:`CostLearnerPart`): refits the cost model cost-based policies read
(``ep_aware``: :attr:`balancer.policies.SelectContext.cost_model`) from the hooks' timings;
:class:`balancer.cost_model.CostLearner` is the one pdlb ships. ``RouterConfig.learn_cost_model``
turns it on or off; a router may be given another object with the same methods.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from balancer.candidates import Candidates
from balancer.cost_model import CostModel
from balancer.load import LoadTracker
from balancer.types import ReplicaId, Request

__all__ = ["CostLearnerPart", "LoadSources", "PeerLoad", "RejectListener", "RouteListener"]


@runtime_checkable
class PeerLoad(Protocol):
    """Keeps a tracker's ``peer_requests``, ``peer_prefill_tokens`` and ``peer_kv_tokens`` arrays
    (per tracker slot; counts, tokens) equal to what other routers have in flight.

    The router (its tracker) calls :meth:`bind` once at construction, :meth:`refresh` before each
    decision whose policies read load, and :meth:`publish` after each change of its own counts.
    Implementations: :class:`balancer.service.processes.shared_load.SharedLoad` (processes of one host),
    :class:`balancer.service.broker_sync.BrokerSync` (hosts; it wraps the former when both run).
    """

    def bind(self, tracker: LoadTracker) -> None:
        """Use ``tracker``: write its peer arrays, read its own counts (once, at construction).

        Raises:
            ValueError: bound to another tracker already.
        """

    def refresh(self, force: bool = False) -> Any:
        """Bring the tracker's peer arrays up to date (``force``: read afresh even if it was read
        moments ago, e.g. for a metrics scrape)."""

    def publish(self) -> None:
        """The tracker's own counts changed (share them with the other routers)."""


@runtime_checkable
class RouteListener(Protocol):
    """Called as ``listener(replicas, block_hashes, now_s)`` after a decision recorded a prompt:
    ``replicas`` the chosen DP ranks (prefill first when there is one), ``block_hashes`` the
    prompt's block hashes (never empty), ``now_s`` the decision's clock (seconds). Runs under the
    router's lock: it must not block (append to a buffer, send later)."""

    def __call__(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> None: ...


@runtime_checkable
class RejectListener(Protocol):
    """Called as ``listener(replicas, block_hashes, routed_at_s, forgotten)`` by
    :meth:`balancer.router.Router.on_rejected` after the router forgot a refused prompt: the
    decision as its route listeners got it (``replicas``, ``block_hashes``, ``routed_at_s``), and
    ``forgotten``, ``(replica, kept_blocks)`` for each replica that forgets the blocks after its
    first ``kept_blocks``. E.g. :meth:`balancer.service.processes.shared_prefix.PrefixShare.retract`
    sends it to the other router processes. Runs under the router's lock: it must not block."""

    def __call__(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], routed_at_s: float,
                 forgotten: tuple[tuple[ReplicaId, int], ...]) -> None: ...


@runtime_checkable
class CostLearnerPart(Protocol):
    """What a router feeds an online cost-model fit, and what it reads back.

    Attributes:
        model: the current :class:`~balancer.cost_model.CostModel`, handed to policies as
            ``SelectContext.cost_model`` at each decision.
    """

    model: CostModel

    def on_dispatch(self, request: Request, now_s: float, decode: Candidates, decode_pos: int,
                    prefill: Candidates | None, prefill_pos: int) -> None:
        """A request was routed: ``decode`` / ``prefill`` are the candidate snapshots the policies
        saw and ``*_pos`` the chosen positions (``prefill`` None: no separate prefill replica)."""

    def on_prefill_done(self, request_id: str, now_s: float) -> None:
        """The request's prefill finished (also called before :meth:`on_first_token`)."""

    def on_first_token(self, request_id: str, now_s: float) -> None:
        """The request's first output token exists."""

    def on_finished(self, request_id: str, now_s: float, num_output_tokens: int | None) -> None:
        """The request finished (``num_output_tokens``: ``None`` when unknown)."""

    def stats(self) -> dict[str, Any]:
        """Counters for ``Router.metrics()["cost_learning"]`` (plain numbers)."""


@dataclass(frozen=True)
class LoadSources:
    """The load sources a router reads (see the module docstring).

    Attributes:
        own: the tracker that counts this router's decisions; ``None``: a new one. Give one tracker
            to several routers for one shared load view.
        peer: what other routers have in flight (:class:`PeerLoad`), or ``None``; bound to the
            router's tracker at construction.

    Raises:
        ValueError: both given (bind the peer to the shared tracker's first router instead), or a
            ``peer`` without ``bind``/``refresh``/``publish``.
    """

    own: LoadTracker | None = None
    peer: PeerLoad | None = None

    def __post_init__(self) -> None:
        if self.own is not None and self.peer is not None:
            raise ValueError("LoadSources: give either a shared own tracker or a peer source, not both")
        if self.peer is not None and not isinstance(self.peer, PeerLoad):
            raise ValueError(f"LoadSources.peer must have bind, refresh and publish; got {type(self.peer).__name__}")

    def tracker(self) -> LoadTracker:
        """The own tracker: ``own``, or a new one bound to ``peer``."""
        if self.own is not None:
            return self.own
        return LoadTracker(peer=self.peer)
