"""``pdlb sim validate``: the perf model against published deployment figures.

Each :class:`Figure` is a number a deployment published (SIMULATORS.md quotes them with their
sources) and the workload that produced it, run through the roofline of the matching shipped
preset (``sim/data/presets``). Throughput figures are steady-state: every DP rank of the unit holds
the same work and the step time comes from :meth:`RooflinePerf.step_time_breakdown`; per-node
rates count ``gpus_per_node`` GPUs. Error = simulated / published - 1; a figure passes within
+-15%.

Calibration: one named figure (``CALIBRATION_POINT``, SGLang decode) fits ONE number, a common
derating ``s`` of the roofline's default peak fractions (``mfu``, ``mbu``, ``comm_efficiency``;
``step_overhead_s`` stays at its default), so that the simulated figure equals the published one.
``pdlb sim validate --calibrate sglang-decode-2k`` prints the fitted constants; they are written
into the shipped presets' ``[perf]`` tables. Every other figure is held out.

Workload assumptions (not published, stated where used):

* prefill: 16,384 new tokens per GPU per step (the SGLang benchmark's per-device batch, sourced:
  the blog's "16,384 tokens per device", its reproduction's chunked-prefill-size 524,288 / 32 ranks), i.e.
  16 x 1K, 8 x 2K, 4 x 4K prompts; DeepSeek's prefill: prompts of 4,383 tokens, 56.3% cached.
  4,384 is derived from the day-6 numbers: output/input = 168B / 608B = 0.276 and the average KV
  length per output token ``L + O/2 = 4,989`` give ``L = 4,989 / (1 + 0.138) = 4,383``.
* DeepSeek decode: 88 sequences per GPU (14.8k tok/s per node / 8 GPUs / 21 tok/s per sequence),
  context 4,989 tokens, MTP: each step verifies 2 tokens per sequence and yields 1.875 (second-token
  acceptance 85-90%, DeepSeek-V3 paper sec. 5.4.3).
* DeepInfer (``deepinfer-sm100``, DeepSeek-V4.1-Flash: ``deepseek-v4.1-flash``, docs/models.md):
  decode at 60 sequences per GPU (the published operating point of its speculative-decoding note),
  context 4,989 (DeepSeek's published V3 average; DeepInfer's is not published), with the preset's
  ``[speculative]`` table (DSpark-5 as in DeepSeek's production: a parallel drafter proposes a
  5-token block in one forward, which every step pays, and the load-aware verifier prunes it;
  per-position acceptance: the first from the DeepSeek-V3 paper's 85-90% MTP acceptance, the rest
  assumed). TTFT: a request
  waits on average half a prefill step (it arrives during the step in progress of a saturated
  prefill unit) and then takes one whole step, each step computing 16,384 new tokens per GPU (the
  preset's ``max_prefill_tokens``; the same batch assumption as the SGLang prefill rows) of prompts
  of 4,383 tokens (DeepSeek's derived average) with 96% of each prompt a cache hit; then the KV
  transfer to decode and one decode step give the first token. The speculative gain is the
  decode throughput of dynamic verification over fixed 5-token drafts at the same batch. Its
  published spread (-1.5% .. +11% over 16-96 sequences per rank) does not say which end is at which
  load; the model's gain is 0 at light load and rises with it (the verifier can only prune the
  5-token block, and pruning pays once verification is compute-bound: DSpark paper Fig. 8 and
  sec. 5.4), and ``pdlb sim validate`` prints the simulated sweep under the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sim.perf.base import causal_attn_pairs
from sim.run.pool_perf import roofline_for_pool
from sim.perf.config import PerfConfig
from sim.perf.roofline import DEFAULT_COMM_EFFICIENCY, DEFAULT_MBU, DEFAULT_MFU, DEFAULT_STEP_OVERHEAD_S
from sim.scenario import Scenario, load_scenario
from sim.validation.tolerance import TOLERANCE
from sim.validation.agentx import DECODE_EFFICIENCY_SCALE, PREFILL_EFFICIENCY_SCALE

#: the one figure the efficiency constants are fitted on
CALIBRATION_POINT = "sglang-decode-2k"
#: prefill tokens per GPU per step in the SGLang benchmark: the blog's profile "16,384 tokens per
#: device"; its reproduction flags --chunked-prefill-size 524288 over --dp-size 32 (SGLang divides
#: the chunk budget by the DP size under DP attention). Assumed for DeepSeek's prefill.
PREFILL_TOKENS_PER_GPU = 16384
#: DeepSeek day-6: output/input = 168B/608B, avg KV length per output token 4,989 -> prompt length
DS_AVG_KV_TOKENS = 4989
DS_PROMPT_TOKENS = round(DS_AVG_KV_TOKENS / (1 + 0.5 * 168 / 608))
DS_CACHE_HIT = 0.563
#: day-6's per-node averages are day totals over day-average node counts of each role: 168B output
#: tokens / 86,400 s / 14.8k tok/s per decode node = 131.4 decode nodes and 608B input / 86,400 s /
#: 73.7k = 95.5 prefill nodes, which add to 226.9 of the published 226.75 average nodes
DS_DECODE_NODES_AVG = 168e9 / 86_400 / 14_800
DS_PREFILL_NODES_AVG = 608e9 / 86_400 / 73_700
DS_DECODE_SEQS_PER_GPU = round(14_800 / 8 / 21)
#: DeepSeek-V3 paper sec. 5.4.3: MTP second-token acceptance 85-90% -> 1.875 tokens per step
DS_MTP_TOKENS_PER_STEP = 1.875
DEEPINFER_DECODE_SEQS_PER_GPU = 60
#: uncalibrated normal-mode (prefill) dispatch/combine efficiency: DeepEP README, normal kernels on
#: H800 + CX7 at EP32: 44 GB/s dispatch, 47 GB/s combine RDMA bottleneck bandwidth of ~50 GB/s
NORMAL_COMM_EFFICIENCY = 0.9


def _node_gpus(scenario: Scenario, perf: PerfConfig) -> int:
    from sim.models.hardware import get_hardware
    return perf.gpus_per_node or get_hardware(scenario.hardware).gpus_per_node


def prefill_step_s(scenario: Scenario, perf: PerfConfig, prompt_tokens: int, cached_tokens: int,
                   prompts_per_gpu: int) -> float:
    """Step time (s) of the prefill unit when every rank computes ``prompts_per_gpu`` prompts of
    ``prompt_tokens`` of which ``cached_tokens`` are a prefix hit (not recomputed, KV read)."""
    pool = scenario.prefill
    e = roofline_for_pool(scenario, pool, perf)
    R, new = pool.dp_ranks, prompt_tokens - cached_tokens
    ones = np.ones(R)
    b = e.step_time_breakdown(ones * prompts_per_gpu * new,
                              ones * prompts_per_gpu * causal_attn_pairs(new, cached_tokens),
                              0 * ones, 0 * ones, prefill_cached_tokens=ones * prompts_per_gpu * cached_tokens)
    return float(np.ravel(b["total"])[0])


def decode_step_s(scenario: Scenario, perf: PerfConfig, seqs_per_gpu: float, ctx_tokens: float,
                  tokens_verified: int = 1) -> float:
    """Step time (s) of the decode unit with ``seqs_per_gpu`` sequences of ``ctx_tokens`` context on
    every rank, each computing ``tokens_verified`` tokens (2 with one MTP draft token; the KV of a
    sequence is read once for all its verified tokens)."""
    pool = scenario.decode
    e = roofline_for_pool(scenario, pool, perf)
    ones = np.ones(pool.dp_ranks)
    b = e.step_time_breakdown(0 * ones, 0 * ones, ones * seqs_per_gpu, ones * seqs_per_gpu * ctx_tokens,
                              decode_tokens_per_seq=float(tokens_verified))
    return float(np.ravel(b["total"])[0])


def spec_decode_time_per_token_s(scenario: Scenario, perf: PerfConfig, seqs_per_gpu: float, ctx_tokens: float,
                                 *, dynamic: bool | None = None, draft_tokens: int | None = None) -> float:
    """Seconds per accepted token of the decode unit under the scenario's ``[speculative]`` table
    (:class:`sim.perf.spec.SpecDecodePerf`), every rank holding ``seqs_per_gpu`` sequences of
    ``ctx_tokens``; ``dynamic`` / ``draft_tokens`` override the table's mode and fixed length."""
    return _spec_decode(scenario, perf, seqs_per_gpu, ctx_tokens, dynamic=dynamic, draft_tokens=draft_tokens)[0]


def spec_decode_step_s(scenario: Scenario, perf: PerfConfig, seqs_per_gpu: float, ctx_tokens: float) -> float:
    """Seconds of one speculative decode step (time per accepted token x the tokens per sequence
    the chosen draft yields), same setting as :func:`spec_decode_time_per_token_s`."""
    per, tokens = _spec_decode(scenario, perf, seqs_per_gpu, ctx_tokens)
    return per * tokens


def _spec_decode(scenario: Scenario, perf: PerfConfig, seqs_per_gpu: float, ctx_tokens: float,
                 *, dynamic: bool | None = None, draft_tokens: int | None = None) -> tuple[float, float]:
    from sim.run.pool_perf import spec_perf_for_pool
    if scenario.speculative is None:
        raise ValueError(f"{scenario.name}: no [speculative] table")
    cfg = scenario.speculative
    upd: dict[str, object] = {}
    if dynamic is not None:
        upd["dynamic"] = dynamic
    if draft_tokens is not None:
        upd["draft_tokens"] = draft_tokens
    sc = scenario.model_copy(update={"speculative": cfg.model_copy(update=upd)})
    spec = spec_perf_for_pool(roofline_for_pool(scenario, scenario.decode, perf), sc, scenario.decode)
    ones = np.ones((1, scenario.decode.dp_ranks))
    per = float(spec.step_time_s(0 * ones, 0 * ones, ones * seqs_per_gpu, ones * seqs_per_gpu * ctx_tokens)[0])
    return per, float(spec.last_tokens_per_step[0])


@dataclass(frozen=True)
class Figure:
    """A published figure and how to simulate it.

    ``simulate(scenario, perf)`` returns the simulated value in ``unit``."""

    key: str
    figure: str
    source: str
    published: float
    unit: str
    preset: str
    simulate: Callable[[Scenario, PerfConfig], float] = field(repr=False)
    note: str = ""
    #: a published spread ``(lo, hi)`` instead of one number (``published`` is then its middle):
    #: the figure passes iff the simulated value lies in it
    published_range: tuple[float, float] | None = None
    #: the unpublished fact without which the figure cannot be reached honestly (empty: none). A
    #: figure that misses with a ``blocked_by`` gets the verdict "blocked", not "fail"; either way it
    #: is a miss (counted as such, ``--strict`` exits 1), never a pass
    blocked_by: str = ""


#: SGLang's only published 2,000-token run (reproduction instructions, sglang issue 6017, as the
#: Dynamo wide-EP guide quotes them): the *decode* stress test, one ``bench_one_batch_server`` batch
#: of 40,000 pre-tokenized ShareGPT requests, 2,000 input / 100 output tokens
SGLANG_E2E_BATCH = 40_000
SGLANG_E2E_INPUT_TOKENS = 2000


def sglang_bench_one_batch_input_rate(sc: Scenario, perf: PerfConfig, batch: int = SGLANG_E2E_BATCH,
                                      input_tokens: int = SGLANG_E2E_INPUT_TOKENS) -> float:
    """Input tok/s per prefill node as SGLang's ``bench_one_batch_server`` reports it for one batch
    of ``batch`` fresh prompts of ``input_tokens``: ``batch x input_tokens / ttft`` where ``ttft`` is
    the first token of the *last* request of the batch (the bench overwrites its TTFT on every
    first-token chunk), divided by the prefill nodes.

    Simulated: the batch splits evenly over the prefill DP ranks (SGLang's round-robin DP
    dispatch), each rank runs chunked prefill of ``max_prefill_tokens`` per step (full steps, then
    one partial step with the rest), then the last prompt's KV transfer and one decode step at the
    decode pool's largest batch (an upper bound on the first decode step). Not modelled: sending and
    parsing the one HTTP request of ``batch x input_tokens`` token ids, and the frontend's streaming
    of the batch's other outputs (no published number for either)."""
    per_rank_tokens = batch // sc.prefill.dp_ranks * input_tokens
    budget = sc.prefill.max_prefill_tokens
    full, rest = divmod(per_rank_tokens, budget)
    t = full * prefill_step_s(sc, perf, input_tokens, 0, budget / input_tokens)
    if rest:
        t += prefill_step_s(sc, perf, input_tokens, 0, rest / input_tokens)
    kv = roofline_for_pool(sc, sc.prefill, perf).kv_bytes_per_token
    t += sc.kv_transfer_latency_s + input_tokens * kv / sc.kv_transfer_bandwidth_bytes_per_s
    t += decode_step_s(sc, perf, sc.decode.max_decode_batch, input_tokens)
    return batch * input_tokens / t / (sc.prefill.dp_ranks / _node_gpus(sc, perf))


#: DeepSeek's decode profile (profile-data README: EP128, TP1, 4K prompts, 128 requests per GPU;
#: "absolutely balanced MoE routing"), 18,598 tok/s per node as SGLang's blog derived it from the
#: trace. Not a counted figure: neither source says whether its tokens per step are 1 (no MTP),
#: 2 (MTP, every computed token), 1.875 (MTP, accepted at the V3 paper's 85-90%) or 1.6 (MTP,
#: accepted at the 60% SGLang assumes for its own simulated-MTP run it compares with this one)
DS_PROFILE_DECODE_PUBLISHED = 18_598
DS_PROFILE_DECODE_READINGS = (("1 token/step (no MTP)", 1, 1.0), ("MTP, 2 computed tokens", 2, 2.0),
                              ("MTP, 1.875 accepted (V3 paper)", 2, DS_MTP_TOKENS_PER_STEP),
                              ("MTP, 1.6 accepted (SGLang's 60%)", 2, 1.6))


def deepseek_decode_profile_readings(sc: Scenario | None = None, perf: PerfConfig | None = None) -> dict[str, float]:
    """``{reading: simulated tok/s per node}`` of DeepSeek's decode profile under each reading of
    its tokens per step (:data:`DS_PROFILE_DECODE_READINGS`), on the ``deepseek-v3-h800`` preset at
    EP128, 128 sequences of 4,096 tokens per GPU."""
    sc = sc if sc is not None else load_scenario("deepseek-v3-h800")
    perf = perf if perf is not None else scenario_perf(sc)
    sc = sc.model_copy(update={"decode": sc.decode.model_copy(update={"dp_ranks": 128})})
    out = {}
    for name, verified, tokens in DS_PROFILE_DECODE_READINGS:
        t = decode_step_s(sc, perf, 128, 4096, tokens_verified=verified)
        out[name] = _node_gpus(sc, perf) * 128 * tokens / t
    return out


def _sglang_prefill(prompt: int) -> Callable[[Scenario, PerfConfig], float]:
    def run(sc: Scenario, perf: PerfConfig) -> float:
        n = PREFILL_TOKENS_PER_GPU // prompt
        return _node_gpus(sc, perf) * n * prompt / prefill_step_s(sc, perf, prompt, 0, n)
    return run


def _ds_prefill(sc: Scenario, perf: PerfConfig) -> float:
    cached = round(DS_CACHE_HIT * DS_PROMPT_TOKENS)
    n = PREFILL_TOKENS_PER_GPU // (DS_PROMPT_TOKENS - cached)
    return _node_gpus(sc, perf) * n * DS_PROMPT_TOKENS / prefill_step_s(sc, perf, DS_PROMPT_TOKENS, cached, n)


#: RTP-LLM's DeepSeek replay tech report (alibaba/rtp-llm docs/RTP-LLM-DeepSeek-Replay-Tech-Report.md,
#: English edition docs/references/deepseek/reporter.md): prefill EP32 (4 nodes x 8 H800, RoCE, TP1,
#: DP = EP), "under extreme pressure a single GPU executing 2 4K requests takes 1.5 s, with a
#: throughput of 5333 TPS" (42.6K TPS per node, "under 1.6 s TTFT and 50 ms ITL constraints");
#: 5,333 x 1.5 s / 2 = 4,000 tokens per prompt (derived); no cache hits ("the test did not simulate
#: the impact of cache"); prefill micro-batching with DeepEP normal-mode overlap, combine in 16 bit
#: (as the model's TBO phases); its Limitations: "core operators such as Prefill Attention and
#: Decode Quantization" are slower than DeepSeek's (no number)
RTP_PREFILL_PROMPT_TOKENS = 4000
RTP_PREFILL_PROMPTS_PER_GPU = 2
#: the report's prefill profile (docs/pics/prefill.png: one layer, two micro-batches; no time axis):
#: the compute stream is busy 3,260 of the layer's 3,558 pixel columns (measured by pdlb from the
#: image: columns whose kernel row is not background), idle while DeepEP's normal dispatch starts;
#: dispatch/combine are hidden behind compute (busy 2,359 columns on their own stream)
RTP_PROFILE_COMPUTE_BUSY = 3260 / 3558
#: max/mean expert load of the busiest GPU that would make pdlb's default-EPLB SGLang prefill rows
#: exact at 1K / 2K / 4K prompts (docs/validate.md, "Expert-load imbalance after EPLB"): readings
#: of RTP-LLM's unpublished expert load
RTP_EXPERT_LOAD_READINGS = (1.29, 1.34, 1.40)


def _rtp_prefill(sc: Scenario, perf: PerfConfig) -> float:
    n, L = RTP_PREFILL_PROMPTS_PER_GPU, RTP_PREFILL_PROMPT_TOKENS
    return _node_gpus(sc, perf) * n * L / prefill_step_s(sc, perf, L, 0, n)


def rtp_prefill_readings(sc: Scenario | None = None, perf: PerfConfig | None = None) -> dict[str, float]:
    """``{reading: simulated input tok/s per node}`` of RTP-LLM's prefill figure under each reading
    of its unpublished facts (``deepseek-v3-h800`` preset, 2 x 4,000-token prompts per GPU at EP32):

    * ``"calibrated kernels, balanced experts"``: the row as counted;
    * ``"+ profile idle"``: the step stretched by the compute-idle share of RTP-LLM's published
      profile (:data:`RTP_PROFILE_COMPUTE_BUSY`);
    * ``"expert load max/mean G"``: the busiest GPU's routed load G x the mean
      (``ep_imbalance_prefill``; :data:`RTP_EXPERT_LOAD_READINGS`).
    """
    sc = sc if sc is not None else load_scenario("deepseek-v3-h800")
    perf = perf if perf is not None else scenario_perf(sc)
    base = _rtp_prefill(sc, perf)
    out = {"calibrated kernels, balanced experts": base, "+ profile idle": base * RTP_PROFILE_COMPUTE_BUSY}
    for g in RTP_EXPERT_LOAD_READINGS:
        out[f"expert load max/mean {g:g}"] = _rtp_prefill(sc, perf.model_copy(update={"ep_imbalance_prefill": g}))
    return out


def _sglang_decode(sc: Scenario, perf: PerfConfig) -> float:
    return _node_gpus(sc, perf) * 256 / decode_step_s(sc, perf, 256, 2000)


def _ds_decode_node(sc: Scenario, perf: PerfConfig) -> float:
    t = decode_step_s(sc, perf, DS_DECODE_SEQS_PER_GPU, DS_AVG_KV_TOKENS, tokens_verified=2)
    return _node_gpus(sc, perf) * DS_DECODE_SEQS_PER_GPU * DS_MTP_TOKENS_PER_STEP / t


def _ds_decode_seq(sc: Scenario, perf: PerfConfig) -> float:
    t = decode_step_s(sc, perf, DS_DECODE_SEQS_PER_GPU, DS_AVG_KV_TOKENS, tokens_verified=2)
    return DS_MTP_TOKENS_PER_STEP / t


def _deepinfer_decode_seq(sc: Scenario, perf: PerfConfig) -> float:
    if sc.speculative is None:
        return 1.0 / decode_step_s(sc, perf, DEEPINFER_DECODE_SEQS_PER_GPU, DS_AVG_KV_TOKENS)
    return 1.0 / spec_decode_time_per_token_s(sc, perf, DEEPINFER_DECODE_SEQS_PER_GPU, DS_AVG_KV_TOKENS)


#: DeepInfer: 96% input cache hit rate (published); prompt length assumed = DeepSeek's derived average
DEEPINFER_CACHE_HIT = 0.96


def deepinfer_ttft_s(sc: Scenario, perf: PerfConfig) -> float:
    """Mean TTFT (s) of the stated DeepInfer load (module docstring): 1.5 saturated prefill steps
    + KV transfer (latency + prompt KV bytes / link bandwidth) + one decode step at 60 sequences
    per GPU (with speculation: one verification step)."""
    L = DS_PROMPT_TOKENS
    cached = round(DEEPINFER_CACHE_HIT * L)
    n = sc.prefill.max_prefill_tokens // (L - cached)
    step = prefill_step_s(sc, perf, L, cached, n)
    kv = roofline_for_pool(sc, sc.prefill, perf).kv_bytes_per_token
    transfer = sc.kv_transfer_latency_s + L * kv / sc.kv_transfer_bandwidth_bytes_per_s
    if sc.speculative is None:
        first = decode_step_s(sc, perf, DEEPINFER_DECODE_SEQS_PER_GPU, DS_AVG_KV_TOKENS)
    else:
        first = spec_decode_step_s(sc, perf, DEEPINFER_DECODE_SEQS_PER_GPU, DS_AVG_KV_TOKENS)
    return 1.5 * step + transfer + first


def _deepinfer_ttft_ms(sc: Scenario, perf: PerfConfig) -> float:
    return 1e3 * deepinfer_ttft_s(sc, perf)


def spec_gain(sc: Scenario, perf: PerfConfig, seqs_per_gpu: float) -> float:
    """Decode throughput of dynamic verification over fixed 5-token drafts at ``seqs_per_gpu``,
    in percent (same batch, so throughput and per-sequence speed gain alike)."""
    fixed = spec_decode_time_per_token_s(sc, perf, seqs_per_gpu, DS_AVG_KV_TOKENS, dynamic=False, draft_tokens=5)
    dyn = spec_decode_time_per_token_s(sc, perf, seqs_per_gpu, DS_AVG_KV_TOKENS, dynamic=True)
    return 100.0 * (fixed / dyn - 1.0)


#: the concurrencies (sequences per rank) of the published -1.5% .. +11% spread
SPEC_GAIN_SWEEP = (16, 32, 48, 64, 80, 96)


def spec_gain_sweep(sc: Scenario | None = None, perf: PerfConfig | None = None) -> dict[int, float]:
    """``{seqs_per_rank: spec_gain}`` over :data:`SPEC_GAIN_SWEEP` (default: the DeepInfer preset)."""
    sc = sc if sc is not None else load_scenario("deepinfer-sm100")
    perf = perf if perf is not None else scenario_perf(sc)
    return {b: spec_gain(sc, perf, b) for b in SPEC_GAIN_SWEEP}


def _spec_gain_60(sc: Scenario, perf: PerfConfig) -> float:
    return spec_gain(sc, perf, DEEPINFER_DECODE_SEQS_PER_GPU)


def _spec_gain_max_16_96(sc: Scenario, perf: PerfConfig) -> float:
    return max(spec_gain(sc, perf, b) for b in SPEC_GAIN_SWEEP)


def _spec_gain_min_16_96(sc: Scenario, perf: PerfConfig) -> float:
    return min(spec_gain(sc, perf, b) for b in SPEC_GAIN_SWEEP)


SGLANG = "SGLang blog 2025-05-05 (96 H100)"
DAY6 = "DeepSeek day-6 overview (H800)"
DS_PROFILE = "DeepSeek profile-data (H800), via SGLang blog"
DEEPINFER = "DeepInfer (V4.1 Flash, SM100)"
RTP = "RTP-LLM DeepSeek replay report (H800 RoCE)"

#: every checkable published figure, in display order
FIGURES: tuple[Figure, ...] = (
    Figure("sglang-prefill-1k", "prefill input tok/s/node, 1K prompts", SGLANG, 57_674, "tok/s",
           "sglang-h100-ep", _sglang_prefill(1024), "16 x 1K prompts per GPU (assumed batch)"),
    Figure("sglang-prefill-2k", "prefill input tok/s/node, 2K prompts", SGLANG, 54_543, "tok/s",
           "sglang-h100-ep", _sglang_prefill(2048), "8 x 2K prompts per GPU"),
    Figure("sglang-prefill-4k", "prefill input tok/s/node, 4K prompts", SGLANG, 50_302, "tok/s",
           "sglang-h100-ep", _sglang_prefill(4096), "4 x 4K prompts per GPU"),
    Figure("sglang-perfect-eplb-4k", "prefill input tok/s/node, 4K prompts, simulated perfect EPLB", SGLANG,
           59_337, "tok/s", "sglang-h100-ep", _sglang_prefill(4096),
           "4 x 4K prompts per GPU, 16,384 tokens per device (published); experts balanced (random experts with "
           "group-limited routing), as the model assumes"),
    Figure("sglang-e2e-input-2000", "input tok/s/node, 2,000-token inputs", SGLANG, 52_300, "tok/s",
           "sglang-h100-ep", _sglang_prefill(2000), "8 x 2,000 prompts per GPU; published: the input side of the "
           "12-node run of 2,000-in / 100-out requests (a different run from the prefill-only rows)",
           blocked_by="how SGLang measured the 52.3k, or the expert load of its default-EPLB prefill steps; either "
                      "would bring the row within +-15%. (1) The blog states no method; the reproduction's only "
                      "2,000-token run is the decode stress test (40,000 requests, 2,000 in / 100 out, input rate "
                      "at the last request's first token). Simulated as that bench measures it the model gives "
                      "60,389 (+15.5%: the method moves it 0.03 points); the prefill-only 2K row, same hardware, "
                      "is 54,543, and 52.3k is 4.1% below it with no step-time term to explain it (the model is "
                      "+10.7% against 54,543). (2) Per-step max/mean expert load of SGLang's default-EPLB prefill "
                      "batches is unpublished; the model has balanced experts and is +6.7% .. +10.4% on every "
                      "default-EPLB row; if it matched the 2K row (x 54,543 / 60,234) this row would be +4.6%"),
    Figure("sglang-decode-2k", "decode output tok/s/node, batch 256/GPU, 2K ctx", SGLANG, 22_282, "tok/s",
           "sglang-h100-ep", _sglang_decode, "calibration point"),
    Figure("deepseek-prefill", "prefill input tok/s/node incl. 56.3% cache hits", DAY6, 73_700, "tok/s",
           "deepseek-v3-h800", _ds_prefill,
           f"{DS_PROMPT_TOKENS}-token prompts (derived), 56.3% cached (hits read from HBM), saturated step. "
           f"Published = 608B tokens / 86,400 s / {DS_PREFILL_NODES_AVG:.1f} day-average prefill nodes "
           f"(226.75 nodes - {DS_DECODE_NODES_AVG:.1f} decode nodes implied by 168B / 86,400 s / 14.8k)",
           blocked_by="how busy DeepSeek's prefill nodes were: the 73.7k is tokens per provisioned node-second "
                      f"over the day ({DS_PREFILL_NODES_AVG:.1f} prefill nodes on average), not a saturated step; "
                      "day-6 publishes node counts but not the prefill nodes' busy fraction (nor the prompt-length "
                      "spread or the cost of loading the on-disk hits)"),
    Figure("deepseek-profile-prefill", "prefill input tok/s/node, DeepSeek's profile (4K prompts)", DS_PROFILE,
           62_713, "tok/s", "deepseek-v3-h800", _sglang_prefill(4096),
           "EP32, 4K prompts, 16K tokens per GPU, 'absolutely balanced MoE routing' (profile-data README); "
           "throughput as SGLang derived it from the trace: the saturated counterpart of deepseek-prefill"),
    Figure("deepseek-decode-node", "decode output tok/s/node, avg KV 4,989", DAY6, 14_800, "tok/s",
           "deepseek-v3-h800", _ds_decode_node,
           f"{DS_DECODE_SEQS_PER_GPU} seqs/GPU (derived from the 24-h averages), MTP {DS_MTP_TOKENS_PER_STEP} tok/step"),
    Figure("deepseek-decode-seq", "decode tok/s per sequence (20-22)", DAY6, 21, "tok/s",
           "deepseek-v3-h800", _ds_decode_seq, "same step as the per-node figure"),
    Figure("rtp-llm-prefill-4k", "prefill input tok/s/node, 2 x 4K prompts per GPU (another engine)", RTP, 42_600,
           "tok/s", "deepseek-v3-h800", _rtp_prefill,
           "EP32 on 4 x 8 H800, 2 prompts of 4,000 tokens per GPU per step, 1.5 s per step (published; 4,000 "
           "derived from 5,333 TPS x 1.5 s / 2), no cache hits, micro-batch overlap; another engine than the "
           "calibration point's (RoCE NIC bandwidth and DeepEP SMs assumed as DeepSeek's; its profile shows the "
           "communication hidden, so neither decides the step)",
           blocked_by="RTP-LLM's kernel speed and expert load in that step: its report says its prefill attention "
                      "and other core kernels are slower than DeepSeek's without a number, and its profile has no "
                      "time axis (the deciding number: its layer time, 24.6 ms for 1.5 s / 61 layers; the model "
                      "gives 19.5 ms at the calibration's efficiency). The model gives 53,923 tok/s (+26.6%) with "
                      "balanced experts, 49,407 (+16.0%) with the profile's 8.4% compute idle, and +11.4 / +8.2 / "
                      "+4.7% at the busiest-GPU expert load that makes the SGLang 1K / 2K / 4K rows exact (1.29 / "
                      "1.34 / 1.40 x the mean); DeepSeek's own profile on "
                      "the same layout (62,713) and this figure cannot both be within 15% of an engine-agnostic "
                      "model unless halving the batch costs >= 8.1% per token (the model: -0.4%)"),
    Figure("deepinfer-decode-seq", "decode tok/s per sequence", DEEPINFER, 230, "tok/s",
           "deepinfer-sm100", _deepinfer_decode_seq,
           f"V4.1-Flash, {DEEPINFER_DECODE_SEQS_PER_GPU} seqs/GPU, ctx 4,989 (assumed), DSpark-5 dynamic "
           "verification (acceptance beyond position 1 assumed), 64 GPUs in one NVLink domain (assumed; "
           "8-GPU nodes with 400/800 Gb/s NICs give 91/169 tok/s: the interconnect is unpublished)",
           blocked_by="DeepInfer's decode interconnect (the model gives 353 tok/s with the 64 GPUs in one NVLink "
                      "domain, 169 / 91 on 8-GPU nodes with 800 / 400 Gb/s NICs; 230 lies between) and, after "
                      "it, DSpark-5's per-position acceptance on V4.1 traffic"),
    Figure("deepinfer-ttft", "mean TTFT at 96% input cache hit", DEEPINFER, 400, "ms",
           "deepinfer-sm100", _deepinfer_ttft_ms,
           f"saturated EP4 prefill, 16,384 new tokens/GPU/step of {DS_PROMPT_TOKENS}-token prompts (assumed), "
           "wait 1/2 step + 1 step + KV transfer + first decode step (the prefill load is unpublished: "
           "TTFT is ~linear in it, 400 ms <-> ~8k new tokens/GPU/step)",
           blocked_by="DeepInfer's prefill load (new tokens per GPU per step, or the request rate) at which the "
                      "~400 ms was measured: a saturated EP4 unit's mean TTFT is ~linear in it (4,096 / 8,192 / "
                      "12,288 / 16,384 new tokens per GPU per step: 209 / 404 / 608 / 803 ms), and, at 96% hits, "
                      "the prompt length (2K / 4K / 8K / 16K / 32K: 1,340 / 832 / 577 / 463 / 387 ms at 16,384): "
                      "each prompt's 175 new tokens bring 128 rebuilt encoder rows and 128 decoder rows"),
    Figure("deepinfer-spec-gain-60", "dynamic vs fixed 5-token verification, ~60 seqs/rank", DEEPINFER, 5.5, "%",
           "deepinfer-sm100", _spec_gain_60, "mean-field load-aware pruning of DSpark's 5-token block "
           "(sim/perf/spec.py)",
           published_range=(4.0, 7.0)),
    Figure("deepinfer-spec-gain-max", "dynamic vs fixed gain, largest over 16-96 seqs/rank", DEEPINFER, 11.0, "%",
           "deepinfer-sm100", _spec_gain_max_16_96, "published spread -1.5% .. +11%: the largest must be <= 11 "
           "(simulated at 96: the gain rises with load)",
           published_range=(4.0, 11.0),
           blocked_by="DSpark-5's per-position acceptance on V4.1 traffic and its spread across requests (plotted "
                      "for Qwen3 targets only): the gain at 96 is +14.0% with the assumed decay of 0.05 per "
                      "position, +2.2% with a flat 0.875; fitting the curve to the published gains would make "
                      "them no longer held out"),
    Figure("deepinfer-spec-gain-min", "dynamic vs fixed gain, smallest over 16-96 seqs/rank", DEEPINFER, -1.5, "%",
           "deepinfer-sm100", _spec_gain_min_16_96, "published spread -1.5% .. +11%: the smallest must be >= -1.5 "
           "(simulated at light load: nothing to prune, no scheduling overhead)",
           published_range=(-1.5, 7.0)),
)
FIGURES_BY_KEY = {f.key: f for f in FIGURES}


@dataclass(frozen=True)
class Result:
    figure: Figure
    simulated: float

    @property
    def error(self) -> float:
        """simulated / published - 1 (for a range figure: 0 inside the range, else the relative
        distance to the nearer end)."""
        rng = self.figure.published_range
        if rng is not None:
            lo, hi = rng
            if lo <= self.simulated <= hi:
                return 0.0
            end = lo if self.simulated < lo else hi
            return (self.simulated - end) / max(abs(end), 1.0)
        return self.simulated / self.figure.published - 1.0

    @property
    def passed(self) -> bool:
        if self.figure.published_range is not None:
            lo, hi = self.figure.published_range
            return lo <= self.simulated <= hi
        return abs(self.error) <= TOLERANCE

    @property
    def verdict(self) -> str:
        """``"pass"``; ``"blocked"`` (a miss whose figure names the unpublished fact it needs,
        :attr:`Figure.blocked_by`); else ``"fail"`` (a miss of the model)."""
        if self.passed:
            return "pass"
        return "blocked" if self.figure.blocked_by else "fail"


def summary_line(held: list[Result]) -> str:
    """``"9 of 15 held-out figures within +-15% (6 blocked by an unpublished fact, 0 fail)"``: a
    blocked figure is a miss, counted apart from the model's fails, never as a pass."""
    n_pass = sum(r.verdict == "pass" for r in held)
    n_blocked = sum(r.verdict == "blocked" for r in held)
    n_fail = sum(r.verdict == "fail" for r in held)
    return (f"{n_pass} of {len(held)} held-out figures within +-{TOLERANCE:.0%} "
            f"({n_blocked} blocked by an unpublished fact, {n_fail} fail)")


def _figure(key: str) -> Figure:
    try:
        return FIGURES_BY_KEY[key]
    except KeyError:
        raise ValueError(f"unknown figure {key!r}; valid: {', '.join(FIGURES_BY_KEY)}") from None


def scenario_perf(scenario: Scenario) -> PerfConfig:
    """The scenario's perf settings (its ``[perf]`` table, else the defaults)."""
    return scenario.perf or PerfConfig()


def run_validation(keys: list[str] | None = None,
                   perf_override: Callable[[PerfConfig], PerfConfig] | None = None) -> list[Result]:
    """Simulate the figures ``keys`` (default all) with their presets' perf settings, optionally
    transformed by ``perf_override``. Raises ``ValueError`` on an unknown key."""
    out = []
    for f in [_figure(k) for k in keys] if keys else FIGURES:
        sc = load_scenario(f.preset)
        perf = scenario_perf(sc)
        if perf_override is not None:
            perf = perf_override(perf)
        out.append(Result(f, f.simulate(sc, perf)))
    return out


def derated(perf: PerfConfig, scale: float) -> PerfConfig:
    """``perf`` with mfu, mbu and comm_efficiency = ``scale`` x the roofline defaults (capped at 1),
    ``comm_efficiency_normal`` (when the preset sets it) = ``scale`` x ``NORMAL_COMM_EFFICIENCY``,
    and the default step overhead."""
    upd = {"mfu": min(1.0, scale * DEFAULT_MFU), "mbu": min(1.0, scale * DEFAULT_MBU),
           "comm_efficiency": min(1.0, scale * DEFAULT_COMM_EFFICIENCY),
           "step_overhead_s": DEFAULT_STEP_OVERHEAD_S}
    if perf.comm_efficiency_normal is not None:
        upd["comm_efficiency_normal"] = min(1.0, scale * NORMAL_COMM_EFFICIENCY)
    return perf.model_copy(update=upd)


def calibrate(key: str = CALIBRATION_POINT, *, tol: float = 1e-9) -> tuple[float, PerfConfig, Result]:
    """Fit the derating ``s`` so that figure ``key`` is reproduced exactly (bisection; the
    simulated figure is monotone in ``s``: a throughput rises, a speculative-decoding gain may fall).

    Returns:
        ``(s, fitted PerfConfig, result at s)``.
    Raises:
        ValueError: unknown key, or no ``s`` in (0, 1/max default] reproduces the figure.
    """
    f = _figure(key)
    sc = load_scenario(f.preset)
    base = scenario_perf(sc)

    def value(s: float) -> float:
        return f.simulate(sc, derated(base, s))

    lo, hi = 1e-3, 1.0 / max(DEFAULT_MFU, DEFAULT_MBU, DEFAULT_COMM_EFFICIENCY, NORMAL_COMM_EFFICIENCY)
    v_lo, v_hi = value(lo), value(hi)
    rising = v_hi >= v_lo  # throughputs rise with the constants; a speculative gain can fall
    if not min(v_lo, v_hi) <= f.published <= max(v_lo, v_hi):
        raise ValueError(f"{key}: published {f.published:g} is outside what the efficiency constants can "
                         f"reach ({min(v_lo, v_hi):.4g} .. {max(v_lo, v_hi):.4g} {f.unit})")
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if (value(mid) < f.published) == rising else (lo, mid)
    s = 0.5 * (lo + hi)
    perf = derated(base, s)
    return s, perf, Result(f, f.simulate(sc, perf))


def deepinfer_b200_readings(decode_scale: float | None = None, prefill_scale: float | None = None) -> dict[str, float]:
    """DeepInfer's blocked rows at the roofline fractions AgentX 440246 measured on B200 (issue 23
    part 4): ``{reading: value}`` with the ``deepinfer-sm100`` preset derated (:func:`derated`) by
    ``decode_scale`` for decode (default :data:`sim.validation.agentx.DECODE_EFFICIENCY_SCALE`, 0.73)
    and ``prefill_scale`` for TTFT (default :data:`sim.validation.agentx.PREFILL_EFFICIENCY_SCALE`,
    0.64) instead of the SGLang H100 calibration (0.754). Readings: decode tok/s per sequence on one
    NVLink domain (the preset) and on 8-GPU nodes with the datasheet's 400 Gb/s NICs; mean TTFT (ms)
    at 4,096 / 8,192 / 12,288 / 16,384 new tokens per GPU per step; the dynamic-verification gain
    (%) at 96 sequences per rank under the preset's assumed acceptance and a flat 0.875. The rows'
    missing facts (interconnect, prefill load, acceptance) still span each published figure."""
    sc = load_scenario("deepinfer-sm100")
    dec = derated(sc.perf, DECODE_EFFICIENCY_SCALE if decode_scale is None else decode_scale)
    pre = derated(sc.perf, PREFILL_EFFICIENCY_SCALE if prefill_scale is None else prefill_scale)
    f = FIGURES_BY_KEY["deepinfer-decode-seq"]
    out = {"decode tok/s/seq, one NVLink domain": f.simulate(sc, dec),
           "decode tok/s/seq, 8-GPU nodes, 400 Gb/s NICs": f.simulate(sc, dec.model_copy(update={"gpus_per_node": 8}))}
    for budget in (4096, 8192, 12288, 16384):
        s2 = sc.model_copy(update={"prefill": sc.prefill.model_copy(update={"max_prefill_tokens": budget})})
        out[f"TTFT ms, {budget:,} new tokens/GPU/step"] = 1e3 * deepinfer_ttft_s(s2, pre)
    out["spec gain % at 96 seqs/rank, assumed decay"] = spec_gain(sc, dec, 96)
    flat = sc.model_copy(update={"speculative": sc.speculative.model_copy(update={"acceptance": [0.875] * 5})})
    out["spec gain % at 96 seqs/rank, flat 0.875"] = spec_gain(flat, dec, 96)
    return out
