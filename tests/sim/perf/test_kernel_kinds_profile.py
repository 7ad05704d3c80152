"""The recorded H200 kernel-kinds profile (sim/data/profiles/h200_kernel_kinds.json, written by
bench/gpu_kinds.py) charges the FLOPs the simulator's model formulas give for the same shapes.

Independent implementation: ``sim.models.spec.ModelSpec`` (per (query, key) pair FLOPs of each
model, expert and FFN widths) against the numbers the benchmark wrote; and the recorded errors
against ``roofline / measured - 1`` recomputed from the recorded FLOPs, bytes and times.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.models.presets import get_model

PROFILE = Path(__file__).resolve().parents[3] / "sim" / "data" / "profiles" / "h200_kernel_kinds.json"


def _points():
    doc = json.loads(PROFILE.read_text())
    return doc, [p for p in doc["points"] if "time_s" in p]


def test_profile_covers_every_kind_and_checks_passed():
    doc, pts = _points()
    kinds = {p["kind"] for p in pts}
    assert kinds == {"gqa_decode", "gqa_prefill", "mla_decode", "swa_decode", "swa_prefill", "compressed_decode",
                     "indexer_decode", "dense_ffn", "moe_grouped"}
    assert doc["gpu"] == "NVIDIA H200" and not doc["skipped"]
    # every kernel matched its float64 reference to bf16 accuracy before it was timed
    errs = {k: v for k, v in doc["checks"].items() if not k.endswith("overlap")}
    assert all(isinstance(v, float) and v < 1e-2 for v in errs.values()), errs
    assert doc["checks"]["indexer_decode.topk_overlap"] == 1.0


def test_recorded_flops_match_the_model_formulas():
    _, pts = _points()
    llama, v3, v4 = get_model("llama-3.1-8b"), get_model("deepseek-v3"), get_model("deepseek-v4-flash")
    for p in pts:
        s, k = p["shape"], p["kind"]
        if k in ("gqa_decode", "swa_decode"):  # one layer of Llama-3.1-8B over L (or the window W)
            want = s["B"] * llama.attn_flops_per_pair / llama.num_layers * s.get("W", s.get("L"))
        elif k == "mla_decode":  # one absorbed-MLA layer of DeepSeek-V3
            want = s["B"] * v3.attn_flops_per_pair / v3.num_layers * s["L"]
        elif k == "compressed_decode":  # V4 rows: 512 top-k + 128 window + L/128 HCA rows
            want = s["B"] * v4.attn_flops_per_pair * (v4.index_topk + v4.sliding_window + s["L"] / 128)
        elif k == "indexer_decode":  # one CSA layer's indexer over L/4 compressed keys
            want = s["B"] * v4.indexer_flops_per_pair * s["L"] / 4
        elif k == "dense_ffn":  # SwiGLU: 3 matrices of hidden x intermediate
            want = 2 * s["M"] * 3 * llama.hidden_size * llama.intermediate_size
        elif k == "moe_grouped":  # routed copies through V4-Flash-shaped experts
            want = 2 * s["M"] * 3 * v4.hidden_size * v4.moe_intermediate_size
        elif k == "gqa_prefill":  # causal: n (n + 1) / 2 pairs
            want = llama.attn_flops_per_pair / llama.num_layers * s["n"] * (s["n"] + 1) / 2
        else:  # swa_prefill: the pairs inside the window only
            n, w = s["n"], s["W"]
            want = llama.attn_flops_per_pair / llama.num_layers * (w * (w + 1) / 2 + (n - w) * w)
        assert p["flops"] == pytest.approx(want, rel=1e-12), (k, s)


def test_recorded_errors_are_roofline_over_measured():
    doc, pts = _points()
    r = doc["roofline"]
    for p in pts:
        pred = max(p["flops"] / (r["peak_flops"] * r["mfu"]), p["bytes"] / (r["hbm_bytes_s"] * r["mbu"]))
        assert p["roofline_s"] == pytest.approx(pred, rel=1e-12)
        assert p["err"] == pytest.approx(pred / p["time_s"] - 1, rel=1e-9)
    # the per-kind summary takes the fastest implementation of each shape
    for kind, s in doc["summary"].items():
        best = {}
        for p in pts:
            if p["kind"] == kind:
                key = json.dumps(p["shape"], sort_keys=True)
                best[key] = min(best.get(key, p), p, key=lambda q: q["time_s"])
        errs = sorted(q["err"] for q in best.values())
        assert s["points"] == len(errs) and s["min_err"] == pytest.approx(errs[0]) and s["max_err"] == pytest.approx(errs[-1])


_NO_TORCH = """
import runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch is not installed (blocked by the test)")
sys.meta_path.insert(0, Refuse())
sys.argv = [SCRIPT, *ARGS]
sys.path.insert(0, SCRIPT.rsplit("/", 1)[0])  # as 'python bench/x.py' does
runpy.run_path(SCRIPT, run_name="__main__")
"""


@pytest.mark.parametrize("script, args", [("bench/gpu_kinds.py", []), ("bench/gpu_profile.py", []),
                                          ("bench/gpu_profile.py", ["--kinds"])])
def test_gpu_benches_give_help_without_pytorch_and_say_what_is_missing(script, args):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]

    def run(*extra):
        prog = f"SCRIPT = {script!r}\nARGS = {[*args, *extra]!r}\n" + _NO_TORCH
        return subprocess.run([sys.executable, "-c", prog], cwd=root, capture_output=True, text=True, timeout=60)

    helped = run("--help")
    assert helped.returncode == 0 and "--out" in helped.stdout, helped.stderr
    ran = run("--out", "unused-dir")
    name = "gpu_profile.py" if args == [] and script.endswith("gpu_profile.py") else "gpu_kinds.py"
    assert ran.returncode == 2
    assert ran.stderr.strip().splitlines() == [f"error: bench/{name} needs PyTorch (the device machine's image has it; "
                                               "on a CPU: pip install torch)"]
    assert not (root / "unused-dir").exists()
