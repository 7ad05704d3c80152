#!/usr/bin/env python3
"""Measure prefill and decode step times of a dense Llama-class model on one GPU (PyTorch only).

Standalone: imports nothing from pdlb, so it runs under any Python with PyTorch (the device
machine's image). It builds ONE architecture with random bf16 weights -- Llama-3.1-8B dims by
default (32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, FFN 14336, vocab 128256,
untied LM head) -- and times one forward step the way a serving engine runs it:

* fused QKV and gate/up projections (one GEMM each, as vLLM/SGLang load them), RMSNorm
  (``F.rms_norm``), RoPE, SiLU-and-mul, residuals, final norm and LM head;
* the KV cache is pre-allocated per sequence (contiguous ``[layers, 2, batch, kv_heads, len,
  head_dim]``); every step writes the new tokens' K/V into it and attends over it;
* prefill (one sequence of ``n`` new tokens after ``p`` cached prefix tokens):
  ``scaled_dot_product_attention`` with a lower-right causal bias
  (``torch.nn.attention.bias.causal_lower_right``; for ``p = 0`` this is plain ``is_causal=True``)
  and ``enable_gqa`` -- PyTorch routes both to its FlashAttention-2 kernel, which handles GQA
  natively. Logits are computed for the last token only (what serving engines do);
* decode (``batch`` sequences, each attending to ``ctx`` KV tokens including its new one): the
  query heads of a KV group are folded into the query-length axis (``[B, kv_heads, 4, 128]``),
  the FlashAttention "seqlen_q/ngroups swap" that makes GQA decode read each KV head once;
  non-causal SDPA over the cache. Logits for all ``batch`` tokens.
* each grid point is captured in a CUDA graph (``torch.cuda.CUDAGraph``) and its replays are
  timed with CUDA events: warm-up, then the median of several replays. The graphs remove CPU
  launch gaps, so the numbers are pure GPU time of the forward (no scheduler, sampling or
  detokenisation). ``--no-graphs`` times eager launches instead.

Before timing, a preflight checks on the device itself (1) each attention path against a float32
reference with an explicit mask and repeated KV heads, (2) a tiny model's decode and prefix-prefill
logits against a plain full prefill (KV cache + RoPE positions consistent), and (3) that a CUDA
graph of the decode and prefill steps captures and replays to the eager result. Attention setups
are tried in order -- flash-only with ``enable_gqa``, flash-only with repeated KV heads, then the
same with PyTorch's own backend choice -- and the first that passes is used; if none passes the
script stops. A failed graph check turns graphs off. Both choices are recorded in the sidecar.
The ceilings, backend comparison and eager points run last, after the grid.

Output (``--out DIR``):

* ``<name>.csv`` with columns ``kind,prefill_tokens,cached_tokens,batch,ctx_tokens,time_s`` and
  ``#`` header lines (GPU, torch, model, column meanings). ``kind`` is ``prefill`` (batch 1,
  ``prefill_tokens`` new after ``cached_tokens``) or ``decode`` (``batch`` sequences, each with
  ``ctx_tokens`` KV tokens; the step's total context is ``batch * ctx_tokens``);
* ``<name>.json`` sidecar: environment, grid, per-point repeat statistics, the preflight results,
  measured ceilings (bf16 matmul TFLOP/s, device copy GB/s), an attention-backend comparison and
  eager-vs-graph decode points.

Grid (default, ``--grid full``): prefill tokens 16..32768 (powers of two) with no prefix; prefill
tokens {128, 512, 2048, 8192} after prefixes {2048, 8192, 32768}; decode batch 1..256 (powers of
two) x ctx 512..16384 (powers of two), keeping points whose KV cache (``batch * ctx * kv_bytes``,
131,072 B/token for Llama-3.1-8B) is at most ``--max-kv-gb`` (80 GB: ``batch * ctx <= 524,288``
tokens, 68.7 GB). One flat KV buffer sized for the largest point is allocated once and viewed per
point. ``--tiny`` swaps in a 2-layer toy model and a small grid for a CPU smoke test.

Typical use::

    python bench/gpu_profile.py --out "$OUT"                       # H200, full grid
    python bench/gpu_profile.py --tiny --device cpu --out /tmp/p   # smoke test on a CPU
    python bench/gpu_profile.py --kinds --out "$OUT"               # MLA / sliding-window /
        # compressed top-k attention and dense / grouped-GEMM MoE kernels vs the roofline
        # (bench/gpu_kinds.py, docs/gpu_profile.md "Kernel kinds")
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path
import time
import traceback
from dataclasses import asdict, dataclass

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # --help works without PyTorch; main() says what is missing
    torch = None  # type: ignore[assignment]

NO_TORCH = "error: {script} needs PyTorch (the device machine's image has it; on a CPU: pip install torch)"


# ----------------------------------------------------------------------------- architecture
@dataclass(frozen=True)
class Arch:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def kv_bytes_per_token(self) -> int:  # bf16 K and V, all layers
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def params(self) -> int:
        h, hd = self.hidden, self.head_dim
        attn = h * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * h
        mlp = 3 * h * self.ffn
        return self.layers * (attn + mlp + 2 * h) + 2 * self.vocab * h + h


LLAMA_3_1_8B = Arch("llama-3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                    ffn=14336, vocab=128256)
TINY = Arch("tiny", layers=2, hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1000)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str = "gqa") -> torch.Tensor:
    """q [B, H, T, D] new tokens; k/v [B, KVH, S, D] the whole cache (S - T cached before them).

    Lower-right causal: query i (0-based among the T) sees keys 0 .. S - T + i. ``impl`` "gqa"
    passes the KV heads as they are (``enable_gqa``; the flash kernel groups natively); "expand"
    repeats them to H heads first (a fallback that copies K/V)."""
    t, s = q.shape[2], k.shape[2]
    if impl == "gqa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, s), enable_gqa=True)
    grp = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1),
                                          attn_mask=causal_lower_right(t, s))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, 1, D] one token per sequence; k/v [B, KVH, S, D]; returns [B, H, 1, D].

    The H // KVH query heads sharing a KV head are folded into the query-length axis
    ([B, KVH, H // KVH, D], head h = kv * grp + j as in HF ``repeat_kv``) and attend without a
    mask: every KV head is read once for all its query heads."""
    b, h, _, d = q.shape
    kvh = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(b, kvh, h // kvh, d), k, v)
    return o.reshape(b, h, 1, d)


class Model:
    """Random-weight Llama-style decoder; ``forward`` appends tokens to a KV cache and returns logits."""

    def __init__(self, arch: Arch, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 max_pos: int = 65536) -> None:
        self.arch, self.device, self.dtype = arch, device, dtype
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        a = arch

        def w(out_f: int, in_f: int) -> torch.Tensor:  # std 1/sqrt(fan_in): activations stay O(1)
            t = torch.randn(out_f, in_f, device=device, dtype=dtype, generator=g)
            return t.mul_(in_f ** -0.5)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=device, dtype=dtype)

        qkv_out = (a.heads + 2 * a.kv_heads) * a.head_dim
        self.embed = torch.randn(a.vocab, a.hidden, device=device, dtype=dtype, generator=g)
        self.layers = []
        for _ in range(a.layers):
            self.layers.append({
                "ln1": ones(a.hidden), "wqkv": w(qkv_out, a.hidden), "wo": w(a.hidden, a.heads * a.head_dim),
                "ln2": ones(a.hidden), "wgu": w(2 * a.ffn, a.hidden), "wd": w(a.hidden, a.ffn),
            })
        self.norm = ones(a.hidden)
        self.lm_head = w(a.vocab, a.hidden)
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, device=device, dtype=torch.float32) / a.head_dim))
        ang = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)
        self.max_pos = max_pos
        #: prefill attention: "gqa" (SDPA enable_gqa, native in the flash kernel) or "expand"
        self.prefill_impl = "gqa"

    def rope(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        """x: [B, T, H, D]; positions pos0 .. pos0 + T - 1 (rotate-half convention of HF Llama)."""
        t = x.shape[1]
        cos = self.cos[pos0:pos0 + t].view(1, t, 1, -1)
        sin = self.sin[pos0:pos0 + t].view(1, t, 1, -1)
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def forward(self, ids: torch.Tensor, cache: torch.Tensor, pos0: int, mode: str) -> torch.Tensor:
        """Run ``ids`` ([B, T]) at positions ``pos0..pos0+T-1`` writing K/V into ``cache``
        ([layers, 2, B, kv_heads, pos0 + T, head_dim]) and attending over all of it.

        mode ``prefill``: lower-right causal SDPA with ``enable_gqa``; logits of the last token.
        mode ``decode`` (T == 1): grouped-query fold + non-causal SDPA; logits of every sequence.
        """
        a = self.arch
        b, t = ids.shape
        s = pos0 + t
        assert cache.shape[4] == s, (cache.shape, s)
        if s > self.max_pos:
            raise ValueError(f"position {s} beyond the RoPE table ({self.max_pos})")
        x = F.embedding(ids, self.embed)
        qn, kn = a.heads * a.head_dim, a.kv_heads * a.head_dim
        for i, L in enumerate(self.layers):
            h = F.rms_norm(x, (a.hidden,), L["ln1"], a.eps)
            qkv = F.linear(h, L["wqkv"])
            q = qkv[..., :qn].view(b, t, a.heads, a.head_dim)
            k = qkv[..., qn:qn + kn].view(b, t, a.kv_heads, a.head_dim)
            v = qkv[..., qn + kn:].view(b, t, a.kv_heads, a.head_dim)
            q, k = self.rope(q, pos0), self.rope(k, pos0)
            kc, vc = cache[i, 0], cache[i, 1]  # [B, KVH, S, D]
            kc[:, :, pos0:s].copy_(k.transpose(1, 2))
            vc[:, :, pos0:s].copy_(v.transpose(1, 2))
            if mode == "decode":
                assert t == 1
                o = decode_attention(q.view(b, a.heads, 1, a.head_dim), kc, vc).reshape(b, 1, qn)
            else:
                o = prefill_attention(q.transpose(1, 2), kc, vc, self.prefill_impl)  # [B, H, T, D]
                o = o.transpose(1, 2).reshape(b, t, qn)
            x = x + F.linear(o, L["wo"])
            h = F.rms_norm(x, (a.hidden,), L["ln2"], a.eps)
            gu = F.linear(h, L["wgu"])
            x = x + F.linear(F.silu(gu[..., :a.ffn]) * gu[..., a.ffn:], L["wd"])
        if mode != "decode":
            x = x[:, -1:]
        x = F.rms_norm(x, (a.hidden,), self.norm, a.eps)
        return F.linear(x, self.lm_head)


# ----------------------------------------------------------------------------- timing
class Timer:
    """Times a step function on the device: CUDA graph replays + CUDA events, or wall clock on CPU."""

    def __init__(self, device: torch.device, graphs: bool, target_s: float, min_reps: int,
                 max_reps: int, warmup: int) -> None:
        self.device, self.graphs = device, graphs and device.type == "cuda"
        self.target_s, self.min_reps, self.max_reps, self.warmup = target_s, min_reps, max_reps, warmup

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prepare(self, fn):  # -> callable running one step
        if not self.graphs:
            return fn, None
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        return g.replay, (g, out)

    def measure(self, fn) -> dict:
        run, keep = self.prepare(fn)
        for _ in range(self.warmup):
            run()
        self._sync()
        one = self._time_many(run, 1)[0]
        reps = int(min(self.max_reps, max(self.min_reps, math.ceil(self.target_s / max(one, 1e-6)))))
        ts = self._time_many(run, reps)
        del keep
        return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "reps": reps,
                "graph": self.graphs}

    def _time_many(self, run, reps: int) -> list[float]:
        if self.device.type == "cuda":
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for a, b in ev:
                a.record()
                run()
                b.record()
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in ev]
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            out.append(time.perf_counter() - t0)
        return out


# ----------------------------------------------------------------------------- grids
def prefill_grid(tiny: bool) -> list[tuple[int, int]]:
    """(new tokens, cached prefix tokens) of the prefill points."""
    if tiny:
        return [(n, 0) for n in (8, 32, 128)] + [(n, p) for n in (8, 32) for p in (64, 256)]
    plain = [(2 ** e, 0) for e in range(4, 16)]  # 16 .. 32768
    cached = [(n, p) for n in (128, 512, 2048, 8192) for p in (2048, 8192, 32768)]
    return plain + cached


def decode_grid(tiny: bool, max_kv_bytes: float, kv_per_tok: int) -> list[tuple[int, int]]:
    """(batch, ctx per sequence) of the decode points whose KV cache fits ``max_kv_bytes``."""
    if tiny:
        batches, ctxs = (1, 4, 16), (64, 256)
    else:
        batches = tuple(2 ** e for e in range(0, 9))       # 1 .. 256
        ctxs = tuple(2 ** e for e in range(9, 15))          # 512 .. 16384
    return [(b, c) for b in batches for c in ctxs if b * c * kv_per_tok <= max_kv_bytes]


# ----------------------------------------------------------------------------- checks
def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def attention_reference(q, k, v, causal_offset: int | None) -> torch.Tensor:
    """float32 math attention; q [B,H,T,D], k/v [B,KVH,S,D]; lower-right causal if offset given."""
    grp = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(grp, dim=1)
    v = v.float().repeat_interleave(grp, dim=1)
    sc = (q.float() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        t, s = q.shape[2], k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
        sc = sc.masked_fill(~mask, float("-inf"))
    return sc.softmax(-1) @ v


def check_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, hd: int,
                    impl: str = "gqa") -> dict:
    """Each attention path used by ``Model.forward`` against the float32 reference."""
    g = torch.Generator(device=device)
    g.manual_seed(1)
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    res = {}
    # prefill without prefix (square causal)
    q, k, v = r(1, heads, 200, hd), r(1, kv_heads, 200, hd), r(1, kv_heads, 200, hd)
    res["prefill_causal"] = rel_err(prefill_attention(q, k, v, impl), attention_reference(q, k, v, 0))
    # prefill after a 300-token prefix (lower-right causal)
    q, k, v = r(1, heads, 100, hd), r(1, kv_heads, 400, hd), r(1, kv_heads, 400, hd)
    res["prefill_prefix"] = rel_err(prefill_attention(q, k, v, impl), attention_reference(q, k, v, 300))
    # decode, grouped fold
    q, k, v = r(3, heads, 1, hd), r(3, kv_heads, 257, hd), r(3, kv_heads, 257, hd)
    res["decode_grouped"] = rel_err(decode_attention(q, k, v), attention_reference(q, k, v, None))
    return res


def check_model(device: torch.device, dtype: torch.dtype, impl: str = "gqa") -> dict:
    """Tiny model: decode and prefix-prefill logits equal those of one full prefill."""
    m = Model(TINY, device, dtype, seed=3, max_pos=1024)
    m.prefill_impl = impl
    g = torch.Generator(device=device)
    g.manual_seed(4)
    n_all = 96
    ids = torch.randint(0, TINY.vocab, (1, n_all), device=device, generator=g)

    def cache(b, s):
        return torch.zeros(TINY.layers, 2, b, TINY.kv_heads, s, TINY.head_dim, device=device, dtype=dtype)

    # reference: prefill all 96 tokens at once -> logits of token 95
    full = m.forward(ids, cache(1, n_all), 0, "prefill")
    # prefill 64, then 31 with the 64 cached, then decode the last one
    c = cache(1, n_all)
    m.forward(ids[:, :64], c[:, :, :, :, :64], 0, "prefill")
    pre = m.forward(ids[:, 64:95], c[:, :, :, :, :95], 64, "prefill")
    dec = m.forward(ids[:, 95:96], c, 95, "decode")
    ref95 = m.forward(ids[:, :95], cache(1, 95), 0, "prefill")
    return {"prefix_prefill_vs_full": rel_err(pre, ref95), "decode_vs_full": rel_err(dec, full)}


def check_graphs(device: torch.device, dtype: torch.dtype, impl: str = "gqa") -> dict:
    """Capture the tiny model's prefill and decode steps in CUDA graphs; replay == eager."""
    m = Model(TINY, device, dtype, seed=5, max_pos=1024)
    m.prefill_impl = impl
    out = {}
    for mode, b, t, s in (("prefill", 1, 48, 80), ("decode", 4, 1, 80)):
        ids = torch.randint(0, TINY.vocab, (b, t), device=device)
        c = torch.randn(TINY.layers, 2, b, TINY.kv_heads, s, TINY.head_dim, device=device, dtype=dtype)
        eager = m.forward(ids, c, s - t, mode).clone()
        timer = Timer(device, True, 0.0, 1, 1, 0)
        run, keep = timer.prepare(lambda: m.forward(ids, c, s - t, mode))
        run()
        torch.cuda.synchronize(device)
        out[mode] = rel_err(keep[1], eager)
        del keep
    return out


def ceilings(device: torch.device) -> dict:
    """bf16 8192^3 matmul TFLOP/s and device-to-device copy GB/s (read + write), median of 10."""
    res = {}
    timer = Timer(device, False, 0.0, 10, 10, 3)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = timer.measure(lambda: a @ b)["median_s"]
    res["bf16_matmul_8192_tflops"] = 2 * 8192 ** 3 / t / 1e12
    del a, b
    x = torch.empty(2 * 1024 ** 3, device=device, dtype=torch.uint8)
    y = torch.empty_like(x)
    t = timer.measure(lambda: y.copy_(x))["median_s"]
    res["copy_4GiB_read_plus_write_gbs"] = 2 * x.numel() / t / 1e9
    del x, y
    # a GEMV-like stream: the decode regime (one token through a 4096 x 14336*2 weight)
    w = torch.randn(2 * 14336, 4096, device=device, dtype=torch.bfloat16)
    h = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    t = timer.measure(lambda: F.linear(h, w))["median_s"]
    res["gemv_1x4096x28672_weight_gbs"] = w.numel() * 2 / t / 1e9
    return res


def attention_backends(device: torch.device, n: int = 8192) -> dict:
    """Causal self-attention over ``n`` tokens (32 q heads, KV repeated to 32 heads) per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res = {}
    q = torch.randn(1, 32, n, 128, device=device, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    flops = 4 * 32 * 128 * n * (n + 1) / 2
    timer = Timer(device, False, 0.2, 5, 30, 2)
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                t = timer.measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))["median_s"]
            res[name] = {"time_s": t, "tflops": flops / t / 1e12}
        except Exception as e:  # noqa: BLE001 (report, not fail)
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return res


# ----------------------------------------------------------------------------- main
def torch_device(name: str, script: str):  # noqa: ANN201 (torch.device, or None)
    """``torch.device(name)``, or None after a one-line error when PyTorch or CUDA is missing."""
    if torch is None:
        print(NO_TORCH.format(script=script), file=sys.stderr)
        return None
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA not available; use --device cpu", file=sys.stderr)
        return None
    return device


def main(argv: list[str] | None = None) -> int:
    rest = sys.argv[1:] if argv is None else list(argv)
    if rest and rest[0] == "--kinds":  # the attention / MoE kernel kinds (bench/gpu_kinds.py)
        import gpu_kinds
        return gpu_kinds.main(rest[1:])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # pdlb_cli.arg_types (standard library only)
    from pdlb_cli.arg_types import nonnegative_int, positive_float, positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="--kinds [ARGS]: time the attention / MoE kernel kinds instead "
                                        "(bench/gpu_kinds.py; --kinds --help for its options)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--name", default=None, help="file stem (default h200-ish: <gpu>_<model>_bf16)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="2-layer toy model and small grid (smoke test)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32 (default on cpu)")
    ap.add_argument("--no-graphs", action="store_true", help="time eager launches, no CUDA graphs")
    ap.add_argument("--max-kv-gb", type=positive_float, default=80.0, help="cap on a decode point's KV cache (GB, 1e9)")
    ap.add_argument("--target-s", type=positive_float, default=0.25, help="timed replays per point add up to about this")
    ap.add_argument("--min-reps", type=positive_int, default=5)
    ap.add_argument("--max-reps", type=positive_int, default=50)
    ap.add_argument("--warmup", type=nonnegative_int, default=3,
                    help="untimed replays before each point's timed ones (default 3; 0: none)")
    ap.add_argument("--passes", type=positive_int, default=1, help="sweep the whole grid this many times")
    ap.add_argument("--skip-extras", action="store_true", help="no ceilings / backend / eager extras")
    args = ap.parse_args(argv)
    device = torch_device(args.device, "bench/gpu_profile.py")
    if device is None:
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    arch = TINY if args.tiny else LLAMA_3_1_8B
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    stem = args.name or f"{gpu.replace('NVIDIA ', '').replace(' ', '-').lower()}_{arch.name}_{str(dtype).split('.')[-1]}"
    csv_path, json_path = os.path.join(args.out, stem + ".csv"), os.path.join(args.out, stem + ".json")
    t_start = time.time()
    meta: dict = {
        "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "python": platform.python_version(), "device": str(device), "dtype": str(dtype),
        "arch": asdict(arch), "params": arch.params, "kv_bytes_per_token": arch.kv_bytes_per_token,
        "script": "bench/gpu_profile.py", "argv": sys.argv[1:] if argv is None else argv,
        "started_unix": t_start,
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(sm_count=p.multi_processor_count, total_mem_bytes=p.total_memory,
                    capability=f"{p.major}.{p.minor}")
    print(json.dumps({k: meta[k] for k in ("gpu", "torch", "cuda", "dtype", "params")}), flush=True)

    # ---- preflight: pick the first attention setup that computes the right thing on this device
    import contextlib

    def flash_only():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])  # no silent fallback to another kernel

    setups = [("flash", "gqa"), ("flash", "expand"), ("auto", "gqa"), ("auto", "expand")]
    if device.type != "cuda":
        setups = [("auto", "gqa")]
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    chosen = None
    meta["preflight"] = []
    for backend, impl in setups:
        ctx = flash_only if backend == "flash" else contextlib.nullcontext
        rec: dict = {"backend": backend, "prefill_impl": impl}
        try:
            with ctx():
                rec["attention_rel_err"] = check_attention(device, dtype, arch.heads, arch.kv_heads,
                                                           arch.head_dim, impl)
                rec["model_rel_err"] = check_model(device, dtype, impl)
            errs = {**rec["attention_rel_err"], **rec["model_rel_err"]}
            rec["ok"] = all(v <= tol * 3 for v in errs.values())  # bf16: ~4e-3 seen; 6e-2 bound
        except Exception as e:  # noqa: BLE001 (try the next setup)
            rec["ok"], rec["error"] = False, f"{type(e).__name__}: {str(e)[:300]}"
        meta["preflight"].append(rec)
        print("preflight:", json.dumps(rec), flush=True)
        if rec["ok"]:
            chosen = (backend, impl, ctx)
            break
    if chosen is None:
        meta["error"] = "preflight failed for every attention setup"
        write_outputs(csv_path, json_path, meta, {}, t_start)
        print("PREFLIGHT FAILED", file=sys.stderr)
        return 1
    meta["sdpa_backend"], meta["prefill_impl"] = chosen[0], chosen[1]
    sdpa_ctx = chosen[2]
    graphs = device.type == "cuda" and not args.no_graphs
    if graphs:
        try:
            with sdpa_ctx():
                gchk = check_graphs(device, dtype, chosen[1])
            meta["check_graphs_rel_err"] = gchk
            if not all(v <= 1e-3 for v in gchk.values()):
                graphs = False
                meta["graphs_disabled"] = f"graph replay differs from eager: {gchk}"
        except Exception as e:  # noqa: BLE001
            graphs = False
            meta["graphs_disabled"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print("graphs:", graphs, meta.get("check_graphs_rel_err"), meta.get("graphs_disabled", ""), flush=True)
    meta["cuda_graphs"] = graphs

    # ---- model + KV buffer
    t0 = time.time()
    model = Model(arch, device, dtype, seed=0, max_pos=65536 if not args.tiny else 1024)
    model.prefill_impl = chosen[1]
    kv_elems_per_tok = arch.kv_bytes_per_token // 2
    pgrid = prefill_grid(args.tiny)
    dgrid = decode_grid(args.tiny, args.max_kv_gb * 1e9, arch.kv_bytes_per_token)
    max_tokens = max([b * c for b, c in dgrid] + [n + p for n, p in pgrid])
    kvbuf = torch.empty(max_tokens * kv_elems_per_tok, device=device, dtype=dtype)
    kvbuf.normal_(0.0, 1.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        meta["mem_after_alloc_bytes"] = torch.cuda.memory_allocated(device)
    meta["setup_s"] = time.time() - t0
    meta["grid"] = {"prefill": pgrid, "decode": dgrid, "max_kv_gb": args.max_kv_gb,
                    "kv_buffer_tokens": max_tokens, "passes": args.passes}
    print(f"model + KV buffer ({max_tokens} tokens, {max_tokens * arch.kv_bytes_per_token / 1e9:.1f} GB) "
          f"ready in {meta['setup_s']:.1f} s; {len(pgrid)} prefill + {len(dgrid)} decode points", flush=True)

    def cache_view(b: int, s: int) -> torch.Tensor:
        return kvbuf[: b * s * kv_elems_per_tok].view(arch.layers, 2, b, arch.kv_heads, s, arch.head_dim)

    timer = Timer(device, graphs, args.target_s, args.min_reps, args.max_reps, args.warmup)
    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    points: dict[tuple, dict] = {}

    def run_point(key: tuple, fn) -> None:
        try:
            with sdpa_ctx():
                r = timer.measure(fn)
        except Exception as e:  # noqa: BLE001 (record and go on: one bad point must not sink the run)
            print(f"  {key}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            points.setdefault(key, {"passes": []})["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return
        points.setdefault(key, {"passes": []})["passes"].append(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # give the point's graph pool back before the next capture
        print(f"  {key}: {r['median_s'] * 1e3:9.3f} ms  (min {r['min_s'] * 1e3:.3f}, max {r['max_s'] * 1e3:.3f}, "
              f"n={r['reps']})", flush=True)

    for pss in range(args.passes):
        print(f"pass {pss + 1}/{args.passes}: prefill", flush=True)
        for n, p in pgrid:
            ids = torch.randint(0, arch.vocab, (1, n), device=device, generator=gen)
            c = cache_view(1, p + n)
            run_point(("prefill", n, p, 1, 0), lambda ids=ids, c=c, p=p: model.forward(ids, c, p, "prefill"))
            del ids, c
        print(f"pass {pss + 1}/{args.passes}: decode", flush=True)
        for b, s in dgrid:
            ids = torch.randint(0, arch.vocab, (b, 1), device=device, generator=gen)
            c = cache_view(b, s)
            run_point(("decode", 0, 0, b, s), lambda ids=ids, c=c, s=s: model.forward(ids, c, s - 1, "decode"))
            del ids, c
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_outputs(csv_path, json_path, meta, points, t_start)

    # eager vs graph for a few decode points: what CUDA graphs save
    if graphs and not args.skip_extras and not args.tiny:
        eager = Timer(device, False, args.target_s, args.min_reps, args.max_reps, args.warmup)
        meta["decode_eager"] = []
        for b, s in ((1, 512), (1, 8192), (16, 2048), (64, 2048), (256, 2048)):
            if (b, s) not in dgrid:
                continue
            ids = torch.randint(0, arch.vocab, (b, 1), device=device, generator=gen)
            c = cache_view(b, s)
            with sdpa_ctx():
                r = eager.measure(lambda: model.forward(ids, c, s - 1, "decode"))
            meta["decode_eager"].append({"batch": b, "ctx_tokens": s, **r})
            print(f"  eager decode b={b} ctx={s}: {r['median_s'] * 1e3:.3f} ms", flush=True)
    # numerical sanity of the big model (random weights must not overflow)
    c = cache_view(2, 64)
    with sdpa_ctx():
        lg = model.forward(torch.zeros(2, 1, dtype=torch.long, device=device), c, 63, "decode")
    meta["logits_finite"] = bool(torch.isfinite(lg).all())
    write_outputs(csv_path, json_path, meta, points, t_start)
    del kvbuf, model, c, lg
    if device.type == "cuda" and not args.skip_extras and not args.tiny:
        torch.cuda.empty_cache()
        try:  # last: an exotic backend must not cost the grid
            meta["ceilings"] = ceilings(device)
            print("ceilings:", meta["ceilings"], flush=True)
            meta["attention_backends_causal_8192"] = attention_backends(device)
            print("attention backends:", meta["attention_backends_causal_8192"], flush=True)
        except Exception as e:  # noqa: BLE001
            meta["extras_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        write_outputs(csv_path, json_path, meta, points, t_start)
    print(f"wrote {csv_path} and {json_path} in {time.time() - t_start:.0f} s", flush=True)
    print_summary(points)
    return 0


def write_outputs(csv_path: str, json_path: str, meta: dict, points: dict, t_start: float) -> None:
    meta = dict(meta)
    meta["elapsed_s"] = time.time() - t_start
    meta["points"] = [
        {"kind": k[0], "prefill_tokens": k[1], "cached_tokens": k[2], "batch": k[3], "ctx_tokens": k[4], **v}
        for k, v in points.items()
    ]
    with open(json_path, "w") as f:
        json.dump(meta, f, indent=1)
    with open(csv_path, "w", newline="") as f:
        f.write(f"# pdlb GPU profile: {meta['arch']['name']} ({meta['params'] / 1e9:.2f}B params, random "
                f"weights), {meta['dtype']}, one GPU\n")
        f.write(f"# gpu: {meta['gpu']}; torch {meta['torch']}; cuda {meta['cuda']}; cuda_graphs "
                f"{meta.get('cuda_graphs')}; attention: SDPA backend {meta.get('sdpa_backend')}, prefill "
                f"{meta.get('prefill_impl')}\n")
        f.write("# kind=prefill: batch 1, prefill_tokens new tokens after cached_tokens cached prefix tokens; "
                "logits of the last token only\n")
        f.write("# kind=decode: batch sequences, one new token each, each attending to ctx_tokens KV tokens "
                "(incl. its own); step total context = batch * ctx_tokens\n")
        f.write("# time_s: median GPU time of one forward step (CUDA events around graph replays); no "
                "scheduler/sampling overhead. Sidecar JSON (same stem) has the details.\n")
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["kind", "prefill_tokens", "cached_tokens", "batch", "ctx_tokens", "time_s"])
        for k, v in points.items():
            if not v.get("passes"):
                continue
            allmed = [r["median_s"] for r in v["passes"]]
            w.writerow([k[0], k[1], k[2], k[3], k[4], f"{statistics.median(allmed):.6e}"])


def print_summary(points: dict) -> None:
    print("\nkind     new   cached  batch    ctx   time_ms  spread%", flush=True)
    for k, v in points.items():
        if not v.get("passes"):
            print(f"{k[0]:7s} {k[1]:6d} {k[2]:6d} {k[3]:5d} {k[4]:6d}   FAILED")
            continue
        meds = [r["median_s"] for r in v["passes"]]
        lo, hi = min(r["min_s"] for r in v["passes"]), max(r["max_s"] for r in v["passes"])
        m = statistics.median(meds)
        print(f"{k[0]:7s} {k[1]:6d} {k[2]:6d} {k[3]:5d} {k[4]:6d} {m * 1e3:9.3f} {100 * (hi - lo) / m:7.1f}")


if __name__ == "__main__":
    sys.exit(main())
