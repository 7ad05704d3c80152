"""Measured-table step-latency model: interpolates a GPU profile written by ``bench/gpu_profile.py``.

The profile (``sim/data/profiles/<gpu>_<model>_bf16.csv``; columns
``kind,prefill_tokens,cached_tokens,batch,ctx_tokens,time_s``) holds GPU times of one forward step
of a dense model on one GPU:

* ``prefill`` rows: one sequence of ``n = prefill_tokens`` new tokens after ``p = cached_tokens``
  cached ones (``p = 0`` for n = 16 .. 32768; ``p`` in {2048, 8192, 32768} for n in
  {128, 512, 2048, 8192} on the shipped H200 profile);
* ``decode`` rows: ``b = batch`` sequences, each attending to ``ctx_tokens`` KV tokens, so the
  step's total context is ``C = b * ctx_tokens``.

How a step is priced (``T`` prefill tokens, ``P`` attention pairs, ``B`` decode sequences, ``C``
decode context tokens, all per rank):

**Prefill**: ``t_pf(T, P) = L(T) + alpha(T) * P``. Attention time is linear in the (query, key)
pairs (the shipped H200 data: extra time per prefix token is flat in ``p`` within +-15% at each
``n``, about 1.5-1.7 ns per pair). ``alpha(n)`` is the least-squares slope of
``t(n, p) - t(n, 0)`` against ``n * p`` over the cached-prefix rows of each ``n``; between those
``n`` it is interpolated linearly in ``log n``, outside them held at the end value. ``L(n) =
t(n, 0) - alpha(n) * n (n + 1) / 2`` is the non-attention time at each ``p = 0`` row; ``L`` is
interpolated piecewise-linearly in ``T`` and extrapolated linearly from the last two rows at either
end (beyond 32768 tokens, and below 16). Using the pairs rather than the tokens alone prices a chunk
of several short sequences (fewer pairs than one long sequence of the same length) and a chunk after
a cached prefix from the same table. ``P`` is clipped below at ``T`` (every token attends to
itself). Caveat: no row has fewer than 128 new tokens after a prefix; below that ``alpha(128)``
is used, which is optimistic for FlashAttention-2 (its 128-row query tiles make a 16-token chunk
after a long prefix cost nearly as much attention as a 128-token one).

**Decode**: ``t_dec(B, C)``: for each measured batch size the rows are piecewise linear in ``C``
(extrapolated linearly from the row's two end points, so a row's KV limit -- 524,288 tokens on the
shipped profile, 68.7 GB -- is not a ceiling); between batch sizes linear in ``B``; beyond the
largest (or below the smallest) batch linear from the two outermost rows, evaluated at the same
``C``. Measured rows have equal context per sequence; a ragged batch is priced by its total.

**Mixed steps** (chunked prefill next to decode, aggregated engines; not measured):
``t_dec(B, C) + L(T + B) - L(B) + alpha(T) * P`` -- the decode step plus the extra linear-layer
work of ``T`` more tokens in the same GEMMs and the chunk's attention. Pure prefill and pure decode
reduce to the rows above.

``step_time_s`` evaluates each rank independently and returns the max over the rank axis (a dense
engine is called with ``R = 1``; ``ep_synchronous`` is False); leading axes broadcast. Times are
GPU time only: CUDA-graph replays with no scheduler, sampling or launch gaps. ``step_overhead_s``
(default 0) adds a constant per step for those.

``kv_bytes_per_token`` comes from the model spec and ``kv_capacity_tokens_per_rank`` from the
same memory budget as the roofline: ``hbm * kv_cache_fraction - weights - activation reserve``
over the bytes per token (one GPU per rank).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from sim.models.hardware import HardwareSpec, get_hardware
from sim.models.presets import ModelSpec, get_model
from sim.perf.roofline import DEFAULT_ACTIVATION_RESERVE_BYTES, DEFAULT_KV_CACHE_FRACTION

PROFILE_DIR = Path(__file__).resolve().parent.parent / "data" / "profiles"
COLUMNS = ("kind", "prefill_tokens", "cached_tokens", "batch", "ctx_tokens", "time_s")


@dataclass(frozen=True)
class ProfileRow:
    kind: str
    prefill_tokens: int
    cached_tokens: int
    batch: int
    ctx_tokens: int
    time_s: float


def profile_path(model: ModelSpec | str, hardware: HardwareSpec | str, dtype: str = "bf16") -> Path:
    """Where the shipped profile of ``model`` on ``hardware`` lives (it may not exist)."""
    m, hw = get_model(model), get_hardware(hardware)
    return PROFILE_DIR / f"{hw.name.lower()}_{m.name}_{dtype}.csv"


def read_profile(path: str | Path) -> tuple[list[ProfileRow], list[str]]:
    """Rows and ``#`` header lines of a profile CSV; checks the columns and values."""
    rows: list[ProfileRow] = []
    header: list[str] = []
    with open(path, newline="") as f:
        lines = []
        for line in f:
            if line.startswith("#"):
                header.append(line[1:].strip())
            elif line.strip():
                lines.append(line)
    reader = csv.DictReader(lines)
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise ValueError(f"{path}: columns {reader.fieldnames}, expected {','.join(COLUMNS)}")
    for rec in reader:
        row = ProfileRow(rec["kind"], int(rec["prefill_tokens"]), int(rec["cached_tokens"]), int(rec["batch"]),
                         int(rec["ctx_tokens"]), float(rec["time_s"]))
        if row.kind not in ("prefill", "decode") or not row.time_s > 0:
            raise ValueError(f"{path}: bad row {row}")
        rows.append(row)
    return rows, header


def _interp_lin(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xp, fp), extrapolated linearly from the two end points."""
    if len(xp) == 1:
        return np.full_like(x, fp[0], dtype=np.float64)
    y = np.interp(x, xp, fp)
    lo, hi = x < xp[0], x > xp[-1]
    y = np.where(lo, fp[0] + (x - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0]), y)
    return np.where(hi, fp[-1] + (x - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2]), y)


class TablePerf:
    """``PerfModel`` of one dense engine rank from a measured profile (see module docstring)."""

    ep_synchronous = False
    wants_prefill_cached_tokens = False
    verify_tokens_per_seq = 1
    decode_tokens_per_step = 1.0

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        model: ModelSpec | str = "llama-3.1-8b",
        hardware: HardwareSpec | str = "h200",
        step_overhead_s: float = 0.0,
        kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION,
        activation_reserve_bytes: float = DEFAULT_ACTIVATION_RESERVE_BYTES,
    ) -> None:
        self.model, self.hardware = get_model(model), get_hardware(hardware)
        if self.model.is_moe:
            raise ValueError("TablePerf models a dense engine; the profile has no MoE/EP terms")
        if step_overhead_s < 0 or not 0 < kv_cache_fraction <= 1 or activation_reserve_bytes < 0:
            raise ValueError("need step_overhead_s >= 0, 0 < kv_cache_fraction <= 1, activation_reserve_bytes >= 0")
        self.path = Path(path) if path is not None else profile_path(self.model, self.hardware)
        self.rows, self.header = read_profile(self.path)
        if self.header and self.model.name not in self.header[0]:
            raise ValueError(f"{self.path} does not look like a {self.model.name} profile: {self.header[0]!r}")
        self.step_overhead_s = float(step_overhead_s)
        self.kv_bytes_per_token = int(self.model.kv_bytes_per_token)
        free = (self.hardware.hbm_bytes * kv_cache_fraction - self.model.dense_weight_bytes
                - activation_reserve_bytes)
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on one {self.hardware.name}")
        self.kv_capacity_tokens_per_rank = int(free // self.kv_bytes_per_token)
        self._build_prefill()
        self._build_decode()

    @classmethod
    def for_engine(cls, model: ModelSpec | str, hardware: HardwareSpec | str, *, num_dp_ranks: int = 1,
                   gpus_per_rank: int = 1, **kw) -> TablePerf:
        """The shipped profile of ``model`` on ``hardware`` for one rank of a dense engine.

        Only ``gpus_per_rank == 1`` is measured (no TP profile); ``num_dp_ranks`` does not matter
        (each rank of a dense engine steps alone)."""
        if gpus_per_rank != 1:
            raise ValueError("the measured profiles are single-GPU ranks (gpus_per_rank=1); no TP table")
        if num_dp_ranks < 1:
            raise ValueError("num_dp_ranks must be >= 1")
        path = profile_path(model, hardware)
        if not path.exists():
            raise ValueError(f"no measured profile for {get_model(model).name} on {get_hardware(hardware).name} "
                             f"({path.name} not in {PROFILE_DIR})")
        return cls(path, model=model, hardware=hardware, **kw)

    # ------------------------------------------------------------------ tables
    def _build_prefill(self) -> None:
        pf = [r for r in self.rows if r.kind == "prefill"]
        plain = sorted((r.prefill_tokens, r.time_s) for r in pf if r.cached_tokens == 0)
        if len(plain) < 2:
            raise ValueError(f"{self.path}: need prefill rows with cached_tokens=0 at >= 2 token counts")
        t0 = dict(plain)
        slopes = []
        for n in sorted({r.prefill_tokens for r in pf if r.cached_tokens > 0}):
            if n not in t0:
                raise ValueError(f"{self.path}: cached-prefix rows at n={n} need the n={n}, p=0 row")
            x = np.array([n * r.cached_tokens for r in pf if r.prefill_tokens == n and r.cached_tokens > 0], float)
            y = np.array([r.time_s - t0[n] for r in pf if r.prefill_tokens == n and r.cached_tokens > 0])
            slopes.append((n, float(x @ y / (x @ x))))  # least squares through the origin
        if not slopes:
            raise ValueError(f"{self.path}: need cached-prefix prefill rows to price attention pairs")
        #: (n, seconds per attention pair) fitted on the cached-prefix rows
        self.alpha_points = slopes
        self._alpha_logn = np.log([n for n, _ in slopes])
        self._alpha = np.array([a for _, a in slopes])
        n = np.array([p[0] for p in plain], dtype=np.float64)
        self._pf_n = n
        self._pf_L = np.array([p[1] for p in plain]) - self.alpha(n) * n * (n + 1.0) / 2.0

    def _build_decode(self) -> None:
        dec = [r for r in self.rows if r.kind == "decode"]
        batches = sorted({r.batch for r in dec})
        if not batches:
            raise ValueError(f"{self.path}: no decode rows")
        self._dec_rows = []
        for b in batches:
            pts = sorted((r.batch * r.ctx_tokens, r.time_s) for r in dec if r.batch == b)
            self._dec_rows.append((float(b), np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])))
        if len(self._dec_rows) < 2:
            raise ValueError(f"{self.path}: need decode rows at >= 2 batch sizes")
        self._dec_b = np.array([r[0] for r in self._dec_rows])

    # ------------------------------------------------------------------ pieces
    def alpha(self, tokens: ArrayLike) -> np.ndarray:
        """Seconds per prefill attention pair at ``tokens`` new tokens (log-linear in tokens, flat outside)."""
        ln = np.log(np.maximum(np.asarray(tokens, dtype=np.float64), 1.0))
        return np.interp(ln, self._alpha_logn, self._alpha)

    def linear_time_s(self, tokens: ArrayLike) -> np.ndarray:
        """``L(T)``: prefill time of ``T`` tokens without attention (interpolated, linear beyond the rows)."""
        return _interp_lin(np.asarray(tokens, dtype=np.float64), self._pf_n, self._pf_L)

    def prefill_time_s(self, tokens: ArrayLike, pairs: ArrayLike) -> np.ndarray:
        """``t_pf(T, P) = L(T) + alpha(T) * max(P, T)``; 0 where ``T == 0``."""
        t = np.asarray(tokens, dtype=np.float64)
        p = np.maximum(np.asarray(pairs, dtype=np.float64), t)
        return np.where(t > 0, self.linear_time_s(t) + self.alpha(t) * p, 0.0)

    def decode_time_s(self, seqs: ArrayLike, ctx_tokens: ArrayLike) -> np.ndarray:
        """``t_dec(B, C)`` for ``B`` sequences with ``C`` context tokens in total; 0 where ``B == 0``."""
        b = np.asarray(seqs, dtype=np.float64)
        c = np.asarray(ctx_tokens, dtype=np.float64)
        b, c = np.broadcast_arrays(b, c)
        rows = np.stack([_interp_lin(c, xc, yt) for _, xc, yt in self._dec_rows], axis=-1)  # (..., nb)
        bs = self._dec_b
        i = np.clip(np.searchsorted(bs, b, side="right") - 1, 0, len(bs) - 2)
        b0, b1 = bs[i], bs[i + 1]
        y0 = np.take_along_axis(rows, i[..., None], axis=-1)[..., 0]
        y1 = np.take_along_axis(rows, (i + 1)[..., None], axis=-1)[..., 0]
        y = y0 + (b - b0) * (y1 - y0) / (b1 - b0)
        return np.where(b > 0, y, 0.0)

    # ------------------------------------------------------------------ PerfModel
    def step_time_s(
        self,
        prefill_tokens: ArrayLike,
        prefill_attn_pairs: ArrayLike,
        decode_seqs: ArrayLike,
        decode_ctx_tokens: ArrayLike,
    ) -> np.ndarray:
        """Seconds one step takes, per-rank work of shape ``(..., R)``; max over ranks, shape ``(...)``."""
        pt, pp, ds, dc = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in
                                               (prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens)))
        if pt.ndim == 0:
            pt, pp, ds, dc = (a.reshape(1) for a in (pt, pp, ds, dc))
        pf = self.prefill_time_s(pt, pp)
        dec = self.decode_time_s(ds, dc)
        mixed = (pt > 0) & (ds > 0)
        extra = np.where(mixed, self.linear_time_s(pt + ds) - self.linear_time_s(ds)
                         + self.alpha(pt) * np.maximum(pp, pt), 0.0)
        rank = np.where(mixed, dec + extra, pf + dec)
        busy = (pt > 0) | (ds > 0)
        rank = np.where(busy, rank + self.step_overhead_s, 0.0)
        return rank.max(axis=-1)

    def __repr__(self) -> str:
        return (f"TablePerf({self.model.name}, {self.hardware.name}, {self.path.name}, "
                f"overhead={self.step_overhead_s * 1e3:g} ms, "
                f"kv_capacity/rank={self.kv_capacity_tokens_per_rank} tokens)")
