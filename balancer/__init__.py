"""pdlb's routing library: pick a prefill and a decode DP rank per request (no I/O, time passed in).

The names a gateway embedding the router needs::

    from balancer import Router, RouterConfig, Request, ReplicaId, Role, hash_token_blocks

    router = Router.from_config(RouterConfig(prefill_policy="cache_aware", decode_policy="least_load", block_size=64))
    router.add_replica(ReplicaId("http://10.0.0.1:8000", 0), Role.MIXED)
    route = router.route(Request("r1", now, len(ids), tuple(hash_token_blocks(ids, 64))), now)

``Router.from_config(config, load_sources=LoadSources(...), listeners=[...])`` shares load
between routers (:mod:`balancer.parts`). See :mod:`balancer.router` for the life of a request, :mod:`balancer.kv_wire` /
:mod:`balancer.kv_translate` for engine KV events, :mod:`balancer.service` for ``pdlb serve``.
"""

from balancer.hashing import ROOT_HASH, chain_block_ids, hash_token_blocks, text_chunk_hashes
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from balancer.kv_translate import KvEventTranslator, chain_root
from balancer.kv_wire import EngineBatch, KvWireError, decode_batch, decode_seq
from balancer.load import LoadReport
from balancer.parts import LoadSources
from balancer.policies import Policy, available_policies, make_policy
from balancer.config import INDEX_MODES, PolicySpec, RouterConfig
from balancer.router import NoReplicaError, PolicyError, ReplicaInfo, RequestTooLargeError, Router
from balancer.types import Choice, ReplicaId, ReplicaView, Request, Role, Route, TtftSlo

__all__ = [
    "INDEX_MODES", "ROOT_HASH", "AllBlocksCleared", "BlockRemoved", "BlockStored", "Choice", "EngineBatch", "KvEvent",
    "KvEventTranslator", "KvWireError", "LoadReport", "LoadSources", "NoReplicaError", "Policy", "PolicyError", "ReplicaId",
    "PolicySpec", "ReplicaInfo", "ReplicaView", "Request", "RequestTooLargeError", "Role", "Route", "Router", "RouterConfig", "TtftSlo", "available_policies", "chain_block_ids", "chain_root",
    "decode_batch", "decode_seq", "hash_token_blocks", "make_policy", "text_chunk_hashes",
]
