#!/usr/bin/env python3
"""Time the attention and MoE kernels of the newer model kinds on one GPU (PyTorch) against the roofline.

Standalone (PyTorch only, no pdlb import; shares the timer with ``bench/gpu_profile.py``) so it runs
on the device machine's image. ``python bench/gpu_profile.py --kinds ...`` runs it too. Random
bf16 data (float32 on a CPU), one layer, GPU time only (each point captured in a CUDA graph that
repeats the kernel ``inner`` times so one replay lasts >= ~1 ms, timed with CUDA events; median of
the replays). Kinds, with the FLOPs and bytes the roofline charges (those of
``sim/models/spec.py``'s formulas for the same shapes):

* ``gqa_decode``: Llama-3.1-8B attention layer, 32 query heads over 8 KV heads of 128, ``B``
  sequences x ``L`` cached tokens, one query token each; the query heads of a KV group are folded
  into the query axis and SDPA runs FlashAttention. FLOPs ``4 * B * 32 * 128 * L``, bytes
  ``2 * B * 8 * 128 * L * 2`` (K and V, bf16).
* ``gqa_prefill``: the same layer, causal prefill of ``n`` tokens (SDPA, FlashAttention); FLOPs
  ``4 * 32 * 128 * n (n + 1) / 2``.
* ``mla_decode``: DeepSeek-V3 weight-absorbed MLA: 128 heads attend a 576-wide latent (512 + 64
  RoPE) of ``L`` tokens, the output uses the first 512 dims. Two implementations, the faster one
  counts: ``bmm`` (scores = q @ latent^T in bf16, softmax in fp32, p @ latent) and ``sdpa``
  (heads folded into the query axis, one 576-wide KV head). FLOPs ``B * 128 * 2 * (576 + 512) * L``,
  bytes ``B * L * 576 * 2``.
* ``swa_decode``: GQA decode over the last ``W`` tokens of a 32k cache (a sliding window layer:
  ``W`` = 128 as DeepSeek-V4, 4096 as Mistral / gpt-oss): as ``gqa_decode`` with ``L = W``.
* ``swa_prefill``: causal prefill of ``n`` tokens with a window of ``W``: FlexAttention with a
  sliding-window block mask (compiled; skips the masked-out blocks) and, for comparison, SDPA
  with the dense causal mask (``dense``, what a kernel without window support costs). Roofline
  FLOPs count only the pairs inside the window: ``4 * 32 * 128 * sum_i min(i + 1, W)``.
* ``compressed_decode``: one DeepSeek-V4 CSA layer's attention after selection: per sequence gather
  512 selected rows of a ``L / 4``-row compressed cache (512 wide, K = V) at random indices, add
  the 128-row window and the ``L / 128`` HCA rows, then MQA with 64 heads of 512 dims. The
  roofline charges the fused ideal (each attended row read once: bytes ``B * n * 1024``, FLOPs
  ``B * 64 * 2 * 2 * 512 * n``, ``n = 640 + L / 128``); the unfused PyTorch version also writes
  and re-reads the gathered rows.
* ``indexer_decode``: the V4 lightning indexer of the same layer: 64 index heads of 128 score all
  ``L / 4`` compressed keys (ReLU, per-head weights, sum over heads), then top-512. FLOPs
  ``B * 64 * 2 * 128 * L / 4``, bytes ``B * L / 4 * 128 * 2`` (bf16 here; the model's keys are FP8);
  the top-k is not in the roofline.
* ``dense_ffn``: Llama-3.1-8B SwiGLU FFN on ``M`` tokens (fused gate/up GEMM 4096 x 28672, down
  14336 x 4096). FLOPs ``2 * M * 3 * 4096 * 14336``, bytes weights + activations in and out.
* ``moe_grouped``: one MoE layer's routed experts on one EP rank: 8 local experts of
  DeepSeek-V4-Flash's shape (hidden 4096, expert width 2048; 256 experts over EP32) and ``M``
  routed token copies spread evenly over them; ``torch._grouped_mm`` for gate/up and down
  (``loop`` = one ``torch.mm`` per expert, for comparison). FLOPs ``2 * M * 3 * 4096 * 2048``,
  bytes the 8 experts' weights (bf16; the model's are FP4) + activations.

Roofline prediction: ``max(FLOPs / (peak * mfu), bytes / (hbm * mbu))`` with the H200 datasheet
peaks (989 TFLOP/s bf16 dense, 4.8 TB/s) and pdlb's default efficiencies (``mfu`` 0.5, ``mbu`` 0.7;
``sim/perf/roofline.py``); ``err = roofline / measured - 1`` (negative: the kernel is slower than
the roofline says). ``ideal`` uses the ceilings measured in the same run instead (bf16 8192^3
matmul, device copy), i.e. how far each kernel is from what this GPU reaches at best.

Before timing, each kind is checked against a float32 reference on a small shape (relative error
in the output JSON). Output ``--out DIR``: ``<name>.json`` (environment, ceilings, checks, points,
per-kind summary); a table on stdout. ``--budget-s`` bounds the run: points past it are skipped and
listed. CPU smoke test: ``python bench/gpu_kinds.py --device cpu --tiny --out /tmp/k``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path
import time
import traceback

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --help works without PyTorch; main() says what is missing
    torch = None  # type: ignore[assignment]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_profile import Timer, ceilings, torch_device  # noqa: E402 (sibling bench script; shares the timer)

#: H200 datasheet: bf16 dense tensor TFLOP/s, HBM3e bytes/s; pdlb's default efficiencies
PEAK_FLOPS, HBM_BYTES_S = 989e12, 4.8e12
DEFAULT_MFU, DEFAULT_MBU = 0.5, 0.7


def roofline_s(flops: float, nbytes: float, peak: float = PEAK_FLOPS, hbm: float = HBM_BYTES_S,
               mfu: float = DEFAULT_MFU, mbu: float = DEFAULT_MBU) -> float:
    """``max(flops / (peak * mfu), bytes / (hbm * mbu))`` seconds."""
    return max(flops / (peak * mfu), nbytes / (hbm * mbu))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- kernels
def _sdpa_flash(q, k, v, **kw):  # noqa: ANN001, ANN202
    """SDPA restricted to FlashAttention on CUDA (no silent fallback); PyTorch's choice on a CPU."""
    if q.device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def gqa_decode(q, k, v):  # noqa: ANN001, ANN201
    """q [B, Hkv, G, D] (G query heads per KV head folded into the query axis), k/v [B, Hkv, L, D]."""
    return _sdpa_flash(q, k, v)


def mla_bmm(q, lat):  # noqa: ANN001, ANN201
    """q [B, H, 576], lat [B, L, 576] -> [B, H, 512]: softmax(q lat^T / sqrt(576)) lat[..., :512]."""
    s = torch.bmm(q, lat.transpose(1, 2)) * (1.0 / math.sqrt(q.shape[-1]))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.bmm(p, lat)[..., :512]


def mla_sdpa(q, lat):  # noqa: ANN001, ANN201
    """The same through SDPA: heads folded into the query axis, one KV head (K = V = latent)."""
    out = F.scaled_dot_product_attention(q.unsqueeze(1), lat.unsqueeze(1), lat.unsqueeze(1))
    return out.squeeze(1)[..., :512]


def compressed_attend(q, comp, idx, win, hca):  # noqa: ANN001, ANN201
    """q [B, 64, 512]; comp [B, C, 512] compressed rows, idx [B, K] selected, win [B, 128, 512],
    hca [B, L/128, 512] -> MQA (K = V) over the K + 128 + L/128 rows, [B, 64, 512]."""
    sel = torch.gather(comp, 1, idx.unsqueeze(-1).expand(-1, -1, comp.shape[-1]))
    kv = torch.cat([sel, win, hca], dim=1)
    s = torch.bmm(q, kv.transpose(1, 2)) * (1.0 / math.sqrt(q.shape[-1]))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.bmm(p, kv)


def indexer(qi, ki, w, k: int):  # noqa: ANN001, ANN201
    """qi [B, 64, 128], ki [B, C, 128], w [B, 64] -> top-``k`` indices [B, k] of sum_h w_h relu(qi_h . ki)."""
    s = torch.relu(torch.bmm(qi, ki.transpose(1, 2)))  # [B, 64, C]
    score = torch.bmm(w.unsqueeze(1), s).squeeze(1)  # [B, C]
    return torch.topk(score, k, dim=-1).indices


def ffn(x, w_gu, w_d):  # noqa: ANN001, ANN201
    """SwiGLU: x [M, H] @ w_gu^T [H, 2I] -> silu(g) * u -> @ w_d^T [I, H]."""
    h = F.linear(x, w_gu)
    g, u = h.chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w_d)


def moe_grouped(x, w_gu_t, w_d_t, offs):  # noqa: ANN001, ANN201
    """x [M, H] sorted by expert, w_gu_t [E, H, 2I] / w_d_t [E, I, H] (column-major views),
    offs [E] int32 cumulative row ends -> [M, H] via ``torch._grouped_mm``."""
    h = torch._grouped_mm(x, w_gu_t, offs=offs)
    g, u = h.chunk(2, dim=-1)
    return torch._grouped_mm((F.silu(g) * u).contiguous(), w_d_t, offs=offs)


def moe_loop(x, w_gu, w_d, bounds):  # noqa: ANN001, ANN201
    """The same with one ``ffn`` per expert (w_gu [E, 2I, H], w_d [E, H, I]); bounds: python ints."""
    outs = [ffn(x[a:b], w_gu[e], w_d[e]) for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.cat(outs, dim=0)


def _flex_window(n: int, window: int, device: torch.device):  # noqa: ANN202
    """A compiled FlexAttention call with a causal sliding-window block mask of ``window``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sw(b, h, qi, kv):  # noqa: ANN001, ANN202
        return (qi >= kv) & (qi - kv < window)

    mask = create_block_mask(sw, None, None, n, n, device=str(device))
    fa = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    return lambda q, k, v: fa(q, k, v, block_mask=mask, enable_gqa=True)


# ----------------------------------------------------------------------------- checks
def _ref_attn(q, k, v, mask=None):  # noqa: ANN001, ANN202
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double()


def run_checks(device: torch.device, dtype: torch.dtype) -> dict:
    """Each kind on a small shape against a float64 reference: relative error of the output."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape):  # noqa: ANN002, ANN202
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    out: dict[str, float | str] = {}

    def check(name, fn):  # noqa: ANN001, ANN202
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 (report, the timing of that kind is skipped)
            out[name] = f"error: {type(e).__name__}: {str(e)[:300]}"

    B, L = 2, 96
    q, k, v = r(B, 2, 4, 64), r(B, 2, L, 64), r(B, 2, L, 64)
    check("gqa_decode", lambda: rel_err(gqa_decode(q, k, v), _ref_attn(q, k, v)))
    qp, kp, vp = r(1, 2, L, 64), r(1, 2, L, 64), r(1, 2, L, 64)
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    check("gqa_prefill", lambda: rel_err(_sdpa_flash(qp, kp, vp, is_causal=True), _ref_attn(qp, kp, vp, causal)))
    qm, lat = r(B, 8, 576), r(B, L, 576)
    ref = _ref_attn(qm, lat, lat)[..., :512]
    check("mla_decode.bmm", lambda: rel_err(mla_bmm(qm, lat), ref))
    check("mla_decode.sdpa", lambda: rel_err(mla_sdpa(qm, lat), ref))
    n, W = 256, 64
    qs, ks, vs = r(1, 4, n, 64), r(1, 2, n, 64), r(1, 2, n, 64)
    ii = torch.arange(n, device=device)
    wmask = (ii[:, None] >= ii[None, :]) & (ii[:, None] - ii[None, :] < W)
    ref_sw = _ref_attn(qs, ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1), wmask)
    check("swa_prefill.flex", lambda: rel_err(_flex_window(n, W, device)(qs, ks, vs), ref_sw))
    C, K = 64, 16
    qc, comp, win, hca = r(B, 8, 512), r(B, C, 512), r(B, 8, 512), r(B, 2, 512)
    idx = torch.randint(0, C, (B, K), generator=g).to(device)
    kv = torch.cat([torch.stack([comp[b, idx[b]] for b in range(B)]), win, hca], dim=1)
    check("compressed_decode", lambda: rel_err(compressed_attend(qc, comp, idx, win, hca), _ref_attn(qc, kv, kv)))
    qi, ki, wi = r(B, 8, 32), r(B, C, 32), r(B, 8)
    score = torch.einsum("bh,bhc->bc", wi.double(), torch.relu(qi.double() @ ki.double().transpose(1, 2)))
    ref_idx = torch.topk(score, K, dim=-1).indices

    def idx_overlap() -> float:  # fraction of the reference top-k found (bf16 rounding may swap ties)
        got = indexer(qi, ki, wi, K)
        return float(sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, ref_idx)) / ref_idx.numel())
    check("indexer_decode.topk_overlap", idx_overlap)
    x, wgu, wd = r(8, 64), r(2 * 32, 64) / 8, r(64, 32) / 6
    ref_ffn = (F.silu(x.double() @ wgu.double()[:32].T) * (x.double() @ wgu.double()[32:].T)) @ wd.double().T
    check("dense_ffn", lambda: rel_err(ffn(x, wgu, wd), ref_ffn))
    E, M = 4, 32
    xg = r(M, 64)
    wg, wdn = r(E, 64, 64) / 8, r(E, 64, 32) / 6  # [E, 2I, H], [E, H, I]
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (M // E)
    ref_moe = torch.cat([ffn(xg[e * 8:(e + 1) * 8].double(), wg[e].double(), wdn[e].double()) for e in range(E)])
    check("moe_grouped", lambda: rel_err(moe_grouped(xg, wg.transpose(1, 2), wdn.transpose(1, 2), offs), ref_moe))
    check("moe_loop", lambda: rel_err(moe_loop(xg, wg, wdn, [0, 8, 16, 24, 32]), ref_moe))
    return out


# ----------------------------------------------------------------------------- grid
def build_points(tiny: bool) -> list[tuple[str, dict]]:
    """(kind, shape) in run order; the tiny grid is a CPU smoke test."""
    if tiny:
        return [("gqa_decode", {"B": 2, "L": 256}), ("gqa_prefill", {"n": 256}),
                ("mla_decode", {"B": 2, "L": 256}), ("swa_decode", {"B": 2, "W": 64, "L": 512}),
                ("swa_prefill", {"n": 256, "W": 64}), ("compressed_decode", {"B": 2, "L": 4096}),
                ("indexer_decode", {"B": 2, "L": 4096}), ("dense_ffn", {"M": 16}), ("moe_grouped", {"M": 64})]
    pts: list[tuple[str, dict]] = []
    for B, L in ((8, 8192), (64, 2048), (64, 8192), (256, 2048), (128, 16384)):
        pts.append(("gqa_decode", {"B": B, "L": L}))
    for B, L in ((8, 8192), (64, 4096), (64, 16384), (128, 32768)):
        pts.append(("mla_decode", {"B": B, "L": L}))
    for B, W in ((64, 128), (256, 128), (64, 4096), (256, 4096)):
        pts.append(("swa_decode", {"B": B, "W": W, "L": 32768}))
    for B, L in ((8, 32768), (64, 8192), (64, 65536), (128, 131072)):
        pts.append(("compressed_decode", {"B": B, "L": L}))
    for B, L in ((8, 32768), (64, 8192), (64, 65536), (128, 131072)):
        pts.append(("indexer_decode", {"B": B, "L": L}))
    for M in (1, 16, 64, 256, 1024, 4096, 16384):
        pts.append(("dense_ffn", {"M": M}))
    for M in (64, 256, 1024, 4096, 16384, 65536):
        pts.append(("moe_grouped", {"M": M}))
    for n in (2048, 8192, 32768):
        pts.append(("gqa_prefill", {"n": n}))
    for n, W in ((8192, 128), (8192, 4096), (32768, 4096)):
        pts.append(("swa_prefill", {"n": n, "W": W}))
    return pts


def make_point(kind: str, shp: dict, device: torch.device, dtype: torch.dtype, tiny: bool) -> list[dict]:
    """Tensors for one point: a list of {impl, fn, flops, bytes} (several implementations of one
    kind are timed and reported separately; the summary takes the fastest)."""
    bs = torch.finfo(dtype).bits // 8
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    hq, hkv, hd = (4, 2, 64) if tiny else (32, 8, 128)
    if kind in ("gqa_decode", "swa_decode"):
        B = shp["B"]
        L = shp.get("L")
        n = shp.get("W", L)
        q = r(B, hkv, hq // hkv, hd)
        k, v = r(B, hkv, L, hd), r(B, hkv, L, hd)
        ks, vs = k[:, :, L - n:], v[:, :, L - n:]
        return [{"impl": "sdpa_flash", "fn": lambda: gqa_decode(q, ks, vs),
                 "flops": 4.0 * B * hq * hd * n, "bytes": 2.0 * B * hkv * n * hd * bs + 2.0 * B * hq * hd * bs}]
    if kind == "gqa_prefill":
        n = shp["n"]
        q, k, v = r(1, hq, n, hd), r(1, hq, n, hd), r(1, hq, n, hd)
        return [{"impl": "sdpa_flash", "fn": lambda: _sdpa_flash(q, k, v, is_causal=True),
                 "flops": 4.0 * hq * hd * n * (n + 1) / 2, "bytes": 4.0 * n * hq * hd * bs}]
    if kind == "swa_prefill":
        n, W = shp["n"], shp["W"]
        q, k, v = r(1, hq, n, hd), r(1, hkv, n, hd), r(1, hkv, n, hd)
        pairs = W * (W + 1) / 2 + (n - W) * W if n > W else n * (n + 1) / 2
        nbytes = (2.0 * n * hq * hd + 2.0 * n * hkv * hd) * bs
        flex = _flex_window(n, W, device)
        kx, vx = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        return [{"impl": "flex_window", "fn": lambda: flex(q, k, v), "flops": 4.0 * hq * hd * pairs, "bytes": nbytes,
                 "graph": False},  # a compiled Triton kernel: eager launches (one kernel, ms-long)
                {"impl": "dense_causal_sdpa", "fn": lambda: _sdpa_flash(q, kx, vx, is_causal=True),
                 "flops": 4.0 * hq * hd * pairs, "bytes": nbytes}]
    if kind == "mla_decode":
        B, L = shp["B"], shp["L"]
        H = 8 if tiny else 128
        q, lat = r(B, H, 576), r(B, L, 576)
        fl, nb = B * H * 2.0 * (576 + 512) * L, B * L * 576.0 * bs + B * H * (576 + 512) * bs
        return [{"impl": "bmm", "fn": lambda: mla_bmm(q, lat), "flops": fl, "bytes": nb},
                {"impl": "sdpa", "fn": lambda: mla_sdpa(q, lat), "flops": fl, "bytes": nb}]
    if kind == "compressed_decode":
        B, L = shp["B"], shp["L"]
        H, K, Wn = (8, 64, 16) if tiny else (64, 512, 128)
        C, nh = L // 4, L // 128
        q, comp, win, hca = r(B, H, 512), r(B, C, 512), r(B, Wn, 512), r(B, nh, 512)
        idx = torch.randint(0, C, (B, K), device=device)
        n = K + Wn + nh
        return [{"impl": "gather_bmm", "fn": lambda: compressed_attend(q, comp, idx, win, hca),
                 "flops": B * H * 2.0 * 2 * 512 * n, "bytes": B * n * 512.0 * bs + 2.0 * B * H * 512 * bs}]
    if kind == "indexer_decode":
        B, L = shp["B"], shp["L"]
        H, K = (8, 64) if tiny else (64, 512)
        C = L // 4
        qi, ki, w = r(B, H, 128), r(B, C, 128), r(B, H)
        return [{"impl": "bmm_topk", "fn": lambda: indexer(qi, ki, w, K),
                 "flops": B * H * 2.0 * 128 * C, "bytes": B * C * 128.0 * bs}]
    if kind == "dense_ffn":
        M = shp["M"]
        Hd, I = (256, 512) if tiny else (4096, 14336)
        x, wgu, wd = r(M, Hd), r(2 * I, Hd) * Hd ** -0.5, r(Hd, I) * I ** -0.5
        return [{"impl": "linear", "fn": lambda: ffn(x, wgu, wd), "flops": 2.0 * M * 3 * Hd * I,
                 "bytes": 3.0 * Hd * I * bs + 2.0 * M * Hd * bs}]
    if kind == "moe_grouped":
        M = shp["M"]
        E, Hd, I = (4, 256, 128) if tiny else (8, 4096, 2048)
        m = max(1, M // E)
        M = m * E
        x = r(M, Hd)
        wgu, wd = r(E, 2 * I, Hd) * Hd ** -0.5, r(E, Hd, I) * I ** -0.5
        offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * m
        bounds = [e * m for e in range(E + 1)]
        fl, nb = 2.0 * M * 3 * Hd * I, 3.0 * E * Hd * I * bs + 2.0 * M * Hd * bs
        wgu_t, wd_t = wgu.transpose(1, 2), wd.transpose(1, 2)
        return [{"impl": "grouped_mm", "fn": lambda: moe_grouped(x, wgu_t, wd_t, offs), "flops": fl, "bytes": nb},
                {"impl": "loop_mm", "fn": lambda: moe_loop(x, wgu, wd, bounds), "flops": fl, "bytes": nb}]
    raise ValueError(f"unknown kind {kind!r}")


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # pdlb_cli.arg_types (standard library only)
    from pdlb_cli.arg_types import positive_float
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--name", default=None, help="file stem (default <gpu>_kernel_kinds)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--no-graphs", action="store_true", help="time eager launches, no CUDA graphs")
    ap.add_argument("--budget-s", type=positive_float, default=200.0, help="skip the points left after this many seconds")
    ap.add_argument("--kinds", default=None, help="comma-separated subset of kinds")
    args = ap.parse_args(argv)
    device = torch_device(args.device, "bench/gpu_kinds.py")
    if device is None:
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.time()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    stem = args.name or f"{gpu.replace('NVIDIA ', '').replace(' ', '-').lower()}_kernel_kinds"
    os.makedirs(args.out, exist_ok=True)
    meta = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": str(dtype),
            "python": platform.python_version(), "script": "bench/gpu_kinds.py",
            "argv": sys.argv[1:] if argv is None else argv,
            "roofline": {"peak_flops": PEAK_FLOPS, "hbm_bytes_s": HBM_BYTES_S, "mfu": DEFAULT_MFU, "mbu": DEFAULT_MBU}}
    print(json.dumps(meta), flush=True)
    checks = run_checks(device, dtype)
    print("checks:", json.dumps(checks), flush=True)
    ceil = {}
    if device.type == "cuda":
        try:
            ceil = ceilings(device)
        except Exception as e:  # noqa: BLE001
            ceil = {"error": repr(e)}
        print("ceilings:", json.dumps(ceil), flush=True)
    meas_peak = ceil.get("bf16_matmul_8192_tflops", 0) * 1e12 or None
    meas_bw = ceil.get("copy_4GiB_read_plus_write_gbs", 0) * 1e9 or None
    timer = Timer(device, not args.no_graphs, 0.15 if device.type == "cuda" else 0.02, 3, 30, 2)
    wanted = set(args.kinds.split(",")) if args.kinds else None
    points, skipped = [], []
    for kind, shp in build_points(args.tiny):
        if wanted is not None and kind not in wanted:
            continue
        if time.time() - t0 > args.budget_s:
            skipped.append({"kind": kind, **shp})
            continue
        try:
            impls = make_point(kind, shp, device, dtype, args.tiny)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: report and go on)
            points.append({"kind": kind, "shape": shp, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        for im in impls:
            rec = {"kind": kind, "impl": im["impl"], "shape": shp, "flops": im["flops"], "bytes": im["bytes"]}
            try:
                fn = im["fn"]
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    torch.cuda.synchronize(device)
                    est = a.elapsed_time(b) / 1e3
                else:
                    s = time.perf_counter()
                    fn()
                    est = time.perf_counter() - s
                inner = int(min(64, max(1, math.ceil(1e-3 / max(est, 1e-7))))) if device.type == "cuda" else 1
                rep = (lambda f=fn, k=inner: [f() for _ in range(k)])
                eager = Timer(device, False, timer.target_s, 3, 30, 2)
                if im.get("graph", True):
                    try:
                        m = timer.measure(rep)
                    except Exception:  # noqa: BLE001 (graph capture failed: time eager launches)
                        m = eager.measure(rep)
                        m["graph_failed"] = True
                else:
                    m = eager.measure(rep)
                t = m["median_s"] / inner
                pred = roofline_s(im["flops"], im["bytes"])
                rec.update(time_s=t, inner=inner, reps=m["reps"], graph=m["graph"] and not m.get("graph_failed"),
                           spread=(m["max_s"] - m["min_s"]) / m["median_s"],
                           roofline_s=pred, err=pred / t - 1,
                           achieved_tflops=im["flops"] / t / 1e12, achieved_gbs=im["bytes"] / t / 1e9)
                if meas_peak and meas_bw:
                    ideal = roofline_s(im["flops"], im["bytes"], meas_peak, meas_bw, 1.0, 1.0)
                    rec["ideal_s"], rec["err_ideal"] = ideal, ideal / t - 1
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if os.environ.get("PDLB_KINDS_TRACE"):
                    traceback.print_exc()
            points.append(rec)
            msg = (f"{kind:18s} {im['impl']:18s} {json.dumps(shp):34s} "
                   + (f"{1e3 * rec['time_s']:9.4f} ms  roofline {1e3 * rec['roofline_s']:9.4f} ms  err {100 * rec['err']:+6.1f}%"
                      if "time_s" in rec else rec.get("error", "")))
            print(msg, flush=True)
        del impls
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = summarize(points)
    doc = {**meta, "elapsed_s": time.time() - t0, "checks": checks, "ceilings": ceil, "points": points,
           "skipped": skipped, "summary": summary}
    path = os.path.join(args.out, stem + ".json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("summary (fastest implementation per point; err = roofline / measured - 1):")
    for kind, s in summary.items():
        print(f"  {kind:18s} n={s['points']:2d} median err {100 * s['median_err']:+6.1f}%  "
              f"range {100 * s['min_err']:+6.1f}% .. {100 * s['max_err']:+6.1f}%  impls {s['impls']}")
    print(f"wrote {path} ({len(points)} points, {len(skipped)} skipped, {time.time() - t0:.0f} s)")
    return 0


def summarize(points: list[dict]) -> dict:
    """Per kind: the fastest implementation of each shape; median / min / max of its ``err``."""
    best: dict[tuple[str, str], dict] = {}
    for p in points:
        if "time_s" not in p:
            continue
        key = (p["kind"], json.dumps(p["shape"], sort_keys=True))
        if key not in best or p["time_s"] < best[key]["time_s"]:
            best[key] = p
    out: dict[str, dict] = {}
    for (kind, _), p in sorted(best.items()):
        out.setdefault(kind, []).append(p)
    res = {}
    for kind, ps in out.items():
        errs = [p["err"] for p in ps]
        res[kind] = {"points": len(ps), "median_err": statistics.median(errs), "min_err": min(errs),
                     "max_err": max(errs), "impls": sorted({p["impl"] for p in ps})}
    return res


if __name__ == "__main__":
    sys.exit(main())
