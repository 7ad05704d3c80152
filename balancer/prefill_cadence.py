"""vLLM's per-request chunk limit and prefill cadence in the prefill step count (for ``ep_aware``).

Two vLLM scheduler options change how long a prompt's prefill takes and what it costs the other
requests of a wide-EP engine (:class:`balancer.cost_model.EngineCost` fields
``request_chunk_tokens`` and ``prefill_schedule_interval``; AgentX point 440246 runs 512 and 8):

- **The per-request chunk limit** (``--long-prefill-token-threshold`` ``L``): one request computes at
  most ``L`` prompt tokens per step, so ``u`` uncached tokens need at least ``ceil(u / L)`` steps,
  not ``ceil(u / C)`` (``C`` the rank's step budget, ``chunk_tokens``). With ``q`` tokens queued
  ahead on the rank (FIFO, the budget shared), the prompt completes after::

      n = max(ceil((q + u) / C), ceil(u / L))      prefill steps         (prefill_steps)

  Where the rank also runs at most ``S = max_num_seqs`` requests and ``S L <= C`` (440246: 16 x 512
  = 8,192), the requests admitted with it can never fill the budget: the queue ahead takes no
  budget from the prompt, which then needs ``n = ceil(u / L)`` steps from its admission whatever
  ``q`` is (:func:`chunks_in_parallel`); what it waits for is a slot (a rank holding ``b >= S``
  requests: :func:`balancer.cost_model.slot_wait_s`) and its rank's open steps.

- **The prefill cadence** (``--prefill-schedule-interval`` ``k``, DP prefill balancing): a rank that
  is decoding prefills only on every ``k``-th step of its engine; between two of its prefill steps
  the engine runs ``k - 1`` decode steps, and the first open step comes on average ``(k - 1) / 2``
  steps after the prompt arrives::

      gap = (k - 1) (n - 1/2)    decode steps of the engine (0 on a rank with nothing running)
                                                                          (cadence_gap_steps)

  So a miss of ``u`` tokens on a mixed wide-EP engine takes ``n`` prefill steps plus ``gap`` decode
  steps, where the step budget alone gives ``ceil(u / C)`` steps: on 440246 a 126,000-token miss is
  247 prefill steps and 1,726 decode steps (about 90 s), not 16 steps.

- **Forced prefill** (the same option): a rank that has a request waiting for admission (all of
  its ``S = max_num_seqs`` slots taken) prefills on *every* step until the request is admitted,
  and every step in which any rank prefills is a mixed step for the whole EP group (on 440246
  about 160 ms against 31 ms decode-only). Placing a request on a rank that holds ``b >= S``
  requests makes it wait for a slot: the rank's queued prompts (``q`` tokens, at most ``L`` per
  request per step) then run on consecutive steps until a slot frees, and the request's own
  admission step is one more; a share ``1 - 1/k`` of those steps would not have carried prefill
  otherwise. Those extra mixed steps::

      forced = (1 - 1/k) (min(ceil(q / L'), wait_steps) + 1)   where b >= S, else 0
      wait_steps = (b + 1 - S) (out / tau) / S                           (forced_prefill_steps)

  (``L' = min(L, C)``; ``wait_steps``: the slot wait of :func:`balancer.cost_model.slot_wait_s`
  in steps; ``tau`` the output tokens a sequence gains per decode step, 1 without speculative
  decoding) each delay every running sequence of the group by a chunk's prefill seconds.

- **Who waits for a prompt's group tokens** (the same chunk limit, ``S L <= C``): on a wide-EP
  engine every step's all-to-all carries every rank's tokens, so a prompt's ``u`` tokens delay each
  request that prefills while it does, ``per_group_token`` seconds per token. Under FIFO draining
  at ``C`` tokens per step the prompt starts when its rank's queue is done, and only the requests
  still queued on the other ranks then wait for it (``ep_aware``'s ``N_after``, which is smaller
  behind a longer queue). With the chunks in parallel it starts at once, whatever its rank
  holds: the requests that wait are those of the engine with queued prefill, on every rank::

      N_q = sum over the engine's ranks of b_r [q_r > 0]                  (queued_requests)

  the same for every candidate rank of the engine. (The drain model's horizon, how far a prompt
  pushes its rank's queue past the slowest rank's, has no counterpart: the prompt's own
  ``ceil(u / L)`` steps do not depend on the queue either.) In AgentX 440246 runs the time to first
  token of a miss does not grow with its rank's queue (107-139 s per 100k prompt tokens for queues
  from 0 to over 600k tokens, where FIFO draining predicts 16 to 320 s: docs/policies/ep_aware.md).
  ``ep_aware`` prices it so with ``parallel_chunks=true`` (opt-in: over eight workload seeds there
  it met the SLO no more often than FIFO draining's terms).

Pure: arrays in, arrays out, float64, shapes ``(n,)`` (one entry per candidate rank); no clock, no
I/O. Source: vLLM's scheduler (``long_prefill_token_threshold`` caps ``num_new_tokens`` per
request; DP prefill balancing skips prefill on throttled steps unless requests wait), as the
simulator models it (:class:`sim.run.engine.step_group.StepGroup`); the step counts are pdlb's.
"""

from __future__ import annotations

import numpy as np

__all__ = ["at_once_tokens", "cadence_gap_steps", "chunks_in_parallel", "forced_prefill_steps", "prefill_steps", "queued_requests"]


def chunks_in_parallel(max_num_seqs: int | None, request_chunk_tokens: int | None, chunk_tokens: int) -> bool:
    """Whether every admitted request of a rank gets its whole per-request chunk on every step it
    prefills: ``max_num_seqs request_chunk_tokens <= chunk_tokens`` (both known). Then a queue
    ahead does not delay a prompt's chunks (module docstring). (vLLM's MTP verification tokens of
    the running sequences take ``verify`` tokens each of the budget, at most ``S verify <= S L``
    with the running sequences' slots not prefilling: the bound holds for ``L >= verify``.)"""
    if max_num_seqs is None or request_chunk_tokens is None:
        return False
    return max_num_seqs * request_chunk_tokens <= chunk_tokens


def prefill_steps(queued_tokens: np.ndarray, new_tokens: np.ndarray, chunk_tokens: int,
                  request_chunk_tokens: int | None) -> np.ndarray:
    """Prefill steps until a prompt of ``new_tokens`` uncached tokens completes behind
    ``queued_tokens`` on each rank: ``max(ceil((q + u) / C), ceil(u / L))`` (module docstring),
    shape ``(n,)``. ``request_chunk_tokens`` None: ``ceil((q + u) / C)``.

    Raises:
        ValueError: ``chunk_tokens`` or ``request_chunk_tokens`` < 1.
    """
    if chunk_tokens < 1 or (request_chunk_tokens is not None and request_chunk_tokens < 1):
        raise ValueError(f"chunk_tokens and request_chunk_tokens must be >= 1, got {chunk_tokens}, "
                         f"{request_chunk_tokens}")
    q = np.asarray(queued_tokens, dtype=np.float64)
    u = np.asarray(new_tokens, dtype=np.float64)
    steps = np.ceil((q + u) / float(chunk_tokens))
    if request_chunk_tokens is not None:
        np.maximum(steps, np.ceil(u / float(request_chunk_tokens)), out=steps)
    return steps


def cadence_gap_steps(steps: np.ndarray, num_requests: np.ndarray, interval: int) -> np.ndarray:
    """Decode steps of the engine that pass while a prompt of ``steps`` prefill steps waits for the
    rank's open steps: ``(k - 1) (steps - 1/2)`` on a rank with requests (``num_requests`` > 0),
    0 on an empty one (it prefills on every step) and for ``interval`` 1; shape ``(n,)``.

    Raises:
        ValueError: ``interval`` < 1.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    s = np.asarray(steps, dtype=np.float64)
    if interval == 1:
        return np.zeros(len(s))
    return np.where(np.asarray(num_requests) > 0, (interval - 1.0) * np.maximum(s - 0.5, 0.0), 0.0)


def forced_prefill_steps(queued_tokens: np.ndarray, num_requests: np.ndarray, max_num_seqs: int,
                         chunk_tokens: int, request_chunk_tokens: int | None, out_tokens: float,
                         interval: int, tokens_per_step: float = 1.0) -> np.ndarray:
    """Mixed steps the EP group runs in addition when the request is placed on each rank
    (module docstring, "Forced prefill"), shape ``(n,)``: 0 where the rank has a free slot
    (``num_requests < max_num_seqs``) or ``interval`` is 1. ``tokens_per_step``: output tokens a
    running sequence gains per decode step (speculative decoding's acceptance length; 1 = none).

    Raises:
        ValueError: ``max_num_seqs``, ``chunk_tokens``, ``request_chunk_tokens``, ``interval`` or
            ``tokens_per_step`` < 1, or ``out_tokens`` < 0.
    """
    if max_num_seqs < 1 or chunk_tokens < 1 or interval < 1 or (request_chunk_tokens is not None
                                                                and request_chunk_tokens < 1):
        raise ValueError("max_num_seqs, chunk_tokens, request_chunk_tokens and interval must be >= 1")
    if not out_tokens >= 0:
        raise ValueError(f"out_tokens must be >= 0, got {out_tokens}")
    if not tokens_per_step >= 1.0:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    b = np.asarray(num_requests, dtype=np.float64)
    if interval == 1:
        return np.zeros(len(b))
    limit = float(chunk_tokens if request_chunk_tokens is None else min(request_chunk_tokens, chunk_tokens))
    q = np.asarray(queued_tokens, dtype=np.float64)
    wait_steps = np.maximum(b + 1.0 - max_num_seqs, 0.0) * (float(out_tokens) / float(tokens_per_step) / max_num_seqs)
    steps = np.minimum(np.ceil(q / limit), wait_steps) + 1.0
    return np.where(b >= max_num_seqs, (1.0 - 1.0 / interval) * steps, 0.0)


def queued_requests(queued_tokens: np.ndarray, num_requests: np.ndarray, engine: np.ndarray,
                    ep_synchronous: bool) -> np.ndarray:
    """Per candidate rank, the requests that share prefill steps with a prompt placed there when
    chunks run in parallel (module docstring, "Who waits"): on a wide-EP engine
    (``ep_synchronous``) those of every rank of its engine that has queued prefill,
    ``sum_r b_r [q_r > 0]`` over the ranks ``r`` with ``engine[r] == engine[i]``; on a dense rank its
    own, ``b_i [q_i > 0]``. Float64, shape ``(n,)``.

    Args:
        queued_tokens: queued prefill tokens per rank ``q_r``, shape ``(n,)``.
        num_requests: requests per rank ``b_r``, shape ``(n,)``.
        engine: each rank's engine index (0-based, int), shape ``(n,)``.
        ep_synchronous: whether the engine's ranks step together (wide EP).

    Raises:
        ValueError: the shapes differ, or an engine index is negative.
    """
    q = np.asarray(queued_tokens, dtype=np.float64)
    b = np.asarray(num_requests, dtype=np.float64)
    e = np.asarray(engine, dtype=np.int64)
    if not (q.shape == b.shape == e.shape) or q.ndim != 1:
        raise ValueError(f"queued_tokens, num_requests and engine must have one shape (n,), got {q.shape}, "
                         f"{b.shape}, {e.shape}")
    busy = np.where(q > 0, b, 0.0)
    if not ep_synchronous or not len(e):
        return busy
    if e.min() < 0:
        raise ValueError("engine indices must be >= 0")
    return np.bincount(e, weights=busy, minlength=int(e.max()) + 1)[e]


def at_once_tokens(prompts_in_flight: np.ndarray, chunk_tokens: int, request_chunk_tokens: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the prefill tokens of one of its prefill steps where chunks run in parallel (each
    of its ``m`` prompts in prefill takes ``L`` tokens, at most ``C`` in all), now and with one
    prompt more: ``(min(C, L m), min(C, L (m + 1)))``, float64, shapes ``(n,)``. (A prompt's last
    chunk may be shorter: an upper bound.)

    Raises:
        ValueError: ``chunk_tokens`` or ``request_chunk_tokens`` < 1, or a negative count.
    """
    if chunk_tokens < 1 or request_chunk_tokens < 1:
        raise ValueError(f"chunk_tokens and request_chunk_tokens must be >= 1, got {chunk_tokens}, "
                         f"{request_chunk_tokens}")
    m = np.asarray(prompts_in_flight, dtype=np.float64)
    if len(m) and m.min() < 0:
        raise ValueError("prompts in flight must be >= 0")
    L = float(min(request_chunk_tokens, chunk_tokens))
    return np.minimum(L * m, float(chunk_tokens)), np.minimum(L * (m + 1.0), float(chunk_tokens))
