#!/usr/bin/env python3
"""Measure one layer's decode attention of the kinds the new models need, against the roofline.

Standalone (JAX only, no pdlb import), so it runs on the device machine's image. Kinds, one
decode query token per sequence, bf16, random data:

* ``mla``: DeepSeek-V3 weight-absorbed MLA, 128 heads over a 576-wide latent (512 + 64 RoPE) of
  ``L`` tokens; the output uses the first 512 dims. FLOPs ``B * 128 * 2 * (576 + 512) * L``,
  bytes ``B * L * 576 * 2``.
* ``compressed``: one DeepSeek-V4 CSA layer: gather ``640 + L / 128`` rows (512 top-k + 128
  window + the HCA rows, as ``ModelSpec.decode_attended_keys``) of a ``L / 4``-row compressed cache
  at random indices, then MQA with 64 heads of 512 dims (K = V). Rows are bf16 here (1,024 B; the
  checkpoint's FP8 rows are 584 B). FLOPs ``B * 64 * 2 * 1024 * n``, bytes ``B * n * 1024``.
* ``swaW``: GQA (32 query heads, 8 KV heads of 128) over a sliding window of ``W`` tokens.

Each kernel is jitted and timed from Python (median of 7 calls with ``block_until_ready``), so
small kernels carry the host dispatch floor (~0.1 ms on the H200 image). The roofline prediction
is ``max(FLOPs / (989 TFLOP/s * 0.5), bytes / (4.8 TB/s * 0.7))`` (the H200 and the default
efficiencies); ``err = roofline / measured - 1``. These are XLA's kernels, not FlashMLA's or the
sparse-attention kernels serving engines run: the numbers bound how far a plain implementation is
from the roofline, they do not validate production kernels.

    python bench/attention_kinds_jax.py [SCALE]     # SCALE < 1 shrinks the grid (CPU smoke test)
"""
import json
import math
import sys
import time

USAGE = "usage: python bench/attention_kinds_jax.py [SCALE]  (SCALE: a number > 0, default 1; < 1 shrinks the grid)"


def parse_scale(argv: list[str]) -> float:
    """SCALE from the arguments: ``-h`` / ``--help`` prints this script's doc and exits 0; anything
    but one finite number > 0 is one ``error:`` line and exit status 2 (before JAX is imported)."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + USAGE)
        sys.exit(0)
    if len(argv) > 1:
        print(f"{USAGE}\nerror: expected at most one argument (SCALE), got {len(argv)}", file=sys.stderr)
        sys.exit(2)
    if not argv:
        return 1.0
    try:
        scale = float(argv[0])
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        print(f"{USAGE}\nerror: SCALE must be a finite number > 0, got {argv[0]!r}", file=sys.stderr)
        sys.exit(2)
    return scale


S = parse_scale(sys.argv[1:]) if __name__ == "__main__" else 1.0
try:
    import jax
    import jax.numpy as J
except ImportError:  # the device machine's image has it; a development machine may not
    sys.exit("error: bench/attention_kinds_jax.py needs JAX (pip install jax; it runs on the GPU host's image, "
             "docs/gpu_profile.md)")

BF = J.bfloat16
PEAK, HBM = 989e12, 4.8e12


def tm(f, *a):
    f = jax.jit(f)
    f(*a).block_until_ready()
    t = []
    for _ in range(7):
        s = time.perf_counter()
        f(*a).block_until_ready()
        t.append(time.perf_counter() - s)
    return sorted(t)[3]


def sm(x):
    return jax.nn.softmax(x.astype(J.float32), -1).astype(BF)


def main() -> None:
    k = jax.random.PRNGKey(0)

    def r(*s):
        return jax.random.normal(k, s, BF)

    for B, L in [(8, 2048), (32, 4096), (64, 8192), (128, 8192)]:
        B, L = max(1, int(B * S)), max(512, int(L * S))
        q, kv = r(B, 128, 576), r(B, L, 576)
        t = tm(lambda q, kv: J.einsum("bhl,bld->bhd", sm(J.einsum("bhd,bld->bhl", q, kv)), kv[..., :512]), q, kv)
        rows = [("mla", t, B * 128 * 2 * 1088 * L, B * L * 576 * 2)]
        n = 640 + L // 128
        q4, c = r(B, 64, 512), r(B, L // 4, 512)
        ix = jax.random.randint(k, (B, n), 0, L // 4)

        def csa(q4, c, ix):
            g = J.take_along_axis(c, ix[..., None], 1)
            return J.einsum("bhl,bld->bhd", sm(J.einsum("bhd,bld->bhl", q4, g)), g)

        rows.append(("compressed", tm(csa, q4, c, ix), B * 64 * 2 * 1024 * n, B * n * 1024 + B * n * 4))
        for W in (128, 4096):
            W = min(W, L)
            qg, kk, vv = r(B, 8, 4, 128), r(B, 8, W, 128), r(B, 8, W, 128)
            f = lambda q, k_, v: J.einsum("bgqw,bgwd->bgqd", sm(J.einsum("bgqd,bgwd->bgqw", q, k_)), v)  # noqa: E731
            rows.append((f"swa{W}", tm(f, qg, kk, vv), B * 32 * 4 * 128 * W, B * W * 8 * 128 * 4))
        for kind, t, fl, by in rows:
            roof = max(fl / (PEAK * 0.5), by / (HBM * 0.7))
            print(json.dumps(dict(kind=kind, B=B, L=L, meas_us=round(t * 1e6, 1), roof_us=round(roof * 1e6, 1),
                                  err=round(roof / t - 1, 3), bound="compute" if fl / PEAK > by / HBM else "memory")))


if __name__ == "__main__":
    main()
