"""NVIDIA Dynamo's offline trace replay as a peer simulator: install it, run it, run pdlb alike.

Used by ``bench/sim_vs_dynamo.py`` and the slow test ``tests/sim/validation/test_sim_vs_dynamo.py``.

Dynamo's replay (``dynamo.replay.run_trace_replay``; a Rust "mocker" engine per worker) is installed
from the package registry into a cache venv the first time, ``$PEER_VENV`` or
``~/.cache/pdlb-peers/dynamo`` (``$XDG_CACHE_HOME`` respected), the same place as the shared
``peers/dynamo_replay.sh``: ``ai-dynamo`` and ``ai-dynamo-runtime`` pinned to
:data:`DYNAMO_VERSION` without their dependencies (the full set pulls a stub that downloads from a
host that is not reachable here; the replay path needs only :data:`REPLAY_DEPS`). Nothing of
Dynamo is copied into pdlb: it runs in its own interpreter and answers one JSON line.

The parameters that matter when comparing with pdlb (:class:`MockerEngine`):

* ``trace_block_size``: the tokens per hash id *in the trace* (Mooncake: 512). Dynamo synthesizes
  tokens from the hash ids with it; it is not the engine's block size.
* ``block_size``: the mocker engine's KV block size (Dynamo's default 64). The engine hashes the
  synthesized tokens in blocks of this size for its prefix cache. pdlb's engine blocks are the
  trace's blocks, so an aligned run sets ``block_size = trace_block_size``.
* ``num_gpu_blocks``: the KV capacity of one worker in engine blocks (Dynamo's default 16,384 of
  64 tokens = 1,048,576 tokens, more than an 80 GB GPU holds for an 8B model); pdlb's equivalent is
  ``PoolConfig.kv_capacity_tokens`` = ``num_gpu_blocks * block_size``.
* ``max_num_seqs`` / ``max_num_batched_tokens``: batch limits (Dynamo defaults 256 / 8192 = pdlb's
  ``max_decode_batch`` / ``max_prefill_tokens`` defaults).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sim.run.cluster import build_perf, simulate  # noqa: E402
from sim.run.metrics import summarize  # noqa: E402
from sim.perf.polynomial import mocker_polynomial_factory  # noqa: E402
from sim.scenario import PoolConfig, Scenario  # noqa: E402
from sim.workload import default_trace_path, read_trace  # noqa: E402

DYNAMO_VERSION = "1.6.1"
REPLAY_DEPS = ("typing_extensions", "pydantic<=2.13.5", "pyyaml", "numpy", "uvloop")
#: Dynamo mocker defaults (``dynamo.mocker`` with no engine args, ai-dynamo 1.6.1)
DYNAMO_DEFAULT_BLOCK_SIZE = 64
DYNAMO_DEFAULT_NUM_GPU_BLOCKS = 16_384
#: the Mooncake traces' tokens per hash id
TRACE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class MockerEngine:
    """The Dynamo mocker engine of every worker (its vLLM-style scheduler, default polynomial timing).

    ``block_size``: engine KV block in tokens; ``num_gpu_blocks``: KV blocks per worker;
    ``max_num_seqs``: most running sequences; ``max_num_batched_tokens``: tokens per pass."""

    block_size: int = DYNAMO_DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = DYNAMO_DEFAULT_NUM_GPU_BLOCKS
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks


def peer_venv() -> Path:
    """The cache venv Dynamo is installed into (see module docstring)."""
    if os.environ.get("PEER_VENV"):
        return Path(os.environ["PEER_VENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pdlb-peers" / "dynamo"


def ensure_dynamo(venv: Path | None = None) -> Path:
    """Install Dynamo's replay into ``venv`` (default :func:`peer_venv`) unless it imports there
    already; returns the venv's python. Raises ``RuntimeError`` with pip's output when installing
    fails (e.g. no registry reachable)."""
    venv = venv or peer_venv()
    py = venv / "bin" / "python"
    if py.exists() and _run([str(py), "-c", "import dynamo.replay"], check=False).returncode == 0:
        return py
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", f"ai-dynamo=={DYNAMO_VERSION}", f"ai-dynamo-runtime=={DYNAMO_VERSION}"])
    _run([*pip, *REPLAY_DEPS])
    _run([str(py), "-c", "import dynamo.replay"])
    return py


def write_trace(dest: Path, source: Path | None = None, limit: int | None = None) -> Path:
    """Write the first ``limit`` requests (None: all) of the Mooncake JSONL trace ``source`` (plain
    or ``.gz``; None: pdlb's embedded copy of the conversation trace) to ``dest`` as plain JSONL,
    the form both simulators read. Returns ``dest``."""
    source = source or default_trace_path()
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt") as f, open(dest, "w") as out:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            out.write(line)
    return dest


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({out.returncode}): {(out.stderr or out.stdout)[-2000:]}")
    return out


# Runs in Dynamo's venv: argv[1] is a JSON object of run_trace_replay's arguments.
_REPLAY = """
import json, sys, time
from dynamo.replay import run_trace_replay
a = json.loads(sys.argv[1])
t0 = time.perf_counter()
report = run_trace_replay([a["trace"]], num_workers=a["num_workers"], router_mode=a["router_mode"],
                          trace_block_size=a["trace_block_size"], extra_engine_args=a["engine_args"])
wall = time.perf_counter() - t0
out = {k: v for k, v in report.summary.items() if isinstance(v, (int, float, str))}
print(json.dumps({"wall_s": wall, **out}))
"""


def run_dynamo(trace: Path, router_mode: str, num_workers: int, engine: MockerEngine | None = None,
               trace_block_size: int = TRACE_BLOCK_SIZE, python: Path | None = None) -> dict:
    """Dynamo's replay of ``trace`` (Mooncake JSONL) on ``num_workers`` aggregated mocker workers.

    ``router_mode``: ``round_robin`` or ``kv_router``. ``engine``: the mocker's engine arguments
    (None: Dynamo's defaults, no engine arguments passed). Returns the replay summary (``mean_ttft_ms``,
    ``p99_ttft_ms``, ``prefix_cache_reused_ratio``, ...) plus ``wall_s``, the seconds
    ``run_trace_replay`` took (the interpreter's start and imports excluded)."""
    py = python or ensure_dynamo()
    engine_args = None if engine is None else {"engine": asdict(engine)}
    args = {"trace": str(trace), "router_mode": router_mode, "num_workers": num_workers,
            "trace_block_size": trace_block_size, "engine_args": engine_args}
    env = {**os.environ, "DYN_LOG": "error", "RUST_LOG": "error"}
    out = subprocess.run([str(py), "-c", _REPLAY, json.dumps(args)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"dynamo replay failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pdlb_scenario(num_workers: int, kv_capacity_tokens: int | None = None, max_prefill_tokens: int = 8192,
                  max_decode_batch: int = 256, kv_accounting: str = "shared") -> Scenario:
    """pdlb's side: ``num_workers`` aggregated Llama-3.1-8B engines on H100 (one GPU each),
    ``max_prefill_tokens`` chunked prefill, 512-token blocks; ``kv_capacity_tokens`` per engine
    overrides the roofline's memory budget (None: the roofline's, 411,525 tokens);
    ``kv_accounting``: :attr:`sim.scenario.Scenario.kv_accounting`."""
    return Scenario(name=f"agg-{num_workers}", model="llama-3.1-8b", hardware="h100", block_size=TRACE_BLOCK_SIZE,
                    mixed=PoolConfig(num_engines=num_workers, max_prefill_tokens=max_prefill_tokens,
                                     max_decode_batch=max_decode_batch, kv_capacity_tokens=kv_capacity_tokens),
                    kv_accounting=kv_accounting)


def pdlb_roofline_capacity_blocks(num_workers: int = 8) -> int:
    """KV blocks (of the trace's 512 tokens) per engine of :func:`pdlb_scenario` by the roofline."""
    sc = pdlb_scenario(num_workers)
    return build_perf(sc, sc.mixed).kv_capacity_tokens_per_rank // TRACE_BLOCK_SIZE


def run_pdlb(trace: Path, policy: str, num_workers: int, engine: MockerEngine | None = None,
             kv_accounting: str = "shared") -> dict:
    """pdlb's simulation of ``trace`` with ``policy``. ``engine`` None: the roofline engine of
    :func:`pdlb_scenario`; else the aligned engine: Dynamo's mocker polynomial
    (:mod:`sim.perf.polynomial`) with the engine's KV capacity (``engine.block_size`` must be the
    trace's block size). ``kv_accounting``: the mixed ranks' (``"shared"``, pdlb's default, or
    ``"reserve"``). Returns ``wall_s`` (reading the trace included, as for Dynamo),
    ``mean_ttft_ms``, ``p99_ttft_ms``, ``hit`` and ``events_per_request``."""
    t0 = time.perf_counter()
    requests = read_trace(trace)
    if engine is None:
        res = simulate(pdlb_scenario(num_workers, kv_accounting=kv_accounting), requests, policy)
    else:
        if engine.block_size != TRACE_BLOCK_SIZE:
            raise ValueError(f"pdlb's engine blocks are the trace's ({TRACE_BLOCK_SIZE} tokens), got {engine.block_size}")
        sc = pdlb_scenario(num_workers, engine.kv_capacity_tokens, engine.max_num_batched_tokens, engine.max_num_seqs,
                           kv_accounting)
        res = simulate(sc, requests, policy, perf_factory=mocker_polynomial_factory())
    wall = time.perf_counter() - t0
    s = summarize(res)
    return {"wall_s": wall, "mean_ttft_ms": 1e3 * s["ttft_s"]["mean"], "p99_ttft_ms": 1e3 * s["ttft_s"]["p99"],
            "hit": s["prefix_hit_rate"], "events_per_request": res.num_waits / max(1, len(requests))}
