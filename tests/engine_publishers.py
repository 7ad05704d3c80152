"""The engines' OWN KV-event publisher code, loaded from their registry wheels at test time.

Nothing of the engines is copied into this repository: :func:`engine_wheel` downloads the wheel
(``pip download --no-deps``) once into a cache directory (``$PDLB_TEST_CACHE``, default
``~/.cache/pdlb-tests``; CI keeps it between runs), :func:`load_sglang` / :func:`load_vllm` extract
the few pure-Python files needed and import them under the engine's own module names, with the
engine's package ``__init__`` files skipped (they pull in torch, CUDA kernels and the server):

* SGLang 0.5.23: ``sglang/srt/disaggregation/kv_events.py`` (its ``ZmqEventPublisher``,
  ``KVEventBatch``, ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, ``StorageMedium``)
  and what it imports (``runtime_context``, ``utils/network``, ``arg_groups``), all real. Needs
  ``msgspec``, ``psutil``, ``pyzmq``, ``pydantic`` (the ``test`` extra has them).
* vLLM 0.33.0: ``vllm/distributed/kv_events.py`` (its ``ZmqEventPublisher``, ``KVEventBatch``,
  events, ``MEDIUM_STORAGE``), ``vllm/v1/core/block_pool.py`` (``BlockPool``: the GPU prefix cache
  whose ``cache_full_blocks`` / eviction / reset queue the events), ``vllm/v1/core/kv_cache_utils.py``
  (block hasher, ``KVCacheBlock``, free queue) and ``vllm/utils/hashing.py`` (``sha256_cbor``),
  with ``vllm.logger``, ``vllm.envs``, ``vllm.utils.network_utils`` real. The modules of
  :data:`VLLM_STAND_INS` import torch and are only named as types by that code: stand-ins.
  Needs ``msgspec`` and ``cbor2``.

:class:`EngineRank` drives one engine DP rank: vLLM's GPU tier through its own ``BlockPool``
(:meth:`EngineRank.serve`: the hits, allocations, evictions and events its scheduler makes); other
tiers, and SGLang (whose radix cache needs its CUDA kernels), through a small prefix cache of its
own (engine block hashes chained over full blocks: sha256 of the parent hash and the block's
tokens, a signed 64-bit int for SGLang; pdlb treats them as opaque) whose stores and evictions
become the engine's own event objects. Everything is published through the engine's own
``ZmqEventPublisher`` (PUB ``[topic, seq, payload]`` and the replay ROUTER). Faults are made
without touching the engine code: :meth:`EngineRank.drop_next` loses batches on the wire only
(the publisher still buffers them for replay), :meth:`EngineRank.restart` shuts the publisher
down and starts a new one on the same ports (new numbering, empty buffer, the socket goes away),
:meth:`EngineRank.publish_raw_events` publishes events the engine's encoder accepts but no
consumer can decode, :meth:`EngineRank.force_next_seq` makes the next batch carry a given number.

Hybrid KV groups (``group_idx``, sliding windows) can be added to :meth:`EngineRank.store` by the
tests that need them; the loader and the fault hooks are shared.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import itertools
import os
import subprocess
import sys
import threading
import time
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"

#: tags to fetch the wheels with, whatever interpreter runs the tests (only .py files are read)
_PIP_TAGS = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
             *(a for p in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                           "manylinux2014_x86_64") for a in ("--platform", p))]


def cache_dir() -> Path:
    d = Path(os.environ.get("PDLB_TEST_CACHE", "~/.cache/pdlb-tests")).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def engine_wheel(name: str, version: str, timeout_s: float = 900.0) -> Path:
    """The engine's wheel in the cache directory, downloaded with ``pip download --no-deps`` on
    first use (serialised by a lock file: several test processes may ask at once). Skips the
    test, saying why, when the registry cannot be reached."""
    d = cache_dir()
    with open(d / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        have = sorted(d.glob(f"{name}-{version}-*.whl"))
        if have:
            return have[0]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *_PIP_TAGS, f"{name}=={version}",
               "-d", str(d)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip download {name}=={version} took over {timeout_s:.0f} s")
        have = sorted(d.glob(f"{name}-{version}-*.whl"))
        if done.returncode != 0 or not have:
            pytest.skip(f"could not download {name}=={version}: {done.stderr.strip()[-300:]}")
        return have[0]


def _extract(wheel: Path, prefix: str, dest: Path) -> Path:
    """The wheel's ``.py`` files under ``prefix`` extracted once into ``dest`` (returned)."""
    done = dest / ".extracted"
    if not done.exists():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest, [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".py")])
        done.write_text(wheel.name)
    return dest


def _bare_packages(root: Path, names: list[str]) -> None:
    """Register ``names`` as packages whose ``__init__`` is not run (their modules load from ``root``)."""
    for name in names:
        if name in sys.modules and getattr(sys.modules[name], "__path__", None) == [str(root / name.replace(".", "/"))]:
            continue
        m = types.ModuleType(name)
        m.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = m


_LOADED: dict[str, Any] = {}
_LOAD_LOCK = threading.Lock()


def load_sglang() -> Any:
    """SGLang's own ``sglang.srt.disaggregation.kv_events`` module (see the module docstring)."""
    with _LOAD_LOCK:
        if "sglang" not in _LOADED:
            for dep in ("msgspec", "psutil"):
                pytest.importorskip(dep)
            wheel = engine_wheel("sglang", SGLANG_VERSION)
            root = _extract(wheel, "sglang/srt/", cache_dir() / f"sglang-{SGLANG_VERSION}-src")
            _bare_packages(root, ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation",
                                  "sglang.srt.arg_groups"])
            _LOADED["sglang"] = importlib.import_module("sglang.srt.disaggregation.kv_events")
        return _LOADED["sglang"]


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _StandIn(metaclass=_AnyMeta):
    """Whatever a stand-in module is asked for: a class that takes any arguments (a type in an
    annotation or an isinstance check the code under test never reaches)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.__dict__.update(kw)


def _stand_in(name: str) -> None:
    m = types.ModuleType(name)

    def attr(a: str) -> Any:
        if a.startswith("__"):
            raise AttributeError(a)
        return _StandIn

    m.__getattr__ = attr  # type: ignore[method-assign]
    m.__path__ = []  # type: ignore[attr-defined]
    m.__doc__ = "pdlb test stand-in: the real module imports torch"
    sys.modules[name] = m


#: vLLM modules that import torch (or its model config) at import time and are only named, as
#: types, by the code under test: replaced by stand-ins (every other vLLM module loaded is vLLM's)
VLLM_STAND_INS = ("vllm.config", "vllm.config.kv_events", "vllm.multimodal.utils", "vllm.v1.kv_cache_interface",
                  "vllm.v1.request", "vllm.v1.utils", "vllm.v1.core.kv_cache_metrics")


def load_vllm() -> Any:
    """vLLM's own modules, as a namespace: ``kv_events`` (``vllm/distributed/kv_events.py``),
    ``block_pool`` (``vllm/v1/core/block_pool.py``), ``kv_cache_utils``
    (``vllm/v1/core/kv_cache_utils.py``), ``hashing`` (``vllm/utils/hashing.py``), loaded
    without torch: the modules in :data:`VLLM_STAND_INS` are stand-ins (``KVEventsConfig``,
    which the publisher only records; ``Request``, ``KVCacheSpec`` classes, the metrics collector
    and ``get_mm_features_in_window``, only named as types or used for multimodal requests)."""
    with _LOAD_LOCK:
        if "vllm" not in _LOADED:
            for dep in ("msgspec", "cbor2"):
                pytest.importorskip(dep)
            wheel = engine_wheel("vllm", VLLM_VERSION)
            root = _extract(wheel, "vllm/", cache_dir() / f"vllm-{VLLM_VERSION}-src")
            _bare_packages(root, ["vllm", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed",
                                  "vllm.multimodal"])
            for name in VLLM_STAND_INS:
                _stand_in(name)
            _LOADED["vllm"] = types.SimpleNamespace(
                kv_events=importlib.import_module("vllm.distributed.kv_events"),
                block_pool=importlib.import_module("vllm.v1.core.block_pool"),
                kv_cache_utils=importlib.import_module("vllm.v1.core.kv_cache_utils"),
                hashing=importlib.import_module("vllm.utils.hashing"))
        return _LOADED["vllm"]


class _VllmRequest:
    """The fields of a ``vllm.v1.request.Request`` that vLLM's block hasher and ``BlockPool`` read
    for a plain text request (no LoRA, multimodal input, cache salt or prompt embeddings)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.all_token_ids = list(token_ids)
        self.block_hashes: list[Any] = []
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict = {}
        self.session_id = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def free_port_pair() -> tuple[int, int]:
    """Two free TCP ports on 127.0.0.1 (PUB, replay)."""
    import socket

    out = []
    socks = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        out.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return out[0], out[1]


class _LossyPub:
    """Wraps the publisher's PUB socket: drops the next ``drop`` sends (a loss on the wire; the
    engine code still buffers those batches for replay), forwards everything else."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.drop = 0
        self.calls = 0

    def send_multipart(self, frames: Any, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.drop > 0:
            self.drop -= 1
            return None
        return self._sock.send_multipart(frames, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class EngineRank:
    """One engine DP rank publishing with its own code (``engine``: ``"sglang"`` or ``"vllm"``).

    Args:
        engine: whose publisher and event classes to use.
        block_size: the engine's KV block (page) size in tokens.
        dp_rank: written into each batch by the publisher.
        buffer_steps: the publisher's replay buffer (batches).
    """

    def __init__(self, engine: str, block_size: int = 16, dp_rank: int = 0, buffer_steps: int = 10_000,
                 ports: tuple[int, int] | None = None, num_gpu_blocks: int = 4096) -> None:
        if engine not in ("sglang", "vllm"):
            raise ValueError(f"engine must be sglang or vllm, got {engine!r}")
        self.engine = engine
        if engine == "sglang":
            self.mod = load_sglang()
        else:
            self.vllm = load_vllm()
            self.mod = self.vllm.kv_events
        self.num_gpu_blocks = num_gpu_blocks
        self.pool: Any = None
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.buffer_steps = buffer_steps
        self.port, self.replay_port = ports or free_port_pair()
        self.cached: dict[Any, Any] = {}   # engine hash -> parent engine hash, blocks now cached (per medium)
        self.pub: Any = None
        self._lossy: _LossyPub | None = None
        self._start_publisher()
        self._new_cache()

    def _new_cache(self) -> None:
        """vLLM: a fresh ``BlockPool`` (its own prefix cache, block hasher and event queue)."""
        self.cached.clear()
        if self.engine != "vllm":
            return
        v = self.vllm
        hash_fn = v.hashing.sha256_cbor  # vLLM's default prefix-caching hash
        v.kv_cache_utils.init_none_hash(hash_fn)
        self._hasher = v.kv_cache_utils.get_request_block_hasher(self.block_size, hash_fn)
        self.pool = v.block_pool.BlockPool(num_gpu_blocks=self.num_gpu_blocks, enable_caching=True,
                                           hash_block_size=self.block_size, enable_kv_cache_events=True)

    # -------------------------------------------------------------- publisher lifecycle
    def _start_publisher(self) -> None:
        m = self.mod
        kw = dict(endpoint=f"tcp://*:{self.port}", replay_endpoint=f"tcp://*:{self.replay_port}",
                  buffer_steps=self.buffer_steps)
        # the publisher binds rank r at port + r itself; the rank-0 ports given here are already this rank's
        if self.engine == "sglang":
            self.pub = m.ZmqEventPublisher(attn_dp_rank=0, **kw)
        else:
            self.pub = m.ZmqEventPublisher(data_parallel_rank=0, **kw)
        self.pub.SHUTDOWN_TIMEOUT = 0.2  # its shutdown waits this long for a sentinel it may leave queued
        self._lossy = _LossyPub(self.pub._pub)
        self.pub._pub = self._lossy

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def restart(self) -> None:
        """The engine process restarts: the publisher shuts down (its sockets close) and a new one
        binds the same ports, numbering from 0 with an empty replay buffer and an empty cache."""
        import atexit

        self.pub.shutdown()
        atexit.unregister(self.pub.shutdown)
        self._new_cache()
        for _ in range(100):  # the OS may hold the ports for a moment
            try:
                self._start_publisher()
                return
            except Exception:  # noqa: BLE001 - zmq.ZMQError: address in use
                time.sleep(0.05)
        raise AssertionError(f"could not bind {self.port}/{self.replay_port} again")

    def close(self) -> None:
        import atexit

        self.pub.shutdown()
        atexit.unregister(self.pub.shutdown)  # SGLang's publisher registers it; once is enough

    # -------------------------------------------------------------- faults
    def drop_next(self, n: int = 1) -> None:
        """The next ``n`` batches are lost on the wire (still in the replay buffer)."""
        assert self._lossy is not None
        self._lossy.drop += n

    def force_next_seq(self, seq: int) -> None:
        """The next batch carries ``seq``; the ones after continue from where the counter was."""
        gen = self.pub._seq_gen
        nxt = next(gen)
        self.pub._seq_gen = itertools.chain([seq], itertools.count(nxt))

    def published(self) -> int:
        """Batches this publisher (since the last restart) has sent or dropped on the wire."""
        assert self._lossy is not None
        return self._lossy.calls

    # -------------------------------------------------------------- engine hashes and events
    def block_hash(self, parent: Any, tokens: list[int]) -> int:
        h = hashlib.sha256(repr(parent).encode() + b"|" + ",".join(map(str, tokens)).encode()).digest()
        if self.engine == "sglang":
            return int.from_bytes(h[:8], "big", signed=True)  # SGLang publishes signed 64-bit ints
        return int.from_bytes(h[-8:], "little")

    def hashes(self, tokens: list[int]) -> list[int]:
        out: list[int] = []
        parent = None
        bs = self.block_size
        for i in range(len(tokens) // bs):
            parent = self.block_hash(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def medium(self, name: str) -> Any:
        """The engine's spelling of a medium: ``gpu``, ``cpu``, ``storage`` (vLLM's
        ``MEDIUM_STORAGE``), ``disk`` / ``external`` (SGLang's ``StorageMedium``)."""
        m = self.mod
        if self.engine == "sglang":
            return {"gpu": m.StorageMedium.GPU, "cpu": m.StorageMedium.CPU, "disk": m.StorageMedium.DISK,
                    "external": m.StorageMedium.EXTERNAL}[name]
        return {"gpu": m.MEDIUM_GPU, "cpu": m.MEDIUM_CPU, "storage": m.MEDIUM_STORAGE}[name]

    def stored_event(self, tokens: list[int], medium: str = "gpu", **extra: Any) -> Any:
        """The engine's ``BlockStored`` for the full blocks of ``tokens`` not yet cached in
        ``medium`` (``None`` if all are), parent-linked to the cached block before them."""
        bs = self.block_size
        hs = self.hashes(tokens)
        have = self.cached.setdefault(medium, {})
        first = 0
        while first < len(hs) and hs[first] in have:
            first += 1
        if first == len(hs):
            return None
        parent = hs[first - 1] if first else None
        for i in range(first, len(hs)):
            have[hs[i]] = hs[i - 1] if i else None
        new = hs[first:]
        toks = list(tokens[first * bs:len(hs) * bs])
        m = self.mod
        if self.engine == "sglang":
            return m.BlockStored(block_hashes=new, parent_block_hash=parent, token_ids=toks, block_size=bs,
                                 lora_id=None, medium=self.medium(medium), **extra)
        return m.BlockStored(block_hashes=new, parent_block_hash=parent, token_ids=toks, block_size=bs,
                             lora_id=None, medium=self.medium(medium), lora_name=None, **extra)

    def removed_event(self, tokens: list[int], medium: str = "gpu", **extra: Any) -> Any:
        """The engine's ``BlockRemoved`` for the cached full blocks of ``tokens`` in ``medium``."""
        have = self.cached.setdefault(medium, {})
        gone = [h for h in self.hashes(tokens) if h in have]
        for h in gone:
            del have[h]
        return self.mod.BlockRemoved(block_hashes=gone, medium=self.medium(medium), **extra)

    def cleared_event(self) -> Any:
        self.cached.clear()
        return self.mod.AllBlocksCleared()

    def publish(self, events: list[Any], ts: float | None = None) -> None:
        """One batch of the engine's events, published by its own publisher (its thread sends it)."""
        m = self.mod
        self.pub.publish(m.KVEventBatch(ts=time.time() if ts is None else ts, events=[e for e in events if e]))

    def store(self, tokens: list[int], medium: str = "gpu", ts: float | None = None, **extra: Any) -> None:
        """Cache ``tokens``' full blocks in ``medium`` and publish the event(s) (one batch). vLLM's
        GPU tier goes through its own ``BlockPool`` (:meth:`serve`); the rest are the engine's
        event classes filled here."""
        if self.engine == "vllm" and medium == "gpu" and not extra:
            self.serve(tokens, ts)
            return
        self.publish([self.stored_event(tokens, medium, **extra)], ts)

    def serve(self, tokens: list[int], ts: float | None = None) -> list[Any]:
        """vLLM: run a request of ``tokens`` through the engine's ``BlockPool`` as its scheduler
        does (prefix hit via ``get_cached_block`` + ``touch``, new blocks via ``get_new_blocks``,
        which evicts the least recently freed cached blocks when the pool is full, then
        ``cache_full_blocks`` and ``free_blocks``) and publish the events the pool queued
        (``take_events``). Returns them."""
        assert self.engine == "vllm", "serve() drives vLLM's BlockPool"
        pool = self.pool
        req = _VllmRequest(tokens)
        req.block_hashes = self._hasher(req)
        hit = []
        for h in req.block_hashes:
            got = pool.get_cached_block(h, [0])
            if not got:
                break
            hit.append(got[0])
        pool.touch(hit)
        blocks = hit + pool.get_new_blocks(len(req.block_hashes) - len(hit))
        pool.cache_full_blocks(req, blocks, len(hit), len(req.block_hashes), self.block_size, 0)
        pool.free_blocks(reversed(blocks))
        events = pool.take_events()
        self.publish(events, ts)
        return events

    def remove(self, tokens: list[int]) -> None:
        """Evict ``tokens``' cached GPU blocks and publish the removal (vLLM: ``BlockPool.evict_blocks``)."""
        if self.engine == "vllm":
            req = _VllmRequest(tokens)
            ids = set()
            for h in self._hasher(req):
                got = self.pool.get_cached_block(h, [0])
                if got:
                    ids.add(got[0].block_id)
            self.pool.evict_blocks(ids)
            self.publish(self.pool.take_events())
            return
        self.publish([self.removed_event(tokens)])

    def publish_raw_events(self, events: list[Any], ts: float | None = None) -> None:
        """A batch whose events are whatever ``events`` holds (the engine's encoder takes any
        object): e.g. ``["garbage"]``, which no consumer can decode."""
        self.pub.publish(self.mod.EventBatch(ts=time.time() if ts is None else ts, events=events))

    def wait_sent(self, n: int, timeout_s: float = 10.0) -> None:
        """Block until the publisher's thread has handled ``n`` batches in all."""
        end = time.monotonic() + timeout_s
        while self.published() < n:
            if time.monotonic() > end:
                raise AssertionError(f"{self.engine} publisher sent {self.published()} of {n} batches")
            time.sleep(0.005)
