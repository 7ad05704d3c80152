"""Model architecture specs: what a roofline step-latency model needs to know about an LLM.

Parameter counts are derived from the architecture dimensions (the HF ``config.json`` values)
unless given explicitly; the presets' derived counts match the published totals (checked in
``tests/test_perf.py``).

Conventions (all per *token* unless noted):

* ``linear_flops_per_token = 2 * (activated_params - input embedding params)``: one multiply-add per
  weight the token touches. The input embedding is a table lookup (no FLOPs, only one row read) so
  it is excluded; the LM head is a real matmul and is included. Norms/biases/routers are counted as
  parameters (they are tiny). Attention score/value FLOPs are *not* in it: they scale with the
  number of (query, key) pairs and are given by ``attn_flops_per_pair``.
* Weights are split into the *expert* part (routed experts of MoE layers, sharded over the EP group)
  and the *dense* part (everything else: embeddings, attention, dense FFN layers, shared experts,
  routers, LM head), which every DP-attention rank holds in full.
* All weights are counted at ``weight_bytes`` (DeepSeek-V3 ships FP8 linear weights; its BF16
  embeddings/norms are ~2% of the dense part and are ignored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["mha", "gqa", "mla"]


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, dense or MoE, with GQA/MHA or MLA attention."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    #: FFN width of dense layers (all layers of a dense model, the first ``first_k_dense`` of an MoE)
    intermediate_size: int
    #: "mha"/"gqa" (standard K/V heads) or "mla" (DeepSeek multi-head latent attention)
    attention: AttentionKind = "gqa"
    #: K/V heads (GQA); for MLA the number of heads is ``num_attention_heads``
    num_kv_heads: int = 0
    #: per-head dim of Q/K/V (GQA)
    head_dim: int = 0
    # --- MLA dims (DeepSeek-V3 config.json) ---
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # --- MoE ---
    num_routed_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    #: the first ``first_k_dense`` layers use a dense FFN, the rest are MoE (MoE models only)
    first_k_dense: int = 0
    #: node-limited routing: a token's experts span at most this many EP nodes (0 = no limit)
    max_routed_nodes: int = 0
    tie_word_embeddings: bool = False
    #: bytes per weight element (1 = FP8, 2 = BF16)
    weight_bytes: int = 2
    #: bytes per KV-cache element
    kv_bytes: int = 2
    #: total parameters; derived from the dims when None
    total_params: int | None = None
    #: parameters a token passes through (incl. embeddings); derived when None
    activated_params: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "gqa", "mla"):
            raise ValueError(f"{self.name}: attention must be 'mha', 'gqa' or 'mla', not {self.attention!r}")
        if self.attention == "mla":
            if min(self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim) <= 0:
                raise ValueError(f"{self.name}: MLA needs kv_lora_rank, qk_rope/nope_head_dim, v_head_dim")
        else:
            if self.num_kv_heads <= 0 or self.head_dim <= 0:
                raise ValueError(f"{self.name}: GQA/MHA needs num_kv_heads and head_dim")
            if self.num_attention_heads % self.num_kv_heads:
                raise ValueError(f"{self.name}: num_attention_heads must be a multiple of num_kv_heads")
        if self.num_routed_experts:
            if not (0 < self.experts_per_token <= self.num_routed_experts) or self.moe_intermediate_size <= 0:
                raise ValueError(f"{self.name}: MoE needs 0 < experts_per_token <= num_routed_experts "
                                 "and moe_intermediate_size > 0")
            if not 0 <= self.first_k_dense <= self.num_layers:
                raise ValueError(f"{self.name}: first_k_dense out of range")
        if self.total_params is None:
            object.__setattr__(self, "total_params", self._count_total())
        if self.activated_params is None:
            object.__setattr__(self, "activated_params", self._count_activated())

    # ------------------------------------------------------------------ structure
    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.is_moe else 0

    @property
    def num_dense_ffn_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    # ------------------------------------------------------------------ parameter counts
    @property
    def embedding_params(self) -> int:
        """Input embedding table (lookup only: no FLOPs, not streamed each step)."""
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def attention_params_per_layer(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk  # q_a, norm, q_b
            else:
                q = h * n * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # + kv_a norm
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            o = n * self.v_head_dim * h
            return q + kv_a + kv_b + o
        hd = self.head_dim
        return h * n * hd + 2 * h * self.num_kv_heads * hd + n * hd * h  # q, k, v, o (no biases)

    @property
    def params_per_expert(self) -> int:
        """One SwiGLU expert: gate, up (hidden x moe_inter) and down (moe_inter x hidden)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of all MoE layers (the part EP shards)."""
        return self.num_moe_layers * self.num_routed_experts * self.params_per_expert

    @property
    def activated_routed_params(self) -> int:
        """Routed-expert parameters one token passes through."""
        return self.num_moe_layers * self.experts_per_token * self.params_per_expert

    @property
    def dense_params(self) -> int:
        """Everything but routed experts: replicated on every DP-attention rank."""
        return int(self.total_params) - self.routed_expert_params

    def _layer_common(self) -> int:
        return self.attention_params_per_layer + 2 * self.hidden_size  # + input/post-attn norms

    def _dense_ffn(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def _moe_non_routed(self) -> int:
        # shared experts + router weight and its bias (DeepSeek-V3 e_score_correction_bias)
        gate = self.num_routed_experts * self.hidden_size + self.num_routed_experts
        return self.num_shared_experts * self.params_per_expert + gate

    def _count_total(self) -> int:
        per_layer = self.num_layers * self._layer_common()
        ffn = self.num_dense_ffn_layers * self._dense_ffn()
        moe = self.num_moe_layers * (self._moe_non_routed() + self.num_routed_experts * self.params_per_expert)
        return self.embedding_params + self.lm_head_params + self.hidden_size + per_layer + ffn + moe

    def _count_activated(self) -> int:
        return self._count_total() - self.routed_expert_params + self.activated_routed_params

    # ------------------------------------------------------------------ FLOPs
    @property
    def linear_flops_per_token(self) -> float:
        """2 * (activated params - input embedding): weight matmuls incl. LM head, per token."""
        return 2.0 * (int(self.activated_params) - self.embedding_params)

    @property
    def expert_flops_per_token(self) -> float:
        """Routed-expert share of ``linear_flops_per_token`` (what EP spreads over the group)."""
        return 2.0 * self.activated_routed_params

    @property
    def dense_flops_per_token(self) -> float:
        """Non-expert share of ``linear_flops_per_token`` (attention projections, dense FFN,
        shared experts, router, LM head): done by the rank that owns the token."""
        return self.linear_flops_per_token - self.expert_flops_per_token

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair over all layers, in the decode formulation.

        GQA/MHA: per head, ``q.k`` is ``head_dim`` multiply-adds and ``p * v`` another
        ``head_dim``: ``4 * layers * heads * head_dim`` (GQA shares K/V, not FLOPs).

        MLA, weight-absorbed (FlashMLA decode): W_UK is folded into the query and W_UV into the
        output, so each head attends in the latent space. The score is
        ``q_latent . c_kv + q_rope . k_rope`` = ``kv_lora_rank + qk_rope_head_dim`` multiply-adds,
        the output ``p * c_kv`` = ``kv_lora_rank``:
        ``layers * heads * 2 * ((kv_lora_rank + qk_rope_head_dim) + kv_lora_rank)``
        (DeepSeek-V3: 61 * 128 * 2 * (576 + 512) = 16.99 MFLOP per pair). The absorbing
        projections cost ``2 * kv_b_proj params`` per token, which ``linear_flops_per_token``
        already counts.
        """
        if self.is_mla:
            return float(self.num_layers * self.num_attention_heads * 2
                         * ((self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank))
        return float(4 * self.num_layers * self.num_attention_heads * self.head_dim)

    @property
    def prefill_attn_flops_per_pair(self) -> float:
        """FLOPs per (query, key) pair in the prefill formulation.

        Same as ``attn_flops_per_pair`` for GQA/MHA. For MLA, prefill kernels (FA3 in SGLang/vLLM,
        DeepSeek's MHA-mode prefill) do *not* absorb: K/V are expanded from the latent and attention
        runs as ordinary MHA with ``qk_nope + qk_rope`` dims for the score and ``v_head_dim`` for the
        output: ``layers * heads * 2 * ((qk_nope + qk_rope) + v_head_dim)`` (DeepSeek-V3:
        61 * 128 * 2 * (192 + 128) = 5.00 MFLOP, 3.4x less than absorbed). The per-token K/V
        up-projection is in ``linear_flops_per_token``; re-expanding a *cached* prefix
        (2 * kv_b params per cached token, ~3% of a new token) is ignored.
        """
        if self.is_mla:
            return float(self.num_layers * self.num_attention_heads * 2
                         * ((self.qk_nope_head_dim + self.qk_rope_head_dim) + self.v_head_dim))
        return self.attn_flops_per_pair

    # ------------------------------------------------------------------ bytes
    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token over all layers.

        GQA: ``2 (K and V) * layers * kv_heads * head_dim * kv_bytes``.
        MLA: only the compressed latent and the shared RoPE key are cached:
        ``layers * (kv_lora_rank + qk_rope_head_dim) * kv_bytes``.
        """
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes

    @property
    def weight_bytes_total(self) -> float:
        return float(self.total_params) * self.weight_bytes

    @property
    def dense_weight_bytes(self) -> float:
        """Resident bytes of the non-expert part (incl. embedding table)."""
        return float(self.dense_params) * self.weight_bytes

    @property
    def dense_weight_read_bytes(self) -> float:
        """Non-expert bytes streamed from HBM once per step (the embedding table is not streamed)."""
        return float(self.dense_params - self.embedding_params) * self.weight_bytes

    @property
    def expert_weight_bytes(self) -> float:
        """Resident bytes of all routed experts."""
        return float(self.routed_expert_params) * self.weight_bytes


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

# PLACEHOLDER for DeepSeek V4.1 Flash (the model behind the DeepInfer figures). Its architecture is
# not published in the material pdlb cites, so this is DeepSeek-V3 with ONE change, chosen to fit
# the published deployment: 64 routed experts instead of 256 (everything else, incl. MLA, top-8
# routing, 61 layers, hidden 7168, FP8 weights, is V3's). Why 64: the published prefill units are
# EP2-8 on SM100 (B200-class, 180 GB): at EP2 a GPU holds the 17.1 GB dense part + half the experts;
# 256 experts (654 GB) or 128 (327 GB) do not fit in 0.9 * 180 GB at EP2, 64 (163.5 GB -> 81.8 GB
# per GPU) does. Derived: 180.7B total, 37.5B activated (same per-token cost as V3). Treat every
# result on this model as an assumption-laden estimate.
DEEPSEEK_V4_1_FLASH = dataclasses.replace(DEEPSEEK_V3, name="deepseek-v4.1-flash", num_routed_experts=64,
                                          total_params=None, activated_params=None)

MODELS: dict[str, ModelSpec] = {m.name: m for m in (DEEPSEEK_V3, DEEPSEEK_V4_1_FLASH, LLAMA_3_1_8B, LLAMA_3_1_70B)}


def get_model(name: str | ModelSpec) -> ModelSpec:
    """The preset called ``name`` (case-insensitive); a ``ModelSpec`` is returned as is."""
    if isinstance(name, ModelSpec):
        return name
    for key, spec in MODELS.items():
        if key.lower() == str(name).strip().lower():
            return spec
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
