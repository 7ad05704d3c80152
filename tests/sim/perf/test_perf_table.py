"""Measured-table perf model: hand-checked interpolation (numbers worked out in the comments)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.perf import PerfModel, RooflinePerf, causal_attn_pairs
from sim.perf.table import PROFILE_DIR, TablePerf, profile_path, read_profile

SHIPPED = PROFILE_DIR / "h200_llama-3.1-8b_bf16.csv"
HEADER = "kind,prefill_tokens,cached_tokens,batch,ctx_tokens,time_s\n"


def one(perf, pt, pp, ds, dc) -> float:
    return float(perf.step_time_s([pt], [pp], [ds], [dc]))


# ----------------------------------------------------------------------------- a synthetic table
SYNTH = HEADER + """\
prefill,100,0,1,0,0.010
prefill,200,0,1,0,0.020
prefill,400,0,1,0,0.050
prefill,100,1000,1,0,0.0101
prefill,100,3000,1,0,0.0103
prefill,400,1000,1,0,0.0508
decode,0,0,1,100,0.005
decode,0,0,1,300,0.006
decode,0,0,3,100,0.007
decode,0,0,3,300,0.010
"""


@pytest.fixture()
def synth(tmp_path):
    p = tmp_path / "synth.csv"
    p.write_text("# pdlb GPU profile: llama-3.1-8b (synthetic)\n" + SYNTH)
    return TablePerf(p, model="llama-3.1-8b", hardware="h200")


def test_synthetic_alpha_and_linear_part(synth):
    # alpha(100): rows (100, 1000) and (100, 3000) sit 1e-4 and 3e-4 s above t(100, 0) = 0.010 at
    # n*p = 1e5 and 3e5 pairs -> least squares through 0: (1e5*1e-4 + 3e5*3e-4) / (1e10 + 9e10) = 1e-9.
    # alpha(400): (0.0508 - 0.050) / (400 * 1000) = 2e-9.
    assert synth.alpha_points == [(100, pytest.approx(1e-9)), (400, pytest.approx(2e-9))]
    # alpha(200): ln 200 halfway between ln 100 and ln 400 -> 1.5e-9; outside held flat
    assert synth.alpha(200) == pytest.approx(1.5e-9)
    assert synth.alpha(10) == pytest.approx(1e-9) and synth.alpha(10_000) == pytest.approx(2e-9)
    # L(n) = t(n, 0) - alpha(n) * n(n+1)/2:
    # L(100) = 0.010 - 1e-9 * 5050 = 0.00999495; L(200) = 0.020 - 1.5e-9 * 20100 = 0.01996985;
    # L(400) = 0.050 - 2e-9 * 80200 = 0.0498396
    assert synth.linear_time_s([100, 200, 400]) == pytest.approx([0.00999495, 0.01996985, 0.0498396])
    # linear extrapolation past 400 from (200, 400): slope (0.0498396 - 0.01996985) / 200
    # = 1.4934875e-4 per token -> L(500) = 0.0498396 + 100 * 1.4934875e-4 = 0.064774475
    assert float(synth.linear_time_s(500)) == pytest.approx(0.064774475)


def test_synthetic_prefill(synth):
    # grid rows come back exactly: t(200, causal) = L(200) + alpha(200) * 20100 = 0.020
    assert one(synth, 200, causal_attn_pairs(200, 0), 0, 0) == pytest.approx(0.020)
    # T = 150 (no prefix, P = 150 * 151 / 2 = 11325):
    # L(150) = (0.00999495 + 0.01996985) / 2 = 0.0149824
    # alpha(150) = 1e-9 * (1 + ln(1.5) / ln(4)) = 1e-9 * 1.29248125 = 1.29248125e-9
    # t = 0.0149824 + 1.29248125e-9 * 11325 = 0.0149824 + 1.46373502e-5 = 0.01499703735
    assert one(synth, 150, 11_325, 0, 0) == pytest.approx(0.01499703735)
    # after a 2000-token prefix: P = 150 * 2000 + 11325 = 311325
    # t = 0.0149824 + 1.29248125e-9 * 311325 = 0.0149824 + 4.02381727e-4 = 0.01538478173
    assert one(synth, 150, causal_attn_pairs(150, 2000), 0, 0) == pytest.approx(0.01538478173)
    # pairs below T are clipped to T (each token sees itself): P=0 prices as P=150
    assert one(synth, 150, 0, 0, 0) == pytest.approx(one(synth, 150, 150, 0, 0))


def test_synthetic_decode(synth):
    # grid rows: (b=3, ctx 300) -> C = 900 -> 0.010
    assert one(synth, 0, 0, 3, 900) == pytest.approx(0.010)
    # B = 2, C = 600. Row b=1 (C 100 -> 0.005, 300 -> 0.006) extrapolated: slope 5e-6 per token,
    # 0.006 + 300 * 5e-6 = 0.0075. Row b=3 (C 300 -> 0.007, 900 -> 0.010): halfway -> 0.0085.
    # B = 2 is halfway between 1 and 3 -> 0.008
    assert one(synth, 0, 0, 2, 600) == pytest.approx(0.008)
    # B = 5 (beyond the rows) at C = 900: row 1 at 900 = 0.006 + 600 * 5e-6 = 0.009; row 3 = 0.010;
    # slope per sequence 0.0005 -> 0.010 + 2 * 0.0005 = 0.011
    assert one(synth, 0, 0, 5, 900) == pytest.approx(0.011)
    # no work: 0
    assert one(synth, 0, 0, 0, 0) == 0.0


def test_synthetic_mixed_step(synth):
    # prefill T = 100 (P = 5050) next to B = 1 decode with C = 300:
    # t_dec(1, 300) = 0.006
    # L(101) - L(1): L is linear between 100 and 200 (slope (0.01996985 - 0.00999495) / 100
    # = 9.97490e-5 per token) and extrapolated below 100 with the same slope -> 100 * 9.97490e-5
    # = 0.0099749; alpha(100) * 5050 = 5.05e-6
    # t = 0.006 + 0.0099749 + 0.00000505 = 0.01597995
    assert one(synth, 100, 5050, 1, 300) == pytest.approx(0.01597995)


def test_synthetic_vectorised_and_rank_max(synth):
    # leading axes broadcast; the rank axis is reduced with max (independent dense ranks)
    k = np.array([[0.0], [0.0]])
    got = synth.step_time_s(k, k, np.array([[3.0], [2.0]]), np.array([[900.0], [600.0]]))
    assert got.shape == (2,) and got == pytest.approx([0.010, 0.008])
    two = synth.step_time_s([0, 0], [0, 0], [3, 2], [900, 600])
    assert two.shape == () and float(two) == pytest.approx(0.010)
    # overhead is added per busy step
    p = synth.path
    assert one(TablePerf(p, step_overhead_s=1e-3), 0, 0, 3, 900) == pytest.approx(0.011)


def test_bad_tables(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("kind,tokens,time_s\nprefill,1,0.1\n")
    with pytest.raises(ValueError, match="columns"):
        TablePerf(bad)
    nocache = tmp_path / "nocache.csv"
    nocache.write_text(HEADER + "prefill,100,0,1,0,0.01\nprefill,200,0,1,0,0.02\n"
                       "decode,0,0,1,100,0.005\ndecode,0,0,2,100,0.006\n")
    with pytest.raises(ValueError, match="cached-prefix"):
        TablePerf(nocache)
    neg = tmp_path / "neg.csv"
    neg.write_text(HEADER + "decode,0,0,1,100,-1\n")
    with pytest.raises(ValueError, match="bad row"):
        TablePerf(neg)


# ----------------------------------------------------------------------------- the shipped H200 profile
@pytest.fixture(scope="module")
def h200():
    return TablePerf.for_engine("llama-3.1-8b", "h200", num_dp_ranks=1)


def test_shipped_profile_is_a_perf_model(h200):
    assert SHIPPED.exists() and profile_path("llama-3.1-8b", "H200") == SHIPPED
    assert isinstance(h200, PerfModel)
    assert h200.ep_synchronous is False
    # 2 (K, V) * 32 layers * 8 KV heads * 128 * 2 B = 131,072 B per token
    assert h200.kv_bytes_per_token == 131_072
    # (141e9 * 0.9 - 8,030,261,248 * 2 B - 2e9) / 131,072 = 108,839,477,504 / 131,072 = 830,379.9
    assert h200.kv_capacity_tokens_per_rank == 830_379
    rf = RooflinePerf.for_engine("llama-3.1-8b", "h200", num_dp_ranks=1)
    assert h200.kv_capacity_tokens_per_rank == rf.kv_capacity_tokens_per_rank
    rows, header = read_profile(SHIPPED)
    assert "H200" in header[1] and "llama-3.1-8b" in header[0]
    assert sum(r.kind == "prefill" for r in rows) == 24 and sum(r.kind == "decode" for r in rows) == 48
    # every decode point's KV cache fits the documented 80 GB cap (<= 524,288 tokens)
    assert max(r.batch * r.ctx_tokens for r in rows if r.kind == "decode") == 524_288


def test_shipped_grid_rows_reproduced(h200):
    rows, _ = read_profile(SHIPPED)
    for r in rows:
        if r.kind == "decode":
            assert one(h200, 0, 0, r.batch, r.batch * r.ctx_tokens) == pytest.approx(r.time_s, rel=1e-12)
        elif r.cached_tokens == 0:
            pairs = causal_attn_pairs(r.prefill_tokens, 0)
            assert one(h200, r.prefill_tokens, pairs, 0, 0) == pytest.approx(r.time_s, rel=1e-12)
        else:  # cached-prefix rows go through the fitted per-pair slope: within 2% on this profile
            pairs = causal_attn_pairs(r.prefill_tokens, r.cached_tokens)
            assert one(h200, r.prefill_tokens, pairs, 0, 0) == pytest.approx(r.time_s, rel=0.02)


def test_shipped_hand_interpolation(h200):
    # decode, between ctx rows: b=64 rows C=131072 (ctx 2048) -> 1.292514e-02 and C=262144
    # (ctx 4096) -> 2.021792e-02; C = 196608 (ctx 3072) is halfway -> 1.657153e-02
    assert one(h200, 0, 0, 64, 64 * 3072) == pytest.approx(1.657153e-02, rel=1e-6)
    # decode, between batch rows: B = 48, C = 98304 (ctx 2048 each).
    # row 32: C 65536 -> 9.451184e-03, 131072 -> 1.257678e-02, halfway -> 1.1013982e-02
    # row 64: C 65536 -> 9.641344e-03, 131072 -> 1.292514e-02, halfway -> 1.1283242e-02
    # B = 48 halfway between 32 and 64 -> 1.1148612e-02
    assert one(h200, 0, 0, 48, 98_304) == pytest.approx(1.1148612e-02, rel=1e-6)
    # decode beyond the measured context: b=256 rows C=262144 -> 2.394952e-02, 524288 -> 3.841259e-02;
    # C = 655360 is 131072 past the end: + 0.5 * 1.446307e-02 -> 4.5644125e-02
    assert one(h200, 0, 0, 256, 655_360) == pytest.approx(4.5644125e-02, rel=1e-6)
    # decode beyond the largest batch: at C = 524288 rows b=128 -> 3.522695e-02, b=256 -> 3.841259e-02;
    # B = 512 -> 3.841259e-02 + 256 * 3.18564e-03 / 128 = 4.478387e-02
    assert one(h200, 0, 0, 512, 524_288) == pytest.approx(4.478387e-02, rel=1e-6)
    # prefill attention slope at n = 512: rows p = 2048, 8192, 32768 are 1.79060e-03, 7.12495e-03,
    # 2.874360e-02 s above t(512, 0) = 1.500562e-02. Least squares through 0 in x = 512 * p:
    # sum(p*y) = 2048*1.79060e-03 + 8192*7.12495e-03 + 32768*2.874360e-02 = 1003.905024 (ms-ish units: s*tok)
    # sum(p^2) = 2048^2 + 8192^2 + 32768^2 = 1,145,044,992
    # alpha(512) = 1003.905024 / 1,145,044,992 / 512 = 1.71238e-09 s per pair
    assert float(h200.alpha(512)) == pytest.approx(1.71238e-09, rel=1e-5)
    # 512 new tokens after a 4096 prefix (not a row): t(512, 0) + alpha(512) * 512 * 4096
    # = 1.500562e-02 + 1.71238e-09 * 2,097,152 = 1.500562e-02 + 3.59112e-03 = 1.859674e-02
    assert one(h200, 512, causal_attn_pairs(512, 4096), 0, 0) == pytest.approx(1.859674e-02, rel=1e-5)


def test_shipped_monotone(h200):
    # more decode sequences or more context never makes the step faster (on and off the grid)
    b = np.array([1, 2, 3, 5, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384], dtype=float)
    for ctx in (256.0, 1024.0, 3000.0, 9000.0):
        t = h200.step_time_s(np.zeros((len(b), 1)), np.zeros((len(b), 1)), b[:, None], (b * ctx)[:, None])
        assert np.all(np.diff(t) > 0), ctx
    c = np.linspace(1_000, 900_000, 50)
    for bb in (1.0, 7.0, 100.0, 256.0):
        t = h200.step_time_s(np.zeros((50, 1)), np.zeros((50, 1)), np.full((50, 1), bb), c[:, None])
        assert np.all(np.diff(t) > 0), bb
    n = np.array([1, 8, 16, 100, 1000, 5000, 20000, 40000, 65536], dtype=float)
    t = h200.step_time_s(n[:, None], causal_attn_pairs(n, 0)[:, None], np.zeros((len(n), 1)),
                         np.zeros((len(n), 1)))
    assert np.all(np.diff(t) > 0) and t[0] > 0.005  # even one token streams the weights (~6 ms)
    assert math.isfinite(float(t[-1]))


def test_for_engine_limits():
    with pytest.raises(ValueError, match="gpus_per_rank"):
        TablePerf.for_engine("llama-3.1-8b", "h200", gpus_per_rank=2)
    with pytest.raises(ValueError, match="no measured profile"):
        TablePerf.for_engine("llama-3.1-70b", "h200")
    with pytest.raises(ValueError, match="dense engine"):
        TablePerf(SHIPPED, model="deepseek-v3")
    with pytest.raises(ValueError, match="does not look like"):
        TablePerf(SHIPPED, model="llama-3.1-70b")
