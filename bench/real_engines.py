"""pdlb in front of real engines: does pdlb's TTFT metric agree with what the client measures?

Issue 30's setup, scripted: N engines started from a config, ``pdlb serve`` (regular mode,
``pd_protocol: none``) in front, driven by the openai client with R requests (every other one
streamed; half of them share a long system prompt). For the streamed requests it compares

* the client's TTFT: from the call to the first chunk that carries generated content
  (``delta.content``, ``delta.tool_calls``, ``delta.reasoning_content``), the baseline;
* the client's time to its first chunk of any kind (the role-only chunk where the engine sends one
  first; what pdlb timed before issue 30);
* pdlb's ``pdlb_time_to_first_token_seconds`` for ``endpoint="chat"`` (mean, from ``/metrics``
  scraped before and after the run);

and prints pdlb/client as a ratio (issue 30's target: within 5%, i.e. 0.95..1.05).

Engines (``--engine``):

* ``emulated`` (default; CPU): ``pdlb engine --role mixed --stream-format transformers``, the
  emulator framing its streams as ``transformers serve`` does (a role-only chunk before prefill,
  no ``[DONE]``), timed by the perf model (``--speed``).
* ``transformers``: ``python -m transformers.cli.transformers serve MODEL --continuous-batching
  --port P --device D --dtype bfloat16 ENGINE_ARGS...`` per engine (GPU; transformers >= 5.17, see
  docs/serving.md). ``--make-random-model DIR`` first writes a random-weight model folder there
  (``--random-model-size 8b``: Llama-3.1-8B's shape, ~15 GB, GPU; ``tiny``: a 2-layer model for a
  CPU smoke run) with a word-level tokenizer over its whole vocabulary and a chat template, so that
  nothing is downloaded.

Config (``--config FILE``, JSON; flags given on the command line win): ``engine``,
``num_engines``, ``base_port``, ``model`` (the model folder for transformers), ``devices`` (one per
engine, cycled; e.g. ``["cuda:0"]``), ``engine_args`` (extra engine flags, a list),
``env`` (extra environment for the engines, e.g. ``{"HF_HUB_CACHE": "/tmp/hf"}``),
``router_args`` (extra ``pdlb serve`` flags), ``requests``, ``concurrency``, ``max_tokens``,
``shared_prefix_words``, ``word_format`` (the prompt words, ``"w{}"``: word ``i`` is ``w<i>``, one
token of ``--make-random-model``'s tokenizer; give the format of another model's vocabulary, since
a prompt of unknown words can make a random model answer special tokens only, no content),
``warmup`` (streamed requests sent first and not counted),
``request_model`` (the ``model`` field sent; default: the engine's own
name: the model folder for transformers, which pins it), ``ready_timeout_s``.
Example (two 8B engines on one H200)::

    {"engine": "transformers", "num_engines": 2, "model": "/tmp/llama8b", "devices": ["cuda:0"],
     "engine_args": ["--cb-max-memory-percent", "0.3"], "env": {"HF_HUB_CACHE": "/tmp/hf"},
     "requests": 160, "concurrency": 16, "max_tokens": 16, "router_args": ["--decode-policy", "cache_aware"]}

Run: ``python bench/real_engines.py`` (CPU, emulated) or
``python bench/real_engines.py --config engines.json --make-random-model /tmp/llama8b``. Needs the
``openai`` package (``pip install openai``). Prints one table and, with ``--out FILE``, writes the
numbers as JSON. Exit status 0 when the ratio is within ``--tolerance`` (default 0.05), 1 if not,
2 when the setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, Any] = {
    "engine": "emulated", "num_engines": 2, "base_port": 18100, "model": None, "devices": ["cuda:0"],
    "engine_args": [], "env": {}, "router_args": [], "requests": 160, "concurrency": 16, "max_tokens": 16,
    "shared_prefix_words": 1200, "word_format": "w{}", "warmup": 4, "request_model": None, "ready_timeout_s": 600.0, "speed": 1.0,
}
ROUTER_PORT_OFFSET = 99  # pdlb serve listens on base_port + this


# ---------------------------------------------------------------------- random model folder
def make_random_model(path: Path, size: str) -> None:
    """Write a random-weight Llama model folder (config, safetensors, tokenizer) at ``path``.

    ``size``: ``8b`` (Llama-3.1-8B's shape: hidden 4096, 32 layers, 32 heads, 8 KV heads,
    vocab 128,256; built on the GPU when there is one) or ``tiny`` (hidden 64, 2 layers, vocab
    128,256). The tokenizer is a ``tokenizers`` WordLevel model mapping ``w<i>`` to id ``i`` (with
    whitespace pre-tokenisation, unknown words to id 0) and a plain chat template; enough for
    ``transformers serve`` to tokenise and detokenise without any download.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = 128_256
    if size == "8b":
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=vocab, max_position_embeddings=8192)
    elif size == "tiny":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=8192)
    else:
        raise ValueError(f"random model size {size!r}: use 8b or tiny")
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = -1  # never stop early: every answer has max_tokens tokens
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
                                   pad_token="w0")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    fast.save_pretrained(path)


# ---------------------------------------------------------------------- processes
@dataclass
class Procs:
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        f = open(log, "wb")
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                             start_new_session=True)
        f.close()
        self.procs.append(p)
        self.logs.append(log)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)


def _pdlb() -> list[str]:
    exe = shutil.which("pdlb", path=str(Path(sys.executable).parent)) or shutil.which("pdlb")
    if exe is None:
        raise SystemExit("the pdlb command is not installed (pip install -e '.[sim]')")
    return [exe]


def engine_command(cfg: dict[str, Any], i: int, port: int) -> list[str]:
    if cfg["engine"] == "emulated":
        return [*_pdlb(), "engine", "--role", "mixed", "--port", str(port), "--stream-format", "transformers",
                "--speed", str(cfg["speed"]), *cfg["engine_args"]]
    if cfg["engine"] == "transformers":
        if not cfg["model"]:
            raise SystemExit("engine transformers needs a model folder (config 'model' or --model)")
        devices = cfg["devices"] or ["cuda:0"]
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(cfg["model"]),
                "--continuous-batching", "--port", str(port), "--device", devices[i % len(devices)],
                "--dtype", "bfloat16", *cfg["engine_args"]]
    raise SystemExit(f"unknown engine {cfg['engine']!r}: emulated or transformers")


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> float:
    """Seconds until ``url`` answered 200; raises SystemExit if the process died or time ran out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited ({proc.returncode}); log {log}:\n"
                             f"{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout_s:g} s; log {log}:\n{log.read_text(errors='replace')[-3000:]}")


# ---------------------------------------------------------------------- load
def ttft_metric(router_url: str, endpoint: str = "chat") -> tuple[float, float]:
    """``(sum_s, count)`` of ``pdlb_time_to_first_token_seconds`` for ``endpoint``."""
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = [0.0, 0.0]
    for i, name in enumerate(("sum", "count")):
        m = re.search(rf'^pdlb_time_to_first_token_seconds_{name}{{endpoint="{endpoint}"}} (\S+)$', text, re.M)
        if m:
            out[i] = float(m.group(1))
    return out[0], out[1]


def _has_content(chunk: Any) -> bool:
    for c in chunk.choices or []:
        d = c.delta
        if d is None:
            continue
        if d.content or d.tool_calls or getattr(d, "reasoning_content", None) or getattr(d, "reasoning", None):
            return True
    return False


async def drive(router_url: str, cfg: dict[str, Any], model: str) -> dict[str, Any]:
    """Warm up (``warmup`` streamed requests, not counted: the openai client's first call spends
    ~0.15 s building itself), snapshot pdlb's TTFT metric, then send ``requests`` requests."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0, timeout=600)

    def word(i: int) -> str:
        return cfg["word_format"].format(i)

    for i in range(cfg["warmup"]):
        s = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": word(50 + i)}],
                                                 max_tokens=2, stream=True)
        async for _ in s:
            pass
    before = ttft_metric(router_url)
    shared = " ".join(word(100 + (i * 7919) % 100_000) for i in range(cfg["shared_prefix_words"]))
    sem = asyncio.Semaphore(cfg["concurrency"])
    ttft, first_chunk, e2e, errors = [], [], [], []

    async def one(i: int) -> None:
        stream = i % 2 == 0
        system = shared if (i // 2) % 2 == 0 else " ".join(word(20_000 + i * 50 + j) for j in range(
            cfg["shared_prefix_words"]))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"{word(300 + i)} {word(400 + i)}"}]
        async with sem:
            t0 = time.monotonic()
            try:
                if stream:
                    got_first = got_content = None
                    s = await client.chat.completions.create(model=model, messages=messages,
                                                             max_tokens=cfg["max_tokens"], stream=True)
                    async for chunk in s:
                        now = time.monotonic()
                        if got_first is None:
                            got_first = now - t0
                        if got_content is None and _has_content(chunk):
                            got_content = now - t0
                    if got_content is None:
                        errors.append(f"request {i}: no content chunk")
                        return
                    ttft.append(got_content)
                    first_chunk.append(got_first)
                else:
                    await client.chat.completions.create(model=model, messages=messages, max_tokens=cfg["max_tokens"])
                e2e.append(time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - counted and shown
                errors.append(f"request {i}: {type(e).__name__}: {str(e)[:200]}")

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(cfg["requests"])))
    wall = time.monotonic() - t0
    await client.close()
    return {"client_ttft_s": ttft, "client_first_chunk_s": first_chunk, "e2e_s": e2e, "errors": errors,
            "wall_s": wall, "before": before}


def _p(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # pdlb_cli.arg_types (standard library only)
    from pdlb_cli.arg_types import nonnegative_int, port_int, positive_float, positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, help="JSON config (module docstring)")
    ap.add_argument("--engine", choices=["emulated", "transformers"])
    ap.add_argument("--num-engines", type=positive_int)
    ap.add_argument("--base-port", type=port_int)
    ap.add_argument("--model", help="model folder (transformers)")
    ap.add_argument("--requests", type=positive_int)
    ap.add_argument("--concurrency", type=positive_int)
    ap.add_argument("--max-tokens", type=positive_int)
    ap.add_argument("--shared-prefix-words", type=nonnegative_int,
                    help="words of the prompt prefix every request shares (default 1200; 0: none)")
    ap.add_argument("--speed", type=positive_float, help="emulated engines: run this many times faster than the perf model")
    ap.add_argument("--make-random-model", type=Path, metavar="DIR",
                    help="write a random-weight model folder at DIR first and serve it (transformers)")
    ap.add_argument("--random-model-size", choices=["8b", "tiny"], default="8b")
    ap.add_argument("--tolerance", type=positive_float, default=0.05, help="allowed |pdlb/client - 1| (default: 0.05)")
    ap.add_argument("--logs", type=Path, help="folder for the engines' and router's logs (default: a temp dir)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)

    cfg = dict(DEFAULTS)
    if args.config:
        extra = json.loads(args.config.read_text())
        unknown = set(extra) - set(DEFAULTS)
        if unknown:
            ap.error(f"unknown config keys: {', '.join(sorted(unknown))} (known: {', '.join(sorted(DEFAULTS))})")
        cfg.update(extra)
    for k in ("engine", "num_engines", "base_port", "model", "requests", "concurrency", "max_tokens",
              "shared_prefix_words", "speed"):
        v = getattr(args, k)
        if v is not None:
            cfg[k] = v
    if args.make_random_model is not None:
        t = time.monotonic()
        make_random_model(args.make_random_model, args.random_model_size)
        print(f"random {args.random_model_size} model written to {args.make_random_model} in "
              f"{time.monotonic() - t:.1f} s", flush=True)
        cfg["model"] = str(args.make_random_model)
        cfg["engine"] = "transformers" if args.engine is None and not args.config else cfg["engine"]
    logs = args.logs or Path(tempfile.mkdtemp(prefix="pdlb-real-engines-"))
    logs.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    try:
        urls = []
        t_start = time.monotonic()
        for i in range(cfg["num_engines"]):
            port = cfg["base_port"] + i
            procs.start(engine_command(cfg, i, port), logs / f"engine{i}.log", {k: str(v) for k, v in cfg["env"].items()})
            urls.append(f"http://127.0.0.1:{port}")
        for i, u in enumerate(urls):
            wait_ready(u + "/health", procs.procs[i], cfg["ready_timeout_s"], procs.logs[i])
        engines_ready_s = time.monotonic() - t_start
        router_port = cfg["base_port"] + ROUTER_PORT_OFFSET
        router = procs.start([*_pdlb(), "serve", "--port", str(router_port), "--pd-protocol", "none", "--processes", "1",
                              "--mixed", *urls, *cfg["router_args"]], logs / "router.log")
        router_url = f"http://127.0.0.1:{router_port}"
        wait_ready(router_url + "/health", router, 60, procs.logs[-1])
        model = cfg["request_model"] or (str(cfg["model"]) if cfg["engine"] == "transformers" else "pdlb-emulated")
        res = asyncio.run(drive(router_url, cfg, model))
        before, after = res["before"], ttft_metric(router_url)
    except SystemExit as e:
        print(f"setup failed: {e}", file=sys.stderr)
        return 2
    finally:
        procs.stop()
    n_pdlb = after[1] - before[1]
    pdlb_mean = (after[0] - before[0]) / n_pdlb if n_pdlb else float("nan")
    ttft, fc = res["client_ttft_s"], res["client_first_chunk_s"]
    client_mean = statistics.fmean(ttft) if ttft else float("nan")
    ratio = pdlb_mean / client_mean if ttft and n_pdlb else float("nan")
    ok = abs(ratio - 1.0) <= args.tolerance
    out = {"engine": cfg["engine"], "num_engines": cfg["num_engines"], "requests": cfg["requests"],
           "streamed_measured": len(ttft), "pdlb_ttft_observations": n_pdlb, "errors": res["errors"],
           "engines_ready_s": engines_ready_s, "wall_s": res["wall_s"],
           "client_ttft_mean_s": client_mean, "client_ttft_p50_s": _p(ttft, 0.5), "client_ttft_p90_s": _p(ttft, 0.9),
           "client_first_chunk_mean_s": statistics.fmean(fc) if fc else float("nan"),
           "pdlb_ttft_mean_s": pdlb_mean, "ratio_pdlb_over_client": ratio, "within_tolerance": ok,
           "e2e_p50_s": _p(res["e2e_s"], 0.5), "logs": str(logs)}
    print(f"engines: {cfg['num_engines']} x {cfg['engine']}  requests: {cfg['requests']} "
          f"({len(ttft)} streamed measured, {len(res['errors'])} errors)  wall {res['wall_s']:.1f} s")
    print(f"{'measure':<44}{'mean s':>10}{'p50 s':>10}{'p90 s':>10}")
    print(f"{'client TTFT (first content chunk), baseline':<44}{client_mean:>10.4f}{_p(ttft, .5):>10.4f}{_p(ttft, .9):>10.4f}")
    print(f"{'client first chunk of any kind':<44}{out['client_first_chunk_mean_s']:>10.4f}{_p(fc, .5):>10.4f}"
          f"{_p(fc, .9):>10.4f}")
    print(f"{'pdlb_time_to_first_token_seconds (chat)':<44}{pdlb_mean:>10.4f}")
    print(f"ratio pdlb / client TTFT: {ratio:.4f}  ({'within' if ok else 'OUTSIDE'} {args.tolerance:.0%}); "
          f"first chunk / TTFT: {out['client_first_chunk_mean_s'] / client_mean if ttft else float('nan'):.3f}")
    for e in res["errors"][:5]:
        print("  error:", e)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0 if ok and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
