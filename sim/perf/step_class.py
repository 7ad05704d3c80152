"""Step-time model of a vLLM engine whose decode steps verify MTP drafts on every step, with an
optional separate efficiency for the steps that carry prefill.

:class:`StepClassPerf` wraps perf models (``PerfModel``: ``step_time_s(prefill_tokens,
prefill_attn_pairs, decode_seqs, decode_ctx_tokens)`` over ``(..., R)`` rank arrays, seconds):

* every decoding sequence computes ``verify_tokens_per_seq`` tokens in every step it takes part
  in, mixed steps included (vLLM schedules ``1 + num_speculative_tokens`` tokens per running
  request; :meth:`sim.perf.roofline.RooflinePerf.step_time_s`'s ``decode_tokens_per_seq``), and
  gains ``decode_tokens_per_step`` output tokens on average (the acceptance length; the engine
  applies it, :attr:`sim.run.engine.rank.Rank.decode_tokens_per_step`). This is the *per-step*
  accounting: a step record is a real forward (as vLLM's forward-pass metrics count them), unlike
  :class:`sim.perf.spec.SpecDecodePerf`'s mean-field time per token, which charges one token per
  step and does not speculate in mixed steps;
* decode-only steps are priced by ``decode``, steps in which any rank of the group prefills by
  ``prefill`` (default: ``decode``). Two models let a calibration give the memory-bound MTP
  decode batches and the compute-bound chunked prefills their own achieved fraction of peak
  (:mod:`sim.validation.agentx` fits one derating to each);
* optionally, a floor under the steps that carry prefill (``eager_floor_s``): an engine that
  captures CUDA graphs for uniform decode batches only (vLLM ``cudagraph_mode
  FULL_DECODE_ONLY``, compilation ``mode 0``) runs every step with a prefill chunk eagerly, and
  under data parallelism every rank of the group with it (vLLM ``coordinate_batch_across_dp``
  takes the minimum cudagraph mode over the DP ranks). An eager step cannot finish before the
  host has launched its kernels, so it lasts ``max(roofline, floor)``: the floor is the host's
  launch time, the roofline the GPU's work. ``eager_floor_s`` applies where some rank also
  decodes (the eager path then verifies MTP drafts and drafts again), ``eager_floor_no_decode_s``
  (default: ``eager_floor_s``) where no rank of the group decodes.

The drafter's forwards are not a separate term (their cost is inside the fitted efficiencies).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["MAX_EAGER_FLOOR_S", "StepClassPerf"]

#: longest eager-step floor accepted, s (a host that needs longer per step is not a serving engine)
MAX_EAGER_FLOOR_S = 10.0


class StepClassPerf:
    """Per-step MTP verification and per-class pricing (module docstring).

    Args:
        decode: the model of decode-only steps (its KV bytes, capacity and ``ep_synchronous``
            are this model's).
        prefill: the model of steps with prefill work on any rank; ``None``: ``decode``.
        verify_tokens_per_seq: tokens each decoding sequence computes per step (``1 + d``), >= 1.
        decode_tokens_per_step: output tokens a decoding sequence gains per step, in
            ``[1, verify_tokens_per_seq]`` (MTP acceptance length, e.g. 2.49).
        eager_floor_s: seconds, the shortest a step with prefill on any rank and decoding on
            some rank can last (module docstring); 0 (default): no floor.
        eager_floor_no_decode_s: seconds, the same for a step in which no rank decodes;
            ``None``: ``eager_floor_s``.

    Raises:
        ValueError: the token counts out of range, or a floor negative, not finite or over
            :data:`MAX_EAGER_FLOOR_S`.
    """

    def __init__(self, decode, prefill=None, *, verify_tokens_per_seq: int = 1,  # noqa: ANN001
                 decode_tokens_per_step: float = 1.0, eager_floor_s: float = 0.0,
                 eager_floor_no_decode_s: float | None = None) -> None:
        if int(verify_tokens_per_seq) != verify_tokens_per_seq or verify_tokens_per_seq < 1:
            raise ValueError(f"verify_tokens_per_seq must be an integer >= 1, got {verify_tokens_per_seq!r}")
        if not 1.0 <= float(decode_tokens_per_step) <= verify_tokens_per_seq:
            raise ValueError(f"decode_tokens_per_step must be in [1, {verify_tokens_per_seq}], "
                             f"got {decode_tokens_per_step!r}")
        floors = (eager_floor_s, eager_floor_s if eager_floor_no_decode_s is None else eager_floor_no_decode_s)
        for name, v in zip(("eager_floor_s", "eager_floor_no_decode_s"), floors):
            if not 0.0 <= float(v) <= MAX_EAGER_FLOOR_S:  # also refuses NaN
                raise ValueError(f"{name} must be in [0, {MAX_EAGER_FLOOR_S:g}] s, got {v!r}")
        self.eager_floor_s = float(floors[0])
        self.eager_floor_no_decode_s = float(floors[1])
        self.decode = decode
        self.prefill = prefill
        self.verify_tokens_per_seq = int(verify_tokens_per_seq)
        self.decode_tokens_per_step = float(decode_tokens_per_step)
        self.kv_bytes_per_token = decode.kv_bytes_per_token
        self.kv_capacity_tokens_per_rank = decode.kv_capacity_tokens_per_rank
        self.ep_synchronous = decode.ep_synchronous
        #: the step group passes each rank's cached prefix read by its chunks (exact, rather than
        #: the roofline's estimate from the attention pairs)
        self.wants_prefill_cached_tokens = True

    def __getattr__(self, name: str):  # noqa: ANN204 (model, hardware, ... of the decode model)
        if name == "decode":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.decode, name)

    def _time(self, model, pt, pp, ds, dc, cached) -> np.ndarray:  # noqa: ANN001
        kw = {}
        if self.verify_tokens_per_seq != 1:
            kw["decode_tokens_per_seq"] = float(self.verify_tokens_per_seq)
        if cached is not None:
            kw["prefill_cached_tokens"] = cached
        return np.asarray(model.step_time_s(pt, pp, ds, dc, **kw), dtype=np.float64)

    def step_time_s(self, prefill_tokens: ArrayLike, prefill_attn_pairs: ArrayLike, decode_seqs: ArrayLike,
                    decode_ctx_tokens: ArrayLike, *, prefill_cached_tokens: ArrayLike | None = None) -> np.ndarray:
        """Seconds per step for per-rank work of shape ``(..., R)`` (result ``(...)``): rows where
        any rank prefills are priced by ``prefill`` (at least the eager floor, if set), the
        others by ``decode``."""
        t = self._priced(prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens, prefill_cached_tokens)
        if not (self.eager_floor_s or self.eager_floor_no_decode_s):
            return t
        has_p = np.any(np.asarray(prefill_tokens, dtype=np.float64) > 0, axis=-1)
        if not np.any(has_p):
            return t
        has_d = np.any(np.asarray(decode_seqs, dtype=np.float64) > 0, axis=-1)
        floor = np.where(has_d, self.eager_floor_s, self.eager_floor_no_decode_s)
        return np.where(has_p, np.maximum(t, floor), t)

    def _priced(self, prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens,  # noqa: ANN001
                prefill_cached_tokens) -> np.ndarray:  # noqa: ANN001
        """:meth:`step_time_s` without the floor."""
        pt = np.asarray(prefill_tokens, dtype=np.float64)
        if self.prefill is None:
            return self._time(self.decode, pt, prefill_attn_pairs, decode_seqs, decode_ctx_tokens, prefill_cached_tokens)
        has_p = np.any(pt > 0, axis=-1)
        if np.all(has_p):
            return self._time(self.prefill, pt, prefill_attn_pairs, decode_seqs, decode_ctx_tokens, prefill_cached_tokens)
        td = self._time(self.decode, pt, prefill_attn_pairs, decode_seqs, decode_ctx_tokens, prefill_cached_tokens)
        if not np.any(has_p):
            return td
        tp = self._time(self.prefill, pt, prefill_attn_pairs, decode_seqs, decode_ctx_tokens, prefill_cached_tokens)
        return np.where(has_p, tp, td)

    def __repr__(self) -> str:
        floor = (f", eager floor={self.eager_floor_s:g}/{self.eager_floor_no_decode_s:g} s"
                 if self.eager_floor_s or self.eager_floor_no_decode_s else "")
        return (f"StepClassPerf(decode={self.decode!r}, prefill={self.prefill!r}, verify={self.verify_tokens_per_seq}, "
                f"tokens/step={self.decode_tokens_per_step:g}{floor})")
