"""Model specs from a Hugging Face ``config.json``: any Llama, Qwen2/3, Qwen3-MoE, Mixtral or
DeepSeek V2/V3/V4 checkpoint can be simulated by its config file.

:func:`model_from_hf_config` reads the architecture dimensions the roofline needs; everything the
roofline does not need (RoPE scaling, norms' epsilon, activation) is ignored. A scenario names it
with ``model = "path/to/config.json"`` (or a folder holding ``config.json``); the shipped configs in
``sim/data/models/`` are presets (their ``_source`` key names the repository they came from).

Supported ``architectures[0]`` (field names as in the Transformers configs):

* ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``: GQA,
  ``num_key_value_heads`` (default: heads), ``head_dim`` (default ``hidden_size / heads``),
  ``intermediate_size``, ``tie_word_embeddings``. Qwen2's q/k/v biases and Qwen3's q/k norms
  (< 0.01% of the parameters) are not counted.
* ``Qwen3MoeForCausalLM``: + ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``;
  ``mlp_only_layers`` must be empty and ``decoder_sparse_step`` 1 (every layer MoE).
* ``MixtralForCausalLM``: ``num_local_experts`` experts of width ``intermediate_size``, top
  ``num_experts_per_tok``, every layer MoE.
* ``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: MLA (``q_lora_rank`` may be null,
  ``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``), ``n_routed_experts``,
  ``n_shared_experts``, ``first_k_dense_replace``; node-limited routing ``topk_group`` when
  ``n_group > 1``.
* ``DeepseekV4ForCausalLM``: compressed attention (``compress_ratios`` of the first
  ``num_hidden_layers`` layers, ``sliding_window``, ``index_topk``, ``index_n_heads``,
  ``index_head_dim``, ``o_lora_rank``, ``o_groups``, ``hc_mult``); KV rows of
  ``(head_dim - qk_rope) FP8 + qk_rope BF16 + UE8M0 scales per 64, padded to 8`` bytes (584 for
  V4-Flash) and indexer keys of ``index_head_dim + 4`` bytes; ``"expert_dtype": "fp4"`` gives FP4
  experts (0.5 + 1/32 bytes per weight).
* ``DeepseekV41ForCausalLM``: the language model is the nested ``text_config`` (NeMo AutoModel's
  ``DeepseekV41Config``: "Nested checkpoint configuration"; TensorRT-LLM's: "nesting the two above
  plus a **top-level** ``quantization_config``"), whose top-level ``quantization_config`` is carried
  into it. CSA2 attention (``compress_ratios`` of the first ``num_hidden_layers`` layers, values
  0/1/2..., ``kv_source_layer_ids``, ``index_source_layer_ids``, ``candidate_source_layer_id`` with
  ``candidate_topk_blocks * candidate_block_size`` candidates, ``sliding_window``, ``index_topk``,
  ``index_n_heads``, ``index_head_dim``), global records of ``head_dim * (0.5 + 1/16)`` (NVFP4 main)
  + ``index_head_dim * (0.5 + 1/32)`` (MXFP4 index) bytes and window rows of ``head_dim * (1 +
  1/32)`` bytes (288 / 68 / 528 for V4.1-Flash, TensorRT-LLM's CSA2 README), Engram
  (``engram_layer_ids``, ``engram_num_embeddings``, ``engram_max_ngram_size``, ``engram_n_heads``,
  ``engram_head_dim``), routed experts MXFP4 unless ``quantization_config.expert_dtype`` says
  ``fp8``. The causal encoder-decoder split is at the last KV source when it is unpooled (ratio 1),
  not the last layer, and no Engram layer follows it (vLLM's decoder-replay conditions); the decoder
  then replays ``sliding_window`` rows per prefill chunk. Otherwise every layer runs every prompt
  token.

Weight bytes: 1 with an ``fp8`` ``quantization_config``, else 2 (``torch_dtype`` bfloat16/float16);
KV bytes 2 (BF16 cache) except V4 (its own FP8 layout).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from sim.models.spec import ModelSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "load_hf_config", "model_from_hf_config"]

_DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = _DENSE + _MOE + _DEEPSEEK + ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM")
#: upper bound on a config file's size (bytes): config.json files are a few kB
MAX_CONFIG_BYTES = 4 << 20


class UnsupportedArchitectureError(ValueError):
    """The config's architecture is not one :func:`model_from_hf_config` can map."""


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object of ``path`` (a ``config.json`` or a folder holding one).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a JSON object, or larger than :data:`MAX_CONFIG_BYTES`.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"model config {p} not found")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{p}: {p.stat().st_size:,} bytes is not a config.json (limit {MAX_CONFIG_BYTES:,})")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a config.json must hold a JSON object")
    return data


def _get(cfg: dict[str, Any], key: str, where: str, default: Any = ...) -> Any:  # noqa: ANN401
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise ValueError(f"{where}: config has no {key!r}")
    return default


def _int(cfg: dict[str, Any], key: str, where: str, default: Any = ..., *, minimum: int = 0) -> int:  # noqa: ANN401
    v = _get(cfg, key, where, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _weight_bytes(cfg: dict[str, Any]) -> int:
    q = cfg.get("quantization_config") or {}
    if isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "fp8":
        return 1
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
    if dt in ("bfloat16", "float16", "bf16", "fp16"):
        return 2
    if dt in ("float8_e4m3fn", "fp8"):
        return 1
    raise ValueError(f"unsupported torch_dtype {dt!r} (bfloat16, float16 or an fp8 quantization_config)")


def model_from_hf_config(config: dict[str, Any] | str | os.PathLike[str], name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` (a dict, a file or a folder).

    ``name`` defaults to the config's ``_name`` key, else the file's folder name, else the
    architecture. Multimodal configs with a ``text_config`` use it.

    Raises:
        UnsupportedArchitectureError: ``architectures[0]`` is not in :data:`SUPPORTED_ARCHITECTURES`,
            or a variant the roofline does not model (sparse-step MoE, dense-only layers of Qwen3-MoE).
        ValueError: a required dimension is missing or malformed (the message names it).
        FileNotFoundError: ``config`` is a path that does not exist.
    """
    if not isinstance(config, dict):
        path = Path(config)
        cfg = load_hf_config(path)
        name = name or cfg.get("_name") or (path.parent.name if path.name == "config.json" else path.stem)
    else:
        cfg = config
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
        top_quant = cfg.get("quantization_config")
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
        if top_quant is not None and not cfg.get("quantization_config"):
            cfg["quantization_config"] = top_quant  # V4.1 keeps it at the top level only
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch == "DeepseekV41ForCausalLM" and "num_hidden_layers" not in cfg:
        raise ValueError(f"{name or arch}: a DeepseekV41ForCausalLM config holds its language model in a "
                         "nested 'text_config' object (with num_hidden_layers, hidden_size, ...); none found")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r} (config 'architectures'); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    where = f"{name or arch}"
    name = str(name or cfg.get("_name") or arch)
    # one check each, with the bound that holds
    layers = _int(cfg, "num_hidden_layers", where, minimum=1)
    hidden = _int(cfg, "hidden_size", where, minimum=1)
    heads = _int(cfg, "num_attention_heads", where, minimum=1)
    common: dict[str, Any] = dict(name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                  vocab_size=_int(cfg, "vocab_size", where),
                                  tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                                  weight_bytes=_weight_bytes(cfg), kv_bytes=2,
                                  max_position_embeddings=_int(cfg, "max_position_embeddings", where, 0))

    if arch in _DENSE or arch in _MOE:
        kv = _int(cfg, "num_key_value_heads", where, heads)
        hd = _int(cfg, "head_dim", where, hidden // heads)
        gqa = dict(attention="gqa", num_kv_heads=kv, head_dim=hd)
        if arch in _DENSE:
            return ModelSpec(**common, **gqa, intermediate_size=_int(cfg, "intermediate_size", where))
        if arch == "MixtralForCausalLM":
            width = _int(cfg, "intermediate_size", where)
            return ModelSpec(**common, **gqa, intermediate_size=width, num_routed_experts=_int(cfg, "num_local_experts", where),
                             experts_per_token=_int(cfg, "num_experts_per_tok", where), moe_intermediate_size=width)
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1) or 1) != 1:
            raise UnsupportedArchitectureError(f"{where}: Qwen3-MoE with dense layers (mlp_only_layers / "
                                               "decoder_sparse_step != 1) is not modelled")
        return ModelSpec(**common, **gqa, intermediate_size=_int(cfg, "intermediate_size", where, 0),
                         num_routed_experts=_int(cfg, "num_experts", where),
                         experts_per_token=_int(cfg, "num_experts_per_tok", where),
                         moe_intermediate_size=_int(cfg, "moe_intermediate_size", where))

    moe = dict(num_routed_experts=_int(cfg, "n_routed_experts", where),
               experts_per_token=_int(cfg, "num_experts_per_tok", where),
               num_shared_experts=_int(cfg, "n_shared_experts", where, 0),
               moe_intermediate_size=_int(cfg, "moe_intermediate_size", where))
    if arch in _DEEPSEEK:
        n_group = _int(cfg, "n_group", where, 1)
        return ModelSpec(**common, **moe, intermediate_size=_int(cfg, "intermediate_size", where), attention="mla",
                         num_kv_heads=heads, q_lora_rank=cfg.get("q_lora_rank") or None,
                         kv_lora_rank=_int(cfg, "kv_lora_rank", where), qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where),
                         qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", where), v_head_dim=_int(cfg, "v_head_dim", where),
                         first_k_dense=_int(cfg, "first_k_dense_replace", where, 0),
                         max_routed_nodes=_int(cfg, "topk_group", where, 0) if n_group > 1 else 0)

    if arch == "DeepseekV41ForCausalLM":
        return _deepseek_v41(cfg, common, moe, layers, where)

    # DeepSeek-V4
    ratios = _get(cfg, "compress_ratios", where)
    if not isinstance(ratios, list) or len(ratios) < layers:
        raise ValueError(f"{where}: compress_ratios must list at least num_hidden_layers ({layers}) ratios")
    hd = _int(cfg, "head_dim", where)
    rope = _int(cfg, "qk_rope_head_dim", where)
    nope = hd - rope
    row = nope + 2 * rope + 8 * math.ceil(math.ceil(nope / 64) / 8)  # FP8 NoPE + BF16 RoPE + padded scales
    fp4 = str(cfg.get("expert_dtype", "")).lower() == "fp4"
    return ModelSpec(**{**common, "kv_bytes": 1}, **moe, intermediate_size=_int(cfg, "intermediate_size", where, 0),
                     attention="compressed", num_kv_heads=_int(cfg, "num_key_value_heads", where),
                     head_dim=hd, q_lora_rank=_int(cfg, "q_lora_rank", where), qk_rope_head_dim=rope,
                     o_lora_rank=_int(cfg, "o_lora_rank", where), o_groups=_int(cfg, "o_groups", where),
                     compress_ratios=tuple(int(r) for r in ratios[:layers]),
                     sliding_window=_int(cfg, "sliding_window", where), index_topk=_int(cfg, "index_topk", where),
                     index_n_heads=_int(cfg, "index_n_heads", where), index_head_dim=_int(cfg, "index_head_dim", where),
                     hc_mult=_int(cfg, "hc_mult", where, 0), kv_row_bytes=row,
                     index_row_bytes=_int(cfg, "index_head_dim", where) + 4,
                     first_k_dense=_int(cfg, "first_k_dense_replace", where, 0),
                     expert_weight_bytes_per_param=(0.5 + 1 / 32) if fp4 else None)


def _int_list(cfg: dict[str, Any], key: str, where: str, default: Any = ...) -> list[int]:  # noqa: ANN401
    v = _get(cfg, key, where, default)
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise ValueError(f"{where}: {key} must be a list of integers >= 0, got {v!r}")
    return v


def _deepseek_v41(cfg: dict[str, Any], common: dict[str, Any], moe: dict[str, Any], layers: int, where: str) -> ModelSpec:
    """``DeepseekV41ForCausalLM`` text_config -> CSA2/CED spec (module docstring)."""
    ratios = _int_list(cfg, "compress_ratios", where)
    if len(ratios) < layers:
        raise ValueError(f"{where}: compress_ratios must list at least num_hidden_layers ({layers}) ratios")
    ratios = ratios[:layers]  # the trailing entries are the DSpark layers
    kv_src = _int_list(cfg, "kv_source_layer_ids", where)
    ix_src = _int_list(cfg, "index_source_layer_ids", where)
    engram = _int_list(cfg, "engram_layer_ids", where, [])
    hd = _int(cfg, "head_dim", where, minimum=1)
    idim = _int(cfg, "index_head_dim", where, minimum=1)
    if hd % 32 or idim % 32:
        raise ValueError(f"{where}: head_dim ({hd}) and index_head_dim ({idim}) must be multiples of 32 "
                         "(the FP4/FP8 KV records carry one scale per 16 or 32 lanes)")
    window = _int(cfg, "sliding_window", where, minimum=1)
    boundary = max(kv_src) if kv_src else 0
    ced = (kv_src and ratios[boundary] == 1 and boundary < layers - 1 and all(i < boundary for i in engram))
    cand = cfg.get("candidate_source_layer_id")
    quant = cfg.get("quantization_config") or {}
    fp4 = str(quant.get("expert_dtype", "fp4") if isinstance(quant, dict) else "fp4").lower() == "fp4"
    tables = _int_list(cfg, "engram_num_embeddings", where, [])
    if len(tables) != len(engram):
        raise ValueError(f"{where}: engram_num_embeddings ({len(tables)} entries) must match engram_layer_ids ({len(engram)})")
    try:
        return ModelSpec(**{**common, "kv_bytes": 1}, **moe, intermediate_size=0, attention="csa2",
                         num_kv_heads=_int(cfg, "num_key_value_heads", where, 1), head_dim=hd,
                         q_lora_rank=_int(cfg, "q_lora_rank", where), qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where),
                         o_lora_rank=_int(cfg, "o_lora_rank", where), o_groups=_int(cfg, "o_groups", where),
                         compress_ratios=tuple(ratios), kv_source_layers=tuple(kv_src), index_source_layers=tuple(ix_src),
                         candidate_source_layer=-1 if cand is None else _int(cfg, "candidate_source_layer_id", where),
                         candidate_tokens=(_int(cfg, "candidate_topk_blocks", where, 0) * _int(cfg, "candidate_block_size", where, 0)
                                           if cand is not None else 0),
                         sliding_window=window, index_topk=_int(cfg, "index_topk", where),
                         index_n_heads=_int(cfg, "index_n_heads", where), index_head_dim=idim,
                         hc_mult=_int(cfg, "hc_mult", where, 0),
                         kv_row_bytes=hd // 2 + hd // 16, index_row_bytes=idim // 2 + idim // 32,
                         swa_row_bytes=hd + hd // 32,
                         ced_encoder_layers=boundary if ced else 0, ced_replay_tokens=window if ced else 0,
                         engram_layers=tuple(engram), engram_table_rows=sum(tables),
                         engram_lookups_per_token=((_int(cfg, "engram_max_ngram_size", where, 1, minimum=1) - 1)
                                                   * _int(cfg, "engram_n_heads", where, 0)) if engram else 0,
                         engram_head_dim=_int(cfg, "engram_head_dim", where, 0) if engram else 0,
                         first_k_dense=0, expert_weight_bytes_per_param=(0.5 + 1 / 32) if fp4 else None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
