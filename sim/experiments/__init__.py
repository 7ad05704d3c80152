"""Reproducible experiments behind the numbers in ``docs/`` (one command each).

* :mod:`sim.experiments.store_hit_rate` - experiment 1 of ``docs/kv_cache.md``: the prefix hit
  rate of a shared KV store vs its TTL and capacity, per traffic class (``pdlb sim store-sweep``).
"""
