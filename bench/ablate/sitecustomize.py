"""Bench-only switches for ``bench/router_scaling.py --phases ablate`` (never on a normal path):
this folder is put on ``PYTHONPATH`` of the ``pdlb serve`` it measures, so that the spawned
router processes import it too. ``PDLB_BENCH_ABLATE`` is a comma list of

* ``peer_refresh``: a decision does not read the other processes' load rows (``SharedLoad.refresh``
  only publishes this process's row), as a policy that reads no load would need;
* ``prefix_share``: no decision rings (``PrefixShare.publish`` and ``drain`` do nothing), as a
  pool whose policy reads no prefix index would need.

It measures what those costs are; it is not a fix (load-aware and prefix-aware policies need both).
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
