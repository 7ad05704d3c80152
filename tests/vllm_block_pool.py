"""Loads vLLM's own KV-cache bookkeeping code (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``
and ``vllm/distributed/kv_events.py``) from the registry's wheel, without torch, for tests.

Nothing of vLLM is copied into pdlb: the wheel is downloaded at test time (``pip download
vllm==VERSION --no-deps``) into a cache folder (``PDLB_WHEEL_CACHE``, default
``~/.cache/pdlb-wheels``; CI keeps it between runs), or taken from ``PDLB_VLLM_WHEEL``. The three
modules are executed from the wheel's own source under their real names; what they import from
the rest of vLLM (config, logger, torch-backed specs) is replaced by empty stand-ins, since the
code paths used here (``BlockPool.cache_full_blocks``, ``free_blocks``, ``get_new_blocks``,
``take_events`` and the event structs' msgspec encoding) never reach them.

If the events engineer's shared harness (``tests/engine_publishers.py``) lands, this loader can
be folded into it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"

_FILES = {
    "vllm.v1.core.kv_cache_utils": "vllm/v1/core/kv_cache_utils.py",
    "vllm.distributed.kv_events": "vllm/distributed/kv_events.py",
    "vllm.v1.core.block_pool": "vllm/v1/core/block_pool.py",
}


def vllm_wheel(version: str = VLLM_VERSION) -> Path:
    """The path of vLLM ``version``'s wheel: ``PDLB_VLLM_WHEEL``, else downloaded once into the
    wheel cache. Raises ``RuntimeError`` (with pip's message) when it cannot be had."""
    given = os.environ.get("PDLB_VLLM_WHEEL")
    if given:
        return Path(given)
    cache = Path(os.environ.get("PDLB_WHEEL_CACHE", Path.home() / ".cache" / "pdlb-wheels"))
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-d", str(cache)],
                       capture_output=True, text=True)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if r.returncode or not found:
        raise RuntimeError(f"pip download vllm=={version} failed: {r.stderr[-2000:]}")
    return found[0]


class _Anything:
    """A stand-in for any name the loaded modules import but never use on the paths tested."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> type:
        return cls


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package, so that submodules can be registered under it
    m.__dict__.update(attrs)
    m.__getattr__ = lambda attr: type(attr, (_Anything,), {})  # type: ignore[method-assign]
    return m


def load_vllm(version: str = VLLM_VERSION, int_hashes: bool = True) -> types.SimpleNamespace:
    """vLLM's ``kv_cache_utils``, ``kv_events`` and ``block_pool`` modules, loaded from the
    wheel (``int_hashes``: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM's default, events carry
    the low 64 bits of each sha256 as an int). Also ``sha256``, a block hash function of the
    kind vLLM uses (sha256 of the pickled ``(parent, tokens, extra_keys)``)."""
    wheel = vllm_wheel(version)
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    try:
        for k in saved:
            del sys.modules[k]
        stubs = {
            "vllm": {}, "vllm.envs": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": int_hashes},
            "vllm.config": {}, "vllm.config.kv_events": {},
            "vllm.logger": {"init_logger": logging.getLogger},
            "vllm.multimodal": {}, "vllm.multimodal.utils": {},
            "vllm.utils": {}, "vllm.utils.hashing": {}, "vllm.utils.network_utils": {},
            "vllm.utils.math_utils": {"cdiv": lambda a, b: -(-a // b)},
            "vllm.v1": {}, "vllm.v1.kv_cache_interface": {"iter_layer_specs": lambda s: (s,)},
            "vllm.v1.kv_cache_spec_registry": {}, "vllm.v1.request": {}, "vllm.v1.utils": {},
            "vllm.v1.core": {}, "vllm.v1.core.kv_cache_metrics": {}, "vllm.v1.metrics": {},
            "vllm.v1.metrics.stats": {}, "vllm.distributed": {},
        }
        for name, attrs in stubs.items():
            sys.modules[name] = _stub(name, **attrs)
            if "." in name:  # `from vllm import envs` reads the parent's attribute
                parent, _, child = name.rpartition(".")
                setattr(sys.modules[parent], child, sys.modules[name])
        out = {}
        with zipfile.ZipFile(wheel) as z:
            for name, path in _FILES.items():
                src = z.read(path).decode()
                mod = types.ModuleType(name)
                mod.__file__ = f"{wheel.name}!{path}"
                sys.modules[name] = mod
                exec(compile(src, mod.__file__, "exec"), mod.__dict__)
                out[name.rsplit(".", 1)[1]] = mod
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)

    def sha256(x: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    out["kv_cache_utils"].init_none_hash(sha256)
    return types.SimpleNamespace(**out, sha256=sha256, wheel=wheel)


class FakeRequest:
    """The fields of ``vllm.v1.request.Request`` that ``BlockPool`` reads: token ids, the
    chained block hashes at ``hash_block_size`` (vLLM's ``hash_block_tokens``), no LoRA, no
    multimodal input, no cache salt."""

    def __init__(self, vllm: types.SimpleNamespace, token_ids: list[int], hash_block_size: int) -> None:
        self.request_id = f"req-{id(self)}"
        self.all_token_ids = list(token_ids)
        self.lora_request = None
        self.session_id = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.block_hashes: list[bytes] = []
        parent = None
        for i in range(len(token_ids) // hash_block_size):
            parent = vllm.kv_cache_utils.hash_block_tokens(
                vllm.sha256, parent, token_ids[i * hash_block_size:(i + 1) * hash_block_size])
            self.block_hashes.append(parent)
