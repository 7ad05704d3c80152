#!/usr/bin/env python3
"""Run ``transformers serve`` (continuous batching) and log every engine step to a JSONL file.

Used by ``bench/gpu_engine_run.py`` on the GPU host; imports nothing from pdlb. It patches three
methods of transformers' continuous-batching engine (checked against transformers 5.17.0) and
then hands its arguments to the ``transformers`` CLI unchanged::

    PDLB_STEP_LOG=/tmp/steps.jsonl python bench/tf_engine_steps.py serve MODEL_DIR --continuous-batching ...

What is logged (one JSON object per line, times from ``time.time()`` so that they line up with
the client's clock on the same host):

* ``{"kind": "config", ...}`` once, when the batch processor is built: the engine's resolved
  ``num_blocks``, ``block_size``, ``max_batch_tokens``, ``max_requests_per_batch``, scheduler,
  async batching and CUDA-graph choices;
* ``{"kind": "step", "t0": s, "t1": s, "q": [...], "kv": [...]}`` per forward step: ``t0`` when
  the loop body started preparing the batch, ``t1`` when it finished (after the batch update,
  i.e. when the step's tokens were handed to the output router); ``q[i]`` / ``kv[i]`` the query
  tokens and the KV tokens already cached (``position_offset``) of each scheduled request, as the
  scheduler chose them (``FutureRequestState.query_length``; a decode request has ``q = 1``);
  ``fast``: whether the scheduler chose the decode fast path (block-table attention).

``t1`` of a step minus ``t0`` is its wall time; while the engine is busy the next ``t0`` follows
within microseconds, so consecutive ``t0`` differences are the engine's cycle time, the number a
simulator's step time stands for (GPU time plus the engine's own CPU work per step).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def install(path: str) -> None:
    """Patch the continuous-batching engine so that it appends its steps to ``path``."""
    from transformers.generation.continuous_batching import continuous_api, scheduler

    lock = threading.Lock()
    fh = open(path, "a", buffering=1)
    last: dict = {}

    def write(obj: dict) -> None:
        with lock:
            fh.write(json.dumps(obj, separators=(",", ":")) + "\n")

    orig_schedule = scheduler.Scheduler._process_candidates

    def process_candidates(self, *args, **kwargs):
        out = orig_schedule(self, *args, **kwargs)
        scheduled = out[0]
        last["q"] = [int(fs.query_length) for fs in scheduled]
        # position_offset was advanced by a prefix match but not yet by this step's tokens
        last["kv"] = [int(fs.state.position_offset) for fs in scheduled]
        last["fast"] = bool(out[2])
        return out

    scheduler.Scheduler._process_candidates = process_candidates

    orig_body = continuous_api.ContinuousBatchingManager._generation_loop_body

    def loop_body(self, batch_processor, bootstrapping):
        before = getattr(self, "current_batch", 0)
        last.pop("q", None)
        t0 = time.time()
        out = orig_body(self, batch_processor, bootstrapping)
        if getattr(self, "current_batch", 0) != before and "q" in last:
            write({"kind": "step", "t0": t0, "t1": time.time(), "q": last["q"], "kv": last["kv"],
                   "fast": last.get("fast", False)})
        return out

    continuous_api.ContinuousBatchingManager._generation_loop_body = loop_body

    orig_create = continuous_api.ContinuousBatchingManager._create_batch_processor

    def create(self):
        bp = orig_create(self)
        cfg = self.continuous_batching_config
        write({"kind": "config", "t": time.time(), "num_blocks": int(bp.cache.num_blocks),
               "block_size": int(bp.cache.block_size), "max_batch_tokens": int(bp.max_batch_tokens),
               "max_requests_per_batch": int(cfg.max_requests_per_batch or 0),
               "scheduler": str(cfg.scheduler_type), "async": bool(getattr(bp, "use_async_batching", False)),
               "cuda_graph": str(getattr(cfg, "use_cuda_graph", None)),
               "prefix_sharing": bool(bp.cache.use_prefix_sharing), "attn": str(self.model.config._attn_implementation)})
        return bp

    continuous_api.ContinuousBatchingManager._create_batch_processor = create


def main() -> None:
    path = os.environ.get("PDLB_STEP_LOG")
    if not path:
        sys.exit("error: set PDLB_STEP_LOG to the JSONL file the steps go to")
    install(path)
    from transformers.cli.transformers import app

    sys.argv[0] = "transformers"
    app()


if __name__ == "__main__":
    main()
