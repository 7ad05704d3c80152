#!/usr/bin/env python3
"""Serve random-weight models of real architectures with transformers' continuous-batching server
behind ``pdlb serve``, drive them with the openai client over a trace slice at several request
rates, and record per-request TTFT/TPOT and per-step engine times (issue 23 part 2, issue 30's GPU run).

Runs on the GPU host (one H200) in one call; imports nothing from pdlb (``pdlb serve`` is started
as a subprocess). For each model in ``--models``:

1. build the architecture from its published ``config.json`` values with random bf16 weights
   (``AutoModelForCausalLM.from_config``) and save it with a word-level tokenizer over all its ids
   (one word = one token, so a prompt of ``n`` words is ``n`` prompt tokens) and a chat template
   that adds nothing;
2. start ``--engines`` engines (``bench/tf_engine_steps.py``: ``transformers serve
   --continuous-batching`` with every engine step logged) on the one GPU, and ``pdlb serve`` in
   front (mixed pool, ``round_robin``, one process);
3. warm up, then a **probe**: ``--probe-requests`` requests of the trace slice sent at once; their
   completion rate (requests / makespan) is the engines' saturated capacity ``C``;
4. for each fraction ``f`` in ``--load-fractions``: open-loop arrivals at ``f * C`` requests/s for
   ``--duration-s`` (the trace's own inter-arrival gaps, scaled to that mean rate), every request
   streamed through pdlb; then wait for all to finish. pdlb's ``/metrics`` is read before and after.

Requests: the first rows of the Azure LLM 2023 conversation trace (``--trace``; ContextTokens,
GeneratedTokens, TIMESTAMP), prompt length clipped to ``--max-prompt-tokens`` and output to
``--max-output-tokens``; every prompt is fresh random words (no shared prefix between requests).

Per request (client clock, ``time.time()`` on the same host as the engines): scheduled arrival,
send time, first content chunk (TTFT: the first chunk with text, not the role-only chunk),
last chunk, content chunks, and the server's ``usage`` (prompt / completion tokens).

Output in ``--out``: ``gpu_run_<model>.json.gz`` per model (environment, engine configs, every
engine step, every request of every phase, pdlb's TTFT histogram deltas) and ``log.txt`` lines
printed as it goes. ``--tiny`` swaps in two-layer toy configs for a CPU smoke test::

    python bench/gpu_engine_run.py --tiny --device cpu --out /tmp/g --duration-s 8 --probe-requests 6
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gzip
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: the architectures, from their published config.json values (Hugging Face model cards):
#: meta-llama/Llama-3.1-8B (rope scaling left out: it changes no step time) and Qwen/Qwen3-30B-A3B
#: with 12 of its 48 decoder layers (every layer is the same MoE block, so step time per layer is
#: the architecture's; 12 layers keep two engines and their KV on one GPU)
ARCHS = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         tie_word_embeddings=False),
    "qwen3-30b-a3b-l12": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                              moe_intermediate_size=768, num_hidden_layers=12, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                              norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                              max_position_embeddings=40960, tie_word_embeddings=False, decoder_sparse_step=1,
                              mlp_only_layers=[]),
}
TINY = {
    "llama-3.1-8b": dict(ARCHS["llama-3.1-8b"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=4096),
    "qwen3-30b-a3b-l12": dict(ARCHS["qwen3-30b-a3b-l12"], hidden_size=128, intermediate_size=256,
                              moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              vocab_size=4096),
}


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if LOG_PATH is not None:
        with open(LOG_PATH, "a") as fh:
            fh.write(line + "\n")


LOG_PATH: Path | None = None


# ----------------------------------------------------------------------------- models
def build_model(name: str, arch: dict, folder: Path, device: str) -> dict:
    """Random-weight model + word-level tokenizer saved in ``folder``; returns facts about it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    t0 = time.time()
    kw = dict(arch)
    mtype = kw.pop("model_type")
    cfg = AutoConfig.for_model(mtype, **kw)
    cfg.eos_token_id = None
    cfg.bos_token_id = None
    cfg.pad_token_id = 0
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, bos_token_id=None,
                                               pad_token_id=0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0",
                                   model_max_length=cfg.max_position_embeddings)
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(folder)
    return {"name": name, "params": params, "config": arch, "build_s": time.time() - t0}


# ----------------------------------------------------------------------------- processes
def wait_http(url: str, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"process {p.args[:3]} exited with {p.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout_s:.0f} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    end = time.time() + 10
    for p in procs:
        try:
            p.wait(max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def pdlb_ttft_hist(base: str) -> dict:
    """Sum and count of pdlb_time_to_first_token_seconds over all its label sets."""
    out = {"sum": 0.0, "count": 0.0}
    try:
        text = get_text(base + "/metrics")
    except Exception as e:  # noqa: BLE001 -- recorded, not fatal
        return {"error": repr(e)}
    for line in text.splitlines():
        m = re.match(r"pdlb_time_to_first_token_seconds_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)", line)
        if m:
            out[m.group(1)] += float(m.group(3))
    return out


# ----------------------------------------------------------------------------- load
def load_trace(path: Path, n: int, max_prompt: int, max_output: int) -> list[dict]:
    rows = []
    with open(path) as fh:
        for r in csv.DictReader(fh):
            rows.append(r)
            if len(rows) >= n + 1:
                break
    from datetime import datetime

    ts = [datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows]
    gaps = [max(0.0, b - a) for a, b in zip(ts, ts[1:])]
    out = []
    for r, g in zip(rows, gaps):
        out.append({"prompt_tokens": max(1, min(int(r["ContextTokens"]), max_prompt)),
                    "output_tokens": max(2, min(int(r["GeneratedTokens"]), max_output)), "gap_s": g})
    return out


def arrival_schedule(rows: list[dict], rate_rps: float, duration_s: float) -> list[dict]:
    """The trace rows sent in one phase, each with ``at_s`` (seconds from the phase start): the
    trace's own gaps scaled so that their mean over ``rows`` is ``1 / rate_rps``; only arrivals
    at most ``duration_s`` after the first. Raises ValueError for a rate that is not > 0 or rows whose gaps
    sum to 0."""
    if not rate_rps > 0:
        raise ValueError(f"request rate must be > 0, got {rate_rps}")
    mean_gap = sum(r["gap_s"] for r in rows) / max(1, len(rows))
    if not mean_gap > 0:
        raise ValueError("the trace rows have no time between arrivals")
    out, at = [], 0.0
    for r in rows:
        if at > duration_s:
            break
        out.append(dict(r, at_s=at))
        at += r["gap_s"] / mean_gap / rate_rps
    return out


async def one_request(client, model: str, rid: str, prompt: str, max_tokens: int, rec: dict) -> None:
    rec["sent"] = time.time()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Request-Id": rid})
        chunks = 0
        async for ch in stream:
            now = time.time()
            if ch.choices and ch.choices[0].delta is not None and ch.choices[0].delta.content:
                chunks += 1
                if "first" not in rec:
                    rec["first"] = now
                rec["last"] = now
            if getattr(ch, "usage", None):
                rec["usage"] = [ch.usage.prompt_tokens, ch.usage.completion_tokens]
        rec["chunks"] = chunks
        rec["done"] = time.time()
    except Exception as e:  # noqa: BLE001 -- recorded per request
        rec["error"] = repr(e)[:300]
        rec["done"] = time.time()


async def drive(base: str, model: str, reqs: list[dict], vocab: int, seed: int, timeout_s: float) -> list[dict]:
    """Send ``reqs`` (each with ``at_s`` offsets) open-loop; returns one record per request."""
    import httpx
    import openai

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=timeout_s,
                                http_client=openai.DefaultAsyncHttpxClient(limits=limits))
    prompts = [" ".join(f"t{rng.randrange(2, vocab)}" for _ in range(r["prompt_tokens"])) for r in reqs]
    t0 = time.time() + 0.5
    recs: list[dict] = []
    tasks = []
    for i, (r, p) in enumerate(zip(reqs, prompts)):
        rec = {"i": i, "at": t0 + r["at_s"], "prompt_tokens": r["prompt_tokens"], "max_tokens": r["output_tokens"]}
        recs.append(rec)
        delay = rec["at"] - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_request(client, model, f"r{seed}-{i}", p, r["output_tokens"], rec)))
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    await client.close()
    return recs


def summarize(recs: list[dict]) -> str:
    ok = [r for r in recs if "first" in r and "error" not in r]
    if not ok:
        return f"0 of {len(recs)} ok"
    ttft = sorted(r["first"] - r["sent"] for r in ok)
    tp = sorted((r["last"] - r["first"]) / (r["chunks"] - 1) for r in ok if r.get("chunks", 0) > 1)
    q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")  # noqa: E731
    return (f"{len(ok)} of {len(recs)} ok; TTFT p50 {q(ttft, .5) * 1e3:.0f} p90 {q(ttft, .9) * 1e3:.0f} ms; "
            f"TPOT p50 {q(tp, .5) * 1e3:.1f} p90 {q(tp, .9) * 1e3:.1f} ms")


# ----------------------------------------------------------------------------- one model
def run_model(name: str, arch: dict, a: argparse.Namespace, deadline: float) -> dict:
    work = Path(a.work) / name
    trace = load_trace(Path(a.trace), a.trace_rows, a.max_prompt_tokens, a.max_output_tokens)
    facts = build_model(name, arch, work / "model", a.device)
    log(f"{name}: built {facts['params'] / 1e9:.2f}B params in {facts['build_s']:.1f} s")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(Path(a.work) / "hfcache"), TOKENIZERS_PARALLELISM="false")
    procs: list[subprocess.Popen] = []
    logs = []
    rec: dict = {"model": facts, "engines": [], "phases": [], "args": vars(a)}
    try:
        for e in range(a.engines):
            port = a.base_port + e
            steps = work / f"steps{e}.jsonl"
            steps.unlink(missing_ok=True)
            cmd = [a.engine_python, str(HERE / "tf_engine_steps.py"), "serve", str(work / "model"), "--continuous-batching",
                   "--host", "127.0.0.1", "--port", str(port), "--device", a.engine_device, "--dtype", "bfloat16",
                   "--cb-block-size", str(a.block_size), "--cb-max-batch-tokens", str(a.max_batch_tokens),
                   "--cb-max-memory-percent", str(a.kv_memory_fraction), "--log-level", "warning"]
            lf = open(work / f"engine{e}.log", "w")
            logs.append(lf)
            procs.append(subprocess.Popen(cmd, env=dict(env, PDLB_STEP_LOG=str(steps)), stdout=lf, stderr=subprocess.STDOUT))
            rec["engines"].append({"url": f"http://127.0.0.1:{port}", "cmd": cmd, "steps_file": str(steps)})
        for e in range(a.engines):
            wait_http(f"http://127.0.0.1:{a.base_port + e}/health", a.engine_start_timeout_s, procs)
        log(f"{name}: {a.engines} engines up")
        pport = a.base_port + 100
        pcmd = shlex.split(a.pdlb_cmd) + ["--mixed", *[x["url"] for x in rec["engines"]], "--pd-protocol", "none",
                                     "--prefill-policy", a.policy, "--decode-policy", a.policy, "--processes", "1",
                                     "--host", "127.0.0.1", "--port", str(pport), "--log-level", "WARNING"]
        lf = open(work / "pdlb.log", "w")
        logs.append(lf)
        procs.append(subprocess.Popen(pcmd, env=env, stdout=lf, stderr=subprocess.STDOUT))
        rec["pdlb_cmd"] = pcmd
        base = f"http://127.0.0.1:{pport}"
        wait_http(base + "/health", 60, procs)
        log(f"{name}: pdlb serve up")
        vocab = arch["vocab_size"]
        model = str(work / "model")

        def phase(label: str, reqs: list[dict], rate: float | None, seed: int) -> list[dict]:
            h0 = pdlb_ttft_hist(base)
            t = time.time()
            recs = asyncio.run(drive(base, model, reqs, vocab, seed, a.request_timeout_s))
            h1 = pdlb_ttft_hist(base)
            rec["phases"].append({"name": label, "rate_rps": rate, "t_start": t, "t_end": time.time(),
                                  "pdlb_ttft_before": h0, "pdlb_ttft_after": h1, "requests": recs})
            log(f"{name} {label}{'' if rate is None else f' @ {rate:.2f} req/s'}: {len(reqs)} requests, "
                f"{time.time() - t:.1f} s: {summarize(recs)}")
            return recs

        # warm-up (not used): a few small requests so that kernels and graphs are ready
        phase("warmup", [dict(r, at_s=0.05 * i, output_tokens=4) for i, r in enumerate(trace[:2 * a.engines])], None, 1)
        probe = [dict(r, at_s=0.0) for r in trace[:a.probe_requests]]
        recs = phase("probe", probe, None, 2)
        ok = [r for r in recs if "done" in r and "error" not in r]
        span = max(r["done"] for r in ok) - min(r["sent"] for r in recs) if ok else float("nan")
        cap = len(ok) / span if ok else float("nan")
        rec["capacity_rps"] = cap
        log(f"{name}: probe capacity {cap:.2f} req/s")
        rates = list(a.rates) if a.rates else [f * cap for f in a.load_fractions]
        off = a.probe_requests
        for k, rate in enumerate(rates):
            left = deadline - time.time()
            if left < a.duration_s + 20:
                log(f"{name}: {left:.0f} s left, skipping rate {rate:.2f}")
                break
            reqs = arrival_schedule(trace[off:], rate, a.duration_s)
            off += len(reqs)
            phase(f"rate{k}", reqs, rate, 10 + k)
    finally:
        stop(procs[::-1])
        for lf in logs:
            lf.close()
        for e, eng in enumerate(rec["engines"]):
            steps, cfgs = [], []
            try:
                with open(eng["steps_file"]) as fh:
                    for line in fh:
                        o = json.loads(line)
                        (cfgs if o["kind"] == "config" else steps).append(o)
            except FileNotFoundError:
                pass
            eng["config"] = cfgs
            eng["steps"] = [[o["t0"], o["t1"], o["q"], o["kv"], o.get("fast", False)] for o in steps]
            try:
                eng["log_tail"] = (work / f"engine{e}.log").read_text()[-3000:]
            except OSError:
                pass
        try:
            rec["pdlb_log_tail"] = (work / "pdlb.log").read_text()[-3000:]
        except OSError:
            pass
    return rec


def environment() -> dict:
    env = {"python": sys.version.split()[0], "host_cores": os.cpu_count()}
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        env["error"] = repr(e)
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,memory.used",
             "--format=csv"], capture_output=True, text=True, timeout=20).stdout
    except Exception:  # noqa: BLE001
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # pdlb_cli.arg_types (standard library only)
    from pdlb_cli.arg_types import fraction, port_int, positive_float, positive_int
    from pdlb_cli.comma_lists import comma_list
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_run_<model>.json.gz and log.txt")
    ap.add_argument("--work", default="/tmp/pdlb_gpu_run", help="scratch folder for models and logs")
    ap.add_argument("--models", default="llama-3.1-8b,qwen3-30b-a3b-l12", help=f"comma list of {', '.join(ARCHS)}")
    ap.add_argument("--tiny", action="store_true", help="two-layer toy configs (CPU smoke test)")
    ap.add_argument("--device", default="cuda", help="where the random model is built")
    ap.add_argument("--engine-device", default=None, help="transformers serve --device (default: cuda:0, or cpu)")
    ap.add_argument("--engines", type=positive_int, default=2, help="engines per model, all on the one GPU")
    ap.add_argument("--kv-memory-fraction", type=fraction, default=0.2, help="--cb-max-memory-percent per engine")
    ap.add_argument("--max-batch-tokens", type=positive_int, default=2048, help="--cb-max-batch-tokens (token budget per step)")
    ap.add_argument("--block-size", type=positive_int, default=256, help="--cb-block-size (KV block, tokens)")
    ap.add_argument("--policy", default="round_robin", help="pdlb serve policy of the mixed pool")
    ap.add_argument("--trace", default="/work/shared/traces/azure_llm_2023_conv.csv",
                    help="Azure LLM 2023 trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)")
    ap.add_argument("--trace-rows", type=positive_int, default=2000)
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=2048)
    ap.add_argument("--max-output-tokens", type=positive_int, default=96)
    ap.add_argument("--probe-requests", type=positive_int, default=64)
    ap.add_argument("--load-fractions", type=lambda s: comma_list(s, positive_float, "fractions > 0"), default=[0.25, 0.5, 0.75],
                    help="request rates as fractions of the probe's capacity")
    ap.add_argument("--rates", default=[], help="explicit request rates (req/s, comma list) instead of fractions",
                    type=lambda s: comma_list(s, positive_float, "rates (req/s) > 0", distinct=False))
    ap.add_argument("--duration-s", type=positive_float, default=35.0, help="arrival window per rate")
    ap.add_argument("--request-timeout-s", type=positive_float, default=120.0)
    ap.add_argument("--engine-start-timeout-s", type=positive_float, default=180.0)
    ap.add_argument("--budget-s", type=positive_float, default=480.0, help="stop starting new rates after this")
    ap.add_argument("--base-port", type=port_int, default=18000)
    ap.add_argument("--engine-python", default=sys.executable)
    ap.add_argument("--pdlb-cmd", default=f"{sys.executable} -c 'from pdlb_cli.serve import main; main()'",
                    help="command that runs pdlb serve (shell words)")
    a = ap.parse_args(argv)
    a.engine_device = a.engine_device or ("cpu" if a.device == "cpu" else "cuda:0")
    global LOG_PATH
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG_PATH = out / "log.txt"
    deadline = time.time() + a.budget_s
    env = environment()
    log(f"environment: {json.dumps({k: v for k, v in env.items() if k != 'nvidia_smi'})}")
    rc = 0
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        if time.time() > deadline - 60:
            log(f"{name}: skipped, budget spent")
            continue
        arch = (TINY if a.tiny else ARCHS)[name]
        try:
            rec = run_model(name, arch, a, deadline)
        except Exception as e:  # noqa: BLE001 -- the next model still runs
            import traceback

            log(f"{name}: FAILED {e!r}\n{traceback.format_exc()}")
            rc = 1
            continue
        rec["environment"] = env
        with gzip.open(out / f"gpu_run_{name}.json.gz", "wt") as fh:
            json.dump(rec, fh)
        log(f"{name}: wrote {out / f'gpu_run_{name}.json.gz'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
