"""Model presets and lookup: :data:`MODELS` (hand-written presets and the shipped Hugging Face
configs in ``sim/data/models/``) and :func:`get_model`, which also loads any ``config.json``.

The architecture dataclass :class:`~sim.models.spec.ModelSpec` (its conventions: parameter counts,
FLOPs, KV bytes) is in :mod:`sim.models.spec`; config.json mapping in :mod:`sim.models.hf`.
"""

from __future__ import annotations

import os
from pathlib import Path

from sim.models.hf import model_from_hf_config
from sim.models.spec import AttentionKind, ModelSpec

__all__ = ["MODELS", "AttentionKind", "ModelSpec", "get_model"]


# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; paper arXiv 2412.19437): 61 layers, hidden 7168,
# 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
# v_head_dim 128, vocab 129280, dense intermediate 18432, moe_intermediate_size 2048,
# n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, first_k_dense_replace 3,
# untied embeddings; FP8 weights (config quantization_config fp8). Node-limited routing: each token
# is sent to at most M = 4 nodes (paper sec. 2.1.2; config n_group 8 / topk_group 4). Derived counts: 671.0B total,
# 37.5B activated (paper: "671B total parameters with 37B activated"; the 14B MTP module is excluded).
# KV cache in BF16 (SGLang/FlashMLA default when the published numbers were taken).
DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3",
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    vocab_size=129280,
    intermediate_size=18432,
    attention="mla",
    num_kv_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_routed_experts=256,
    experts_per_token=8,
    num_shared_experts=1,
    moe_intermediate_size=2048,
    first_k_dense=3,
    max_routed_nodes=4,
    weight_bytes=1,
    kv_bytes=2,
)

# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): 32 layers, hidden 4096, 32 heads, 8 KV heads,
# head_dim 128, intermediate 14336, vocab 128256, untied; BF16. Derived 8.03B params (published 8B).
LLAMA_3_1_8B = ModelSpec(
    name="llama-3.1-8b",
    max_position_embeddings=131072,  # Llama 3.1 config.json
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    vocab_size=128256,
    intermediate_size=14336,
    attention="gqa",
    num_kv_heads=8,
    head_dim=128,
    weight_bytes=2,
    kv_bytes=2,
)

# Llama-3.1-70B (meta-llama/Llama-3.1-70B config.json): 80 layers, hidden 8192, 64 heads, 8 KV heads,
# head_dim 128, intermediate 28672, vocab 128256, untied; BF16. Derived 70.55B params (published 70B).
LLAMA_3_1_70B = ModelSpec(
    name="llama-3.1-70b",
    max_position_embeddings=131072,  # Llama 3.1 config.json
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    vocab_size=128256,
    intermediate_size=28672,
    attention="gqa",
    num_kv_heads=8,
    head_dim=128,
    weight_bytes=2,
    kv_bytes=2,
)

# DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash on Hugging Face, released 2026-04; MIT). Every
# value is the checkpoint's config.json (fetched verbatim in the mistral.rs DeepSeek-V4 audit notes;
# NVIDIA NeMo AutoModel's DeepseekV4Config defaults agree: hidden 4096, 43 layers, 64 heads,
# 1 KV head, head_dim 512, qk_rope 64, q_lora 1024, o_lora 1024, o_groups 8, 256 routed + 1
# shared experts, top-6, moe_intermediate 2048, sliding_window 128, index_topk 512, index 64 heads
# x 128, hc_mult 4, one MTP layer, vocab 129,280, max_position_embeddings 1,048,576):
#   compress_ratios = [0, 0, 4, 128, 4, 128, ..., 4, 128, 4] for the 43 main layers (+ 0 for the
#   MTP block): 2 sliding-window-only layers, 21 CSA layers (ratio 4, with a lightning indexer;
#   the safetensors index has indexer tensors on exactly layers 2, 4, ..., 42) and 20 HCA layers
#   (ratio 128). No dense FFN layer (all 43 are MoE; 3 hash-routed layers, same weights).
#   Weights: FP8 e4m3 with 128x128 block scales (quantization_config) except the routed experts,
#   "expert_dtype": "fp4": packed FP4 (I8 [2048, 2048] for a logical [2048, 4096]) with one E8M0
#   scale per 32 weights -> 0.5 + 1/32 bytes per expert parameter.
#   KV rows: 584 B per row (448 FP8 NoPE + 64 BF16 RoPE + 8 B of UE8M0 scales; SGLang
#   DeepSeekV4SingleKVPool asserts bytes_per_token == 448 + 64 * 2 + 8); indexer keys 132 B
#   (128 FP8 + 4 B scale; SGLang DeepSeekV4IndexerPool, non-FP4 branch).
# Derived here: 284.5B total, 13.2B activated (model card: 284B total, 13B activated; the 6.6B MTP
# block excluded as for V3); KV 3,851 B per token + 3.21 MB of window rows per sequence.
# MTP (num_nextn_predict_layers = 1) is modelled by the speculative-decoding settings of a scenario.
DEEPSEEK_V4_FLASH = ModelSpec(
    name="deepseek-v4-flash",
    max_position_embeddings=1048576,  # config.json, above
    num_layers=43,
    hidden_size=4096,
    num_attention_heads=64,
    vocab_size=129280,
    intermediate_size=0,
    attention="compressed",
    num_kv_heads=1,
    head_dim=512,
    q_lora_rank=1024,
    qk_rope_head_dim=64,
    o_lora_rank=1024,
    o_groups=8,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4,),
    sliding_window=128,
    index_topk=512,
    index_n_heads=64,
    index_head_dim=128,
    hc_mult=4,
    kv_row_bytes=584,
    index_row_bytes=132,
    num_routed_experts=256,
    experts_per_token=6,
    num_shared_experts=1,
    moe_intermediate_size=2048,
    first_k_dense=0,
    weight_bytes=1,
    kv_bytes=1,
    expert_weight_bytes_per_param=0.5 + 1 / 32,
)

# DeepSeek-V4-Pro (deepseek-ai/DeepSeek-V4-Pro on Hugging Face, released 2026-04 with V4-Flash; MIT;
# the model of AgentX point 440246, sim/data/agentx_440246.json). Same architecture as V4-Flash
# (DeepseekV4ForCausalLM); the config.json values are MindSpore MindFormers' DeepseekV4Config
# defaults ("similar configuration to that of the DeepSeek-V4"), which are the Pro checkpoint's:
# hidden 7168, 61 layers, 128 heads, 1 KV head, head_dim 512, qk_rope 64, q_lora 1536, o_lora 1024,
# o_groups 16, 384 routed + 1 shared experts, top-6, moe_intermediate 3072, index 64 heads x 128,
# index_topk 1024, sliding_window 128, hc_mult 4, 3 hash layers, one MTP layer, vocab 129,280,
# expert_dtype fp4. Assumed (not in the defaults, which leave compress_ratios None): V4-Flash's layer
# pattern extended to 61 layers, 2 sliding-window-only layers then CSA (4) / HCA (128) alternating,
# ending on CSA: 30 CSA + 29 HCA. KV rows as V4-Flash (584 B per row, indexer keys 132 B; the
# 440246 launcher's FP4 indexer cache would make them smaller; the difference is < 1% of a step).
# Derived here (tests/test_models_v4_pro.py): 1.573T total, 49.8B activated (model card: "1.6T
# parameters (49B activated)"; the MTP block, ~1/61 of the layers = 26B, is excluded as for V3 and
# V4-Flash and brings the count to 1.599T); FP4 experts + FP8 dense
# weights 0.85 TB, i.e. 106 GB per GPU on 8 GPUs (the 440246 launcher: "model weights need
# ~137 GiB/GPU", which includes the MTP block, embeddings in BF16 and runtime buffers).
DEEPSEEK_V4_PRO = ModelSpec(
    name="deepseek-v4-pro",
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    vocab_size=129280,
    intermediate_size=0,
    attention="compressed",
    num_kv_heads=1,
    head_dim=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    o_lora_rank=1024,
    o_groups=16,
    compress_ratios=(0, 0) + (4, 128) * 29 + (4,),
    sliding_window=128,
    index_topk=1024,
    index_n_heads=64,
    index_head_dim=128,
    hc_mult=4,
    kv_row_bytes=584,
    index_row_bytes=132,
    num_routed_experts=384,
    experts_per_token=6,
    num_shared_experts=1,
    moe_intermediate_size=3072,
    first_k_dense=0,
    weight_bytes=1,
    kv_bytes=1,
    expert_weight_bytes_per_param=0.5 + 1 / 32,
)

# DeepSeek-V4.1-Flash (deepseek-ai/DeepSeek-V4.1-Flash on Hugging Face, released 2026-10; MIT;
# DeepseekV41ForCausalLM, model_type deepseek_v41, language model in a nested text_config). Sources:
#   [trt-cfg]  NVIDIA/TensorRT-LLM tensorrt_llm/_torch/configs/deepseek_v41.py, DeepseekV41TextConfig
#              ("Every default here is the released DeepSeek-V4.1-Flash value"): hidden 5120, 40 layers,
#              64 heads x head_dim 512, 1 KV head, qk_rope 64, q_lora 1280, o_lora 1024, o_groups 8,
#              vocab 129,280, 384 routed + 1 shared experts, top-6, moe_intermediate 2304, no dense
#              layer, no hash routing, no node-limited routing ("noaux_tc degrades to plain top-k"),
#              sliding_window 128, index 32 heads x 128, index_topk 512, candidate source layer 20 with
#              2048 blocks x 8 tokens, hc_mult 4, Engram (8 heads x 256, max n-gram 4), DSpark 3 stages;
#              routed experts OCP MXFP4 (e2m1, two per byte, one e8m0 scale per 32), dense FP8 e4m3
#              32x32 blocks; kv_bytes_per_token docstring: "three ratio-2 source layers (2, 8, 14)
#              emitting every other position, plus the one ratio-1 source layer (20)".
#   [cfg]      the released text_config values as quoted in public test fixtures (vllm-ascend /
#              TensorRT-LLM tests, found by find_string): compress_ratios [0, 0] + [2] * 18 + [1] * 20
#              (+ [0] * 3 for the DSpark layers), kv_source_layer_ids [2, 8, 14, 20],
#              index_source_layer_ids [2, 8, 14, 20, 24, 28, 32, 36], engram_layer_ids [1, 14],
#              engram_num_embeddings [384,006,168, 384,016,682], num_nextn_predict_layers 3.
#   [trt-csa2] TensorRT-LLM _torch/attention/backends/sparse/csa2/README.md: per global position a
#              288-byte main record (NVFP4 e2m1 + e4m3 scale per 16 channels: 512 * (0.5 + 1/16)) and
#              a 68-byte index record (MXFP4: 128 * (0.5 + 1/32)); "The published layout uses 890
#              global bytes per original token, excluding SWA"; "SWA uses 528-byte E4M3/power-of-two
#              rows"; CED: "Replay is enabled by default and retains one SWA window: 128 rows at layer
#              20", "The CED prepass applies the boundary layer's collapse, normalization and
#              GLOBAL/index projections to the complete encoder states before narrowing decoder
#              queries", "Earlier chunks publish complete Encoder GLOBAL/index KV without Decoder
#              queries".
#   [card]     model card as quoted by providers (docs.oxen.ai "DeepSeek V4.1 Flash", docs.thehive.ai):
#              552B backbone, Causal Encoder-Decoder, "activates 8B parameters while reading input and
#              16B while generating output", "compresses the KV cache to roughly a quarter of V4
#              Flash's footprint", 1M context.
# Layers 0..19 are the causal encoder (every prompt token), 20..39 the decoder (decode tokens, and
# the prompt's last 128 rows); layer 20's GLOBAL projection runs for every prompt token.
# (vLLM's V4.1 model state replays from layer 21, i.e. runs all of layer 20 on every prompt token:
# one layer, ~5% of a prompt token's FLOPs; the TensorRT-LLM split is used here.)
# Derived here (tests/sim/models/test_models_v41.py): 551.8B total (card: 552B; Engram tables, 196.6B, and the
# vision tower and DSpark layers excluded), 16.1B linear parameters per decode token (card 16B) and
# 7.9B per prompt token (card 8B), both excluding the input embedding; KV 890 B per token (3 x 356 /
# 2 + 356) + 2.70 MB of window rows per sequence (40 x 128 x 528). Against V4-Flash's 3,851 B the
# persistent KV is 0.23x ("roughly a quarter"; the 1/8 quoted in pdlb's issue 15 was not found).
# Engram: tables held in pinned host memory (TensorRT-LLM DeepseekV41Engram: "table shards stay in
# pinned CPU memory") and looked up asynchronously before layer 0 (hashes depend on token ids only);
# 2 layers x 24 rows x 264 B = 12.7 KB per token (colibri docs/deepseek-v41.md: "~13 KB of engram per
# token"): 4.6 MB for a 360-token decode step and 208 MB for a 16k-token prefill step, < 1% of either
# step at 50 GB/s host bandwidth and overlapped, so not in the step time; their 157M-parameter key/value
# projections are in the encoder's dense FLOPs. Not modelled: the DSpark drafter (the scenario's
# speculative settings), the vision tower. A prefix hit re-runs the hit's last 128 tokens through the
# encoder (SWA bounded replay: ModelSpec.rebuild_rows) and the decoder replays the prompt's last 128.
DEEPSEEK_V41_FLASH = ModelSpec(
    name="deepseek-v4.1-flash",
    num_layers=40,  # trt-cfg
    hidden_size=5120,  # trt-cfg
    num_attention_heads=64,  # trt-cfg
    vocab_size=129280,  # trt-cfg
    intermediate_size=0,  # trt-cfg: no dense FFN layer
    attention="csa2",
    num_kv_heads=1,  # trt-cfg
    head_dim=512,  # trt-cfg
    q_lora_rank=1280,  # trt-cfg
    qk_rope_head_dim=64,  # trt-cfg
    o_lora_rank=1024,  # trt-cfg
    o_groups=8,  # trt-cfg
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,  # cfg (the 3 trailing DSpark entries dropped)
    kv_source_layers=(2, 8, 14, 20),  # cfg
    index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),  # cfg
    candidate_source_layer=20,  # trt-cfg
    candidate_tokens=2048 * 8,  # trt-cfg: candidate_topk_blocks x candidate_block_size
    sliding_window=128,  # trt-cfg
    index_topk=512,  # trt-cfg
    index_n_heads=32,  # trt-cfg
    index_head_dim=128,  # trt-cfg
    hc_mult=4,  # trt-cfg
    kv_row_bytes=288,  # trt-csa2: main record
    index_row_bytes=68,  # trt-csa2: index record
    swa_row_bytes=528,  # trt-csa2
    ced_encoder_layers=20,  # trt-csa2: decoder replay starts at layer 20
    ced_replay_tokens=128,  # trt-csa2: one SWA window (not enlarged for DSpark capture: unpublished)
    engram_layers=(1, 14),  # cfg
    engram_table_rows=384006168 + 384016682,  # cfg
    engram_lookups_per_token=(4 - 1) * 8,  # trt-cfg: (max_ngram_size - 1) x n_heads
    engram_head_dim=256,  # trt-cfg
    num_routed_experts=384,  # trt-cfg
    experts_per_token=6,  # trt-cfg
    num_shared_experts=1,  # trt-cfg
    moe_intermediate_size=2304,  # trt-cfg
    first_k_dense=0,  # trt-cfg
    weight_bytes=1,  # trt-cfg: dense FP8 e4m3
    kv_bytes=1,
    expert_weight_bytes_per_param=0.5 + 1 / 32,  # trt-cfg: MXFP4 experts
)

MODELS: dict[str, ModelSpec] = {m.name: m for m in (DEEPSEEK_V3, DEEPSEEK_V4_FLASH, DEEPSEEK_V4_PRO, DEEPSEEK_V41_FLASH, LLAMA_3_1_8B,
                                                    LLAMA_3_1_70B)}

#: shipped Hugging Face configs (``sim/data/models/*.json``; each names its source repository)
HF_PRESET_DIR = Path(__file__).parent.parent / "data" / "models"


def _load_hf_presets() -> None:
    for path in sorted(HF_PRESET_DIR.glob("*.json")):
        spec = model_from_hf_config(path)
        MODELS.setdefault(spec.name, spec)


_load_hf_presets()


def get_model(name: str | ModelSpec) -> ModelSpec:
    """The preset called ``name`` (case-insensitive), or the model of a Hugging Face config: a
    ``.json`` file or a folder holding ``config.json`` (:func:`sim.models.hf.model_from_hf_config`).
    A ``ModelSpec`` is returned as is.

    Raises:
        ValueError: not a preset and not a config path; an unsupported architecture or a malformed
            config (:class:`sim.models.hf.UnsupportedArchitectureError` is a ValueError).
        FileNotFoundError: a ``.json`` path that does not exist.
    """
    if isinstance(name, ModelSpec):
        return name
    for key, spec in MODELS.items():
        if key.lower() == str(name).strip().lower():
            return spec
    text = str(name).strip()
    if text.endswith(".json") or os.path.isdir(text):
        try:
            return model_from_hf_config(text)
        except ValueError as e:  # name the file: a scenario's model = "..." may point anywhere
            if text in str(e):
                raise
            raise type(e)(f"{text}: {e}") from e
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))} "
                     "(or a Hugging Face config.json path)")
