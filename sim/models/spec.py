"""The :class:`ModelSpec` dataclass: what a roofline step-latency model needs to know about an LLM
(the presets live in :mod:`sim.models.presets`, config.json loading in :mod:`sim.models.hf`).

Parameter counts are derived from the architecture dimensions (the HF ``config.json`` values)
unless given explicitly; the presets' derived counts match the published totals (checked in
``tests/sim/perf/test_perf.py``).

Conventions (all per *token* unless noted):

* ``linear_flops_per_token = 2 * (activated_params - input embedding params)``: one multiply-add per
  weight the token touches. The input embedding is a table lookup (no FLOPs, only one row read) so
  it is excluded; the LM head is a real matmul and is included. Norms/biases/routers are counted as
  parameters (they are tiny). Attention score/value FLOPs are *not* in it: they scale with the
  number of (query, key) pairs and are given by ``attn_flops_per_pair``. These are a *decode*
  token's; under a causal encoder-decoder (DeepSeek-V4.1, ``ced_encoder_layers``) a prompt token
  costs ``prefill_dense_flops_per_token + prefill_expert_flops_per_token`` and each replayed
  decoder row the rest (``replay_*``).
* Weights are split into the *expert* part (routed experts of MoE layers, sharded over the EP group)
  and the *dense* part (everything else: embeddings, attention, dense FFN layers, shared experts,
  routers, LM head), which every DP-attention rank holds in full.
* All weights are counted at ``weight_bytes`` (DeepSeek-V3 ships FP8 linear weights; its BF16
  embeddings/norms are ~2% of the dense part and are ignored).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from sim.models import csa2

AttentionKind = Literal["mha", "gqa", "mla", "compressed", "csa2"]

#: Tokens per KV block of DeepSeek-V4's full-attention (compressed MLA) KV cache groups in vLLM 0.33.
V4_KV_BLOCK_TOKENS = 256
#: Tokens per block of DeepSeek-V4's sliding-window KV cache groups in vLLM 0.28-0.33
#: (``DeepseekV4SWACache.block_size = 64``: the page is shared with the CSA group's 256 // 4 rows).
V4_SWA_BLOCK_TOKENS = 64


def _causal_pairs(new_tokens, cached_tokens):  # noqa: ANN001, ANN202
    """``c * p + c * (c + 1) / 2`` (same as :func:`sim.perf.base.causal_attn_pairs`)."""
    c = np.asarray(new_tokens, dtype=np.float64)
    p = np.asarray(cached_tokens, dtype=np.float64)
    return c * p + c * (c + 1.0) / 2.0


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, dense or MoE, with GQA/MHA, MLA, DeepSeek-V4
    hybrid compressed attention (``attention="compressed"``, see :meth:`decode_attended_keys`) or
    DeepSeek-V4.1 CSA2 with its causal encoder-decoder split (``attention="csa2"``, see
    :attr:`ced_encoder_layers` and :mod:`sim.models.csa2`)."""

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
    # --- DeepSeek-V4 hybrid compressed attention (attention="compressed"; HF config.json names) ---
    #: per main layer: 0 = sliding window only, 4 = CSA (4x compressed KV + lightning indexer
    #: selecting ``index_topk`` rows), 128 = HCA (128x compressed KV, all rows attended)
    compress_ratios: tuple[int, ...] = ()
    #: raw (uncompressed) KV rows every layer keeps and attends: the latest ``sliding_window`` tokens
    sliding_window: int = 0
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    #: grouped low-rank output projection (``wo_a``: heads*head_dim/o_groups -> o_lora_rank per group)
    o_lora_rank: int = 0
    o_groups: int = 0
    #: manifold-constrained hyper-connection streams (mHC; 0 = plain residual)
    hc_mult: int = 0
    #: bytes of one cached KV row of one layer (compressed or window row); 0 = derived for GQA/MLA
    kv_row_bytes: int = 0
    #: bytes of one lightning-indexer key row (CSA layers)
    index_row_bytes: int = 0
    #: bytes per routed-expert weight (FP4 experts: 0.5 + scales); None = ``weight_bytes``
    expert_weight_bytes_per_param: float | None = None
    # --- DeepSeek-V4.1 CSA2 + causal encoder-decoder (attention="csa2"; HF text_config names) ---
    # compress_ratios: per layer 0 (window only), 1 (unpooled global rows) or r >= 2 (pooled r:1);
    # kv_row_bytes: one global main record; index_row_bytes: one global index record
    #: layers that own a global KV cache (the layers after one read it)
    kv_source_layers: tuple[int, ...] = ()
    #: layers that score index keys and select the top-k (the layers after one reuse it)
    index_source_layers: tuple[int, ...] = ()
    #: index sources after this layer score only its candidate pool (-1 = none)
    candidate_source_layer: int = -1
    #: candidate pool size in tokens (candidate_topk_blocks * candidate_block_size)
    candidate_tokens: int = 0
    #: bytes of one sliding-window row of one layer (CSA2 keeps them apart from the global rows)
    swa_row_bytes: int = 0
    #: CED: layers ``[0, ced_encoder_layers)`` run on every prompt token, the rest (the decoder) only
    #: on the prompt's last ``ced_replay_tokens`` ("SWA bounded replay"); 0 = no split
    ced_encoder_layers: int = 0
    ced_replay_tokens: int = 0
    # --- Engram n-gram memory (DeepSeek-V4.1) ---
    engram_layers: tuple[int, ...] = ()
    #: table rows of all Engram layers together (the tables are not in ``total_params``)
    engram_table_rows: int = 0
    #: rows one token looks up per Engram layer ((max_ngram_size - 1) * n_heads)
    engram_lookups_per_token: int = 0
    engram_head_dim: int = 0
    #: the context the model was trained for (HF ``max_position_embeddings``), tokens; 0 = unknown
    max_position_embeddings: int = 0
    #: total parameters; derived from the dims when None
    total_params: int | None = None
    #: parameters a token passes through (incl. embeddings); derived when None
    activated_params: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "gqa", "mla", "compressed", "csa2"):
            raise ValueError(f"{self.name}: attention must be 'mha', 'gqa', 'mla', 'compressed' or 'csa2', "
                             f"not {self.attention!r}")
        if self.attention == "csa2":
            self._check_csa2()
        elif self.attention == "compressed":
            if len(self.compress_ratios) != self.num_layers:
                raise ValueError(f"{self.name}: compressed attention needs one compress ratio per layer "
                                 f"({len(self.compress_ratios)} given for {self.num_layers} layers)")
            if any(r not in (0, 4, 128) for r in self.compress_ratios):
                raise ValueError(f"{self.name}: compress ratios must be 0, 4 or 128 (got {sorted(set(self.compress_ratios))})")
            if min(self.head_dim, self.sliding_window, self.kv_row_bytes, self.qk_rope_head_dim) <= 0:
                raise ValueError(f"{self.name}: compressed attention needs head_dim, qk_rope_head_dim, "
                                 "sliding_window and kv_row_bytes > 0")
            if 4 in self.compress_ratios and min(self.index_topk, self.index_n_heads, self.index_head_dim,
                                                 self.index_row_bytes) <= 0:
                raise ValueError(f"{self.name}: CSA layers need index_topk, index_n_heads, index_head_dim "
                                 "and index_row_bytes > 0")
            if self.num_kv_heads != 1:
                raise ValueError(f"{self.name}: compressed attention has one shared KV head (num_kv_heads=1)")
        elif self.attention == "mla":
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

    def _check_csa2(self) -> None:
        """Consistency of a CSA2/CED spec (the invariants TensorRT-LLM's ``build_layer_descriptors``
        and vLLM's decoder-replay checks assert for V4.1; see the preset's comment)."""
        n, r = self.num_layers, self.compress_ratios
        if len(r) != n:
            raise ValueError(f"{self.name}: csa2 attention needs one compress ratio per layer "
                             f"({len(r)} given for {n} layers)")
        if any(x < 0 for x in r):
            raise ValueError(f"{self.name}: compress ratios must be >= 0")
        for what, layers in (("kv_source_layers", self.kv_source_layers), ("index_source_layers", self.index_source_layers),
                             ("engram_layers", self.engram_layers)):
            if any(not 0 <= i < n for i in layers):
                raise ValueError(f"{self.name}: {what} {list(layers)} outside layers 0..{n - 1}")
        if not self.kv_source_layers or any(r[i] == 0 for i in self.kv_source_layers + self.index_source_layers):
            raise ValueError(f"{self.name}: csa2 needs kv_source_layers, and every KV/index source a ratio > 0")
        kv_src = csa2.kv_source_of(r, self.kv_source_layers)
        ix_src = csa2.kv_source_of(r, self.index_source_layers)
        if any(x and (kv_src[i] is None or ix_src[i] is None) for i, x in enumerate(r)):
            raise ValueError(f"{self.name}: a layer with ratio > 0 comes before the first KV or index source")
        if min(self.head_dim, self.sliding_window, self.kv_row_bytes, self.index_row_bytes, self.swa_row_bytes,
               self.index_topk, self.index_n_heads, self.index_head_dim, self.qk_rope_head_dim) <= 0:
            raise ValueError(f"{self.name}: csa2 needs head_dim, qk_rope_head_dim, sliding_window, index_topk, "
                             "index_n_heads, index_head_dim, kv_row_bytes, index_row_bytes and swa_row_bytes > 0")
        if self.num_kv_heads != 1:
            raise ValueError(f"{self.name}: csa2 attention has one shared KV head (num_kv_heads=1)")
        e = self.ced_encoder_layers
        if e:
            if not 0 < e < n or self.ced_replay_tokens <= 0:
                raise ValueError(f"{self.name}: ced_encoder_layers must be in 1..{n - 1} with ced_replay_tokens > 0")
            # the decoder's global rows of a whole prompt come from the encoder pass plus the
            # boundary layer's GLOBAL projection, so no KV source may sit past the boundary, and
            # Engram (hashed from the whole prompt) must be in the encoder
            if any(i > e for i in self.kv_source_layers) or any(i >= e for i in self.engram_layers):
                raise ValueError(f"{self.name}: CED needs every KV source at or before layer {e} and every "
                                 f"Engram layer before it")
        if self.engram_layers and min(self.engram_table_rows, self.engram_lookups_per_token, self.engram_head_dim) <= 0:
            raise ValueError(f"{self.name}: Engram layers need engram_table_rows, engram_lookups_per_token "
                             "and engram_head_dim > 0")

    # ------------------------------------------------------------------ structure
    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def is_compressed(self) -> bool:
        """DeepSeek-V4 hybrid compressed attention (CSA/HCA + sliding window)."""
        return self.attention == "compressed"

    @property
    def is_csa2(self) -> bool:
        """DeepSeek-V4.1 CSA2 attention (shared global KV + sliding window, :mod:`sim.models.csa2`)."""
        return self.attention == "csa2"

    @property
    def prefix_hit_multiple_tokens(self) -> int:
        """Tokens a prefix-cache hit is a multiple of on vLLM 0.33 (1: any whole block).

        DeepSeek-V4 and V4.1 keep hybrid KV (vLLM's hybrid KV cache manager): full-attention MLA
        groups with compressed KV (CSA 4:1, HCA 128:1) beside sliding-window groups. A hit must
        suit every group (``HybridKVCacheCoordinator.find_longest_cache_hit``), and the MLA
        groups' blocks are :data:`V4_KV_BLOCK_TOKENS` tokens (V4's sparse MLA kernel supports no
        other size: ``models/deepseek_v4/sparse_mla.py``, ``get_supported_kernel_block_sizes``),
        so a hit is a multiple of 256 tokens. The sliding-window groups need only the window
        before the hit's end; vLLM keeps it cached at each such boundary (``reachable_block_mask``)
        and the simulator's cache evicts it with the prefix, so it adds no further condition here
        (V4.1's window is not cached at all: it is replayed, :attr:`ced_replay_tokens`).
        balancer/kv_translate.py applies the same rule to engines' events; docs/kv_cache.md.
        Where vLLM keeps the window only at some boundaries (``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``)
        or EAGLE/MTP needs a window block past the boundary, the hit ends at a retained checkpoint:
        :mod:`sim.run.engine.hit_checkpoints` (a pool option, off by default).
        """
        return V4_KV_BLOCK_TOKENS if self.attention in ("compressed", "csa2") else 1

    @property
    def sliding_window_block_tokens(self) -> int:
        """Tokens per block of the model's cached sliding-window KV groups in vLLM (0: none):
        :data:`V4_SWA_BLOCK_TOKENS` for DeepSeek-V4 (compressed attention; its MTP layer is a
        sliding-window-only layer, so under EAGLE/MTP a hit needs one such block past its end,
        :mod:`sim.run.engine.hit_checkpoints`). V4.1 replays its window instead of caching it: 0."""
        return V4_SWA_BLOCK_TOKENS if self.attention == "compressed" else 0

    @property
    def is_ced(self) -> bool:
        """Causal encoder-decoder: prompt tokens skip the decoder layers but a bounded replay."""
        return self.ced_encoder_layers > 0

    @property
    def _encoder_layers(self) -> range:
        """Layers every prompt token runs (all layers without a CED split)."""
        return range(self.ced_encoder_layers or self.num_layers)

    @property
    def _decoder_layers(self) -> range:
        return range(self.ced_encoder_layers or self.num_layers, self.num_layers)

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
        if self.is_compressed:
            return self._compressed_attention_params() // self.num_layers
        if self.is_csa2:
            return self._csa2_attention_params(range(self.num_layers)) // self.num_layers
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

    def _compressed_attention_params(self) -> int:
        """All layers' attention parameters of DeepSeek-V4 (tensor shapes of the V4-Flash
        checkpoint, see the preset's comment): wq_a (h x q_lora) + q_norm, wq_b (q_lora x n*hd),
        wkv (h x hd, one KV head) + kv_norm, grouped wo_a (n*hd -> o_groups*o_lora), wo_b
        (o_groups*o_lora x h), attention sinks (n); per compressed layer a compressor (wkv and
        wgate: h x c*hd with c = 2 for the overlapping ratio-4 compressor, else 1, plus its
        positional bias ratio x c*hd and norm); per CSA layer the lightning indexer (wq_b: q_lora x
        index_heads*index_dim, weights_proj: h x index_heads, and its own ratio-4 compressor of
        width index_dim)."""
        h, n, hd, q = self.hidden_size, self.num_attention_heads, self.head_dim, self.q_lora_rank or 0
        base = (h * q + q + q * n * hd if q else h * n * hd) + h * hd + hd
        base += n * hd * self.o_lora_rank + self.o_groups * self.o_lora_rank * h + n
        total = self.num_layers * base

        def compressor(width: int, ratio: int) -> int:
            c = 2 if ratio == 4 else 1
            return 2 * h * c * width + ratio * c * width + width

        for r in self.compress_ratios:
            if r:
                total += compressor(hd, r)
            if r == 4:
                ih, idim = self.index_n_heads, self.index_head_dim
                total += q * ih * idim + h * ih + compressor(idim, 4)
        return total

    def _csa2_base_attention(self) -> int:
        """One CSA2 layer's projections (the V4 set): wq_a (h x q_lora) + q_norm, wq_b (q_lora x n*hd),
        wkv (h x hd) + kv_norm, grouped wo_a (n*hd x o_lora in all), wo_b (o_groups*o_lora x h),
        attention sinks (n)."""
        h, n, hd, q = self.hidden_size, self.num_attention_heads, self.head_dim, self.q_lora_rank or 0
        base = (h * q + q + q * n * hd if q else h * n * hd) + h * hd + hd
        return base + n * hd * self.o_lora_rank + self.o_groups * self.o_lora_rank * h + n

    def _csa2_source_params(self, layer: int) -> int:
        """A KV source's own weights: its compressor (ratio >= 2: fused wkv|wgate 2 x h x hd plus a
        ratio x hd positional bias; ratio 1: wkv h x hd, no gate, TensorRT-LLM CSA2 README) and its
        norm, and the index-key projection from the compressed latent (hd x index_dim + norm)."""
        h, hd, r = self.hidden_size, self.head_dim, self.compress_ratios[layer]
        comp = (2 * h * hd + r * hd if r >= 2 else h * hd) + hd
        return comp + hd * self.index_head_dim + self.index_head_dim

    def _csa2_attention_params(self, layers) -> int:  # noqa: ANN001
        """Attention parameters of ``layers``: the base projections, a KV source's compressor and
        index-key projection, an index source's indexer queries (wq_b: q_lora x index_heads *
        index_dim) and head weights (h x index_heads)."""
        kv, ix = set(self.kv_source_layers), set(self.index_source_layers)
        q, ih, idim = self.q_lora_rank or 0, self.index_n_heads, self.index_head_dim
        total = 0
        for i in layers:
            total += self._csa2_base_attention()
            if i in kv:
                total += self._csa2_source_params(i)
            if i in ix:
                total += q * ih * idim + self.hidden_size * ih
        return total

    @property
    def engram_proj_params_per_layer(self) -> int:
        """One Engram layer's dense weights: the fused key/value projection from the looked-up rows
        (``lookups * engram_head_dim`` wide) to ``hc_mult`` keys + one value of ``hidden`` each
        (TensorRT-LLM ``DeepseekV41Engram``: "WKV splits as [hc_mult * dim, dim] -> (keys, value)"),
        plus the query/key gate norms (``2 * hc_mult * hidden``). V4.1-Flash: 6,144 x 25,600 +
        40,960 = 157.3M."""
        if not self.engram_layers:
            return 0
        m = max(self.hc_mult, 1)
        return (self.engram_lookups_per_token * self.engram_head_dim * (m + 1) * self.hidden_size
                + 2 * m * self.hidden_size)

    @property
    def engram_table_params(self) -> int:
        """Engram table entries (rows x head_dim); not in ``total_params`` (V4.1-Flash: 196.6B)."""
        return self.engram_table_rows * self.engram_head_dim

    def _layer_common(self) -> int:
        common = self.attention_params_per_layer + 2 * self.hidden_size  # + input/post-attn norms
        if self.hc_mult:  # mHC mixing for the attention and FFN sublayer: fn, base, scale each
            m = self.hc_mult
            common += 2 * ((m * m + 2 * m) * m * self.hidden_size + (m * m + 2 * m) + 3)
        return common

    def _dense_ffn(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def _moe_non_routed(self) -> int:
        # shared experts + router weight and its bias (DeepSeek-V3 e_score_correction_bias)
        gate = self.num_routed_experts * self.hidden_size + self.num_routed_experts
        return self.num_shared_experts * self.params_per_expert + gate

    def _count_total(self) -> int:
        per_layer = self.num_layers * self._layer_common()
        if self.is_compressed:  # attention params are not the same in every layer: count them whole
            per_layer += self._compressed_attention_params() - self.num_layers * self.attention_params_per_layer
        if self.is_csa2:
            per_layer += (self._csa2_attention_params(range(self.num_layers))
                          - self.num_layers * self.attention_params_per_layer
                          + len(self.engram_layers) * self.engram_proj_params_per_layer)
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

    # --- prompt tokens vs decode tokens (DeepSeek-V4.1 causal encoder-decoder) ---
    # A decode token runs every layer (the properties above). Under CED a prompt token runs only
    # the encoder layers plus the boundary layer's GLOBAL/index projections; the decoder layers
    # (and the LM head) run on the prompt's last ``ced_replay_tokens`` rows (replay_rows), each
    # costing the difference, so ``prefill + replay == decode`` per token; a prefix hit re-runs its
    # last window through the encoder (rebuild_rows). Without CED the prefill values are the
    # decode ones and the replay ones 0.
    def _csa2_layer_dense(self, i: int) -> int:
        """Layer ``i``'s non-routed weights: attention (with its compressor/indexer), norms, mHC,
        shared experts + router (or a dense FFN), Engram projection."""
        common = self._layer_common() - self.attention_params_per_layer + self._csa2_attention_params((i,))
        ffn = self._moe_non_routed() if (self.is_moe and i >= self.first_k_dense) else self._dense_ffn()
        return common + ffn + (self.engram_proj_params_per_layer if i in self.engram_layers else 0)

    @property
    def prefill_dense_flops_per_token(self) -> float:
        """Non-expert linear FLOPs of one prompt token. CED: ``2 * (encoder layers' non-routed
        weights + the boundary layer's KV-source projections and input norm)``; no LM head."""
        if not self.is_ced:
            return self.dense_flops_per_token
        e = self.ced_encoder_layers
        enc = sum(self._csa2_layer_dense(i) for i in self._encoder_layers)
        prepass = self.hidden_size + (self._csa2_source_params(e) if e in self.kv_source_layers else 0)
        return 2.0 * (enc + prepass)

    @property
    def prefill_expert_flops_per_token(self) -> float:
        """Routed-expert FLOPs of one prompt token: ``2 * experts_per_token * params_per_expert``
        per MoE layer it runs (CED: the encoder's)."""
        if not self.is_ced:
            return self.expert_flops_per_token
        moe = sum(1 for i in self._encoder_layers if self.is_moe and i >= self.first_k_dense)
        return 2.0 * moe * self.experts_per_token * self.params_per_expert

    @property
    def replay_dense_flops_per_token(self) -> float:
        """Non-expert FLOPs of one replayed (decoder) prefill row: decode token - prompt token."""
        return self.dense_flops_per_token - self.prefill_dense_flops_per_token if self.is_ced else 0.0

    @property
    def replay_expert_flops_per_token(self) -> float:
        return self.expert_flops_per_token - self.prefill_expert_flops_per_token if self.is_ced else 0.0

    @property
    def prefill_activated_params(self) -> float:
        """Parameters a prompt token passes through, incl. its embedding row (V4.1-Flash: 8.5B, the
        published "8B activated while reading input" without embedding)."""
        if not self.is_ced:
            return float(self.activated_params)
        return self.embedding_params + (self.prefill_dense_flops_per_token + self.prefill_expert_flops_per_token) / 2.0

    def replay_rows(self, new_tokens, cached_tokens=0.0):  # noqa: ANN001, ANN201
        """Decoder rows of a prefill chunk of ``new_tokens`` after ``cached_tokens``: the prompt's
        last window, ``min(cached + new, ced_replay_tokens)`` under CED (TensorRT-LLM executes "the
        intersection of each context chunk with the final prompt window [max(0, prompt_end -
        window), prompt_end)"; cached positions in that window have no decoder KV and are replayed
        too), else 0. Every chunk is taken as the prompt's last (a chunk does not say): an earlier
        chunk of a long prompt is overcharged by up to ``ced_replay_tokens`` rows."""
        c = np.asarray(new_tokens, dtype=np.float64)
        p = np.asarray(cached_tokens, dtype=np.float64)
        out = np.minimum(c + p, float(self.ced_replay_tokens)) * (c > 0) if self.is_ced else 0.0 * (c + p)
        return out if np.ndim(out) else float(out)

    def rebuild_rows(self, new_tokens, cached_tokens):  # noqa: ANN001, ANN201
        """Cached tokens a prefill chunk re-runs through the encoder: ``min(cached, sliding_window)``
        under CED. SWA bounded replay keeps the window rows out of the prefix cache and "rebuilds it
        after a prefix hit by recomputing the hit's last window" (vLLM's DeepseekV41ModelState;
        TensorRT-LLM: "Encoder replay starts at max(0, C - window_size)"); the global records of
        those tokens stay cached. A chunk continuing its own prompt (cached = its earlier chunks,
        whose windows are live) is charged the same: up to ``sliding_window`` rows too many."""
        c = np.asarray(new_tokens, dtype=np.float64)
        p = np.asarray(cached_tokens, dtype=np.float64)
        out = np.minimum(p, float(self.sliding_window)) * (c > 0) if self.is_ced else 0.0 * (c + p)
        return out if np.ndim(out) else float(out)

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
        if self.is_compressed or self.is_csa2:  # per (query, key row) of ONE layer: see decode_attended_keys
            return float(self.num_attention_heads * 2 * (self.head_dim + self.head_dim))
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
        return self.attn_flops_per_pair  # compressed: the sparse kernels run the same MQA in prefill

    # ------------------------------------------------------------------ compressed attention (V4)
    @property
    def num_csa_layers(self) -> int:
        return sum(1 for r in self.compress_ratios if r == 4)

    @property
    def num_hca_layers(self) -> int:
        return sum(1 for r in self.compress_ratios if r == 128)

    @property
    def indexer_flops_per_pair(self) -> float:
        """Lightning-indexer FLOPs per (query, compressed key) of one CSA layer:
        ``2 * index_n_heads * index_head_dim`` (a ReLU-weighted dot product per indexer head; run in
        FP8). V4-Flash: 2 * 64 * 128 = 16,384, 1/8 of a main-attention pair."""
        return float(2 * self.index_n_heads * self.index_head_dim)

    def decode_attended_keys(self, ctx_tokens):  # noqa: ANN001, ANN201 (float or ndarray)
        """(query, key row) pairs summed over layers for ONE query that sees ``ctx_tokens`` tokens.

        Compressed attention (DeepSeek-V4): every layer attends its raw sliding window,
        ``min(L, sliding_window)`` rows; a CSA layer (ratio 4) adds the ``index_topk`` compressed
        rows its lightning indexer selects, ``min(index_topk, L / 4)``; an HCA layer (ratio 128)
        adds all ``L / 128`` of its compressed rows. So the cost grows with the selected top-k, not
        with L, once ``L > 4 * index_topk`` (2,048 tokens for V4-Flash); only the HCA rows (1/128)
        and the indexer's scoring (:meth:`indexer_keys`) still grow with L. Rows are counted
        fractionally (``L / r``, no floor), the mean over positions.

        For MLA/GQA this is ``num_layers * L`` in the same per-layer units (unused there: their
        ``attn_flops_per_pair`` already covers all layers).

        Hand check (V4-Flash, L = 5,000): 43 * 128 + 21 * 512 + 20 * 5000/128 = 5,504 + 10,752 +
        781.25 = 17,037.25.

        CSA2 (DeepSeek-V4.1, :mod:`sim.models.csa2`): every layer's window plus, for a layer with ratio
        > 0, ``min(index_topk, L / r)`` rows of its KV source (``r`` the source's ratio); V4.1-Flash
        at L = 5,000: 40 * 128 + 38 * 512 = 24,576.
        """
        if self.is_csa2:
            return csa2.eval_terms(self.csa2_terms["att"], ctx_tokens)
        L = np.asarray(ctx_tokens, dtype=np.float64)
        if not self.is_compressed:
            return self.num_layers * L
        w = np.minimum(L, float(self.sliding_window)) * self.num_layers
        out = w + self.num_csa_layers * np.minimum(float(self.index_topk), L / 4.0) + self.num_hca_layers * (L / 128.0)
        return out if out.ndim else float(out)

    def indexer_keys(self, ctx_tokens):  # noqa: ANN001, ANN201
        """(query, compressed key) pairs the lightning indexers score for one query seeing
        ``ctx_tokens`` tokens: ``num_csa_layers * L / 4`` (0 without CSA layers); CSA2: each index
        source scores its KV source's ``L / r`` keys (candidate consumers at most the candidate pool)."""
        if self.is_csa2:
            return csa2.eval_terms(self.csa2_terms["idx"], ctx_tokens)
        L = np.asarray(ctx_tokens, dtype=np.float64)
        out = self.num_csa_layers * L / 4.0 if self.is_compressed else 0.0 * L
        return out if np.ndim(out) else float(out)

    def decode_kv_read_bytes(self, ctx_tokens):  # noqa: ANN001, ANN201
        """KV bytes one decode step of one sequence reads (all layers).

        Compressed attention: the attended rows (:meth:`decode_attended_keys`) of ``kv_row_bytes``
        each, plus the indexer keys scored (:meth:`indexer_keys`) of ``index_row_bytes``. Other
        kinds: ``ctx_tokens * kv_bytes_per_token``. V4-Flash at L = 5,000: 17,037.25 * 584 +
        26,250 * 132 = 13.41 MB (DeepSeek-V3, BF16 MLA: 5,000 * 70,272 = 351 MB).
        """
        if self.is_csa2:  # window rows, selected global main records, scored index records
            t = self.csa2_terms
            return (csa2.eval_terms(t["win"], ctx_tokens) * self.swa_row_bytes
                    + csa2.eval_terms(t["glob"], ctx_tokens) * self.kv_row_bytes
                    + csa2.eval_terms(t["idx"], ctx_tokens) * self.index_row_bytes)
        if not self.is_compressed:
            out = np.asarray(ctx_tokens, dtype=np.float64) * self.kv_bytes_per_token
            return out if out.ndim else float(out)
        return self.decode_attended_keys(ctx_tokens) * self.kv_row_bytes + self.indexer_keys(ctx_tokens) * self.index_row_bytes

    def _prefix_sum(self, f, new_tokens, cached_tokens):  # noqa: ANN001, ANN202
        """``sum_{j = p+1}^{p+c} f(j)`` by the trapezoid rule on ``f``'s integral (exact for
        piecewise-linear ``f`` away from its kinks): ``F(p + c) - F(p) + (f(p + c) - f(p)) / 2``."""
        c = np.asarray(new_tokens, dtype=np.float64)
        p = np.asarray(cached_tokens, dtype=np.float64)
        a, b = p, p + c
        return f[0](b) - f[0](a) + 0.5 * (f[1](b) - f[1](a))

    def _attended_integral(self, x):  # noqa: ANN001, ANN202
        """Antiderivative of :meth:`decode_attended_keys` in L (x >= 0)."""
        def int_min(x, cap, slope):  # noqa: ANN001, ANN202 (int_0^x min(cap, slope*t) dt)
            x0 = cap / slope
            return np.where(x <= x0, 0.5 * slope * x * x, 0.5 * cap * x0 + cap * (x - x0))

        W = float(self.sliding_window)
        return (self.num_layers * int_min(x, W, 1.0) + self.num_csa_layers * int_min(x, float(self.index_topk), 0.25)
                + self.num_hca_layers * x * x / 256.0)

    def prefill_attended_keys(self, new_tokens, cached_tokens):  # noqa: ANN001, ANN201
        """(query, key row) pairs over layers of a prefill chunk of ``new_tokens`` after
        ``cached_tokens``: the sum of :meth:`decode_attended_keys` over the chunk's positions
        (trapezoid rule). For MLA/GQA the causal pair count ``c * p + c * (c + 1) / 2`` (per
        layer-summed convention of ``prefill_attn_flops_per_pair``)."""
        if self.is_csa2:
            return self._csa2_chunk_sum("att_enc", "att_dec", new_tokens, cached_tokens)
        if not self.is_compressed:
            return _causal_pairs(new_tokens, cached_tokens)
        out = self._prefix_sum((self._attended_integral, self.decode_attended_keys), new_tokens, cached_tokens)
        return out if np.ndim(out) else float(out)

    def prefill_indexer_keys(self, new_tokens, cached_tokens):  # noqa: ANN001, ANN201
        """Indexer (query, key) pairs of a prefill chunk: ``num_csa_layers / 4`` times the causal
        pair count."""
        if self.is_csa2:
            return self._csa2_chunk_sum("idx_enc", "idx_dec", new_tokens, cached_tokens)
        if not self.is_compressed:
            return 0.0 * _causal_pairs(new_tokens, cached_tokens)
        return self.num_csa_layers / 4.0 * _causal_pairs(new_tokens, cached_tokens)

    @functools.cached_property
    def csa2_terms(self) -> dict[str, csa2.Terms]:
        """Piecewise-linear counts per query (:mod:`sim.models.csa2`): ``win``/``glob`` window and global
        rows attended, ``att`` both, ``idx`` index keys scored, over all layers; ``att_enc``/
        ``idx_enc`` over the encoder layers and ``att_dec``/``idx_dec`` over the decoder ones."""
        r, kv, ix = self.compress_ratios, self.kv_source_layers, self.index_source_layers
        geo = dict(sliding_window=self.sliding_window, index_topk=self.index_topk)
        cand = dict(candidate_source=self.candidate_source_layer if self.candidate_source_layer >= 0 else None,
                    candidate_tokens=self.candidate_tokens)
        every = range(self.num_layers)
        return {
            "win": csa2.attended_terms(r, kv, **geo, layers=every, global_rows=False),
            "glob": csa2.attended_terms(r, kv, **geo, layers=every, window=False),
            "att": csa2.attended_terms(r, kv, **geo, layers=every),
            "idx": csa2.indexer_terms(r, kv, ix, **cand, layers=every),
            "att_enc": csa2.attended_terms(r, kv, **geo, layers=self._encoder_layers),
            "att_dec": csa2.attended_terms(r, kv, **geo, layers=self._decoder_layers),
            "idx_enc": csa2.indexer_terms(r, kv, ix, **cand, layers=self._encoder_layers),
            "idx_dec": csa2.indexer_terms(r, kv, ix, **cand, layers=self._decoder_layers),
        }

    def _csa2_chunk_sum(self, enc: str, dec: str, new_tokens, cached_tokens):  # noqa: ANN001, ANN202
        """A prefill chunk of ``c`` new tokens after ``p`` cached: the encoder terms summed over its
        positions ``p+1 .. p+c`` and the rebuilt window before them (:meth:`rebuild_rows`), the
        decoder terms over the prompt's last window (:meth:`replay_rows`)."""
        c = np.asarray(new_tokens, dtype=np.float64)
        p = np.asarray(cached_tokens, dtype=np.float64)
        t = self.csa2_terms
        if not self.is_ced:
            out = csa2.sum_terms(t[enc], p, p + c)
        else:
            out = (csa2.sum_terms(t[enc], p - self.rebuild_rows(c, p), p + c)
                   + csa2.sum_terms(t[dec], p + c - self.replay_rows(c, p), p + c))
        return out if np.ndim(out) else float(out)

    @property
    def kv_bytes_per_seq_fixed(self) -> int:
        """Per-sequence KV that does not grow with context: the sliding-window rows of every layer
        (``num_layers * sliding_window * kv_row_bytes``; V4-Flash 43 * 128 * 584 = 3.21 MB). 0 for
        other kinds."""
        if self.is_csa2:  # CSA2 keeps its window rows in their own format (swa_row_bytes)
            return self.num_layers * self.sliding_window * self.swa_row_bytes
        return self.num_layers * self.sliding_window * self.kv_row_bytes if self.is_compressed else 0

    # ------------------------------------------------------------------ bytes
    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token over all layers.

        GQA: ``2 (K and V) * layers * kv_heads * head_dim * kv_bytes``.
        MLA: only the compressed latent and the shared RoPE key are cached:
        ``layers * (kv_lora_rank + qk_rope_head_dim) * kv_bytes``.
        Compressed (DeepSeek-V4): one ``kv_row_bytes`` row per ``r`` tokens per compressed layer,
        plus one ``index_row_bytes`` indexer key per 4 tokens per CSA layer, rounded up; the
        sliding-window rows are per sequence (:attr:`kv_bytes_per_seq_fixed`). V4-Flash:
        21 * (584 + 132) / 4 + 20 * 584 / 128 = 3,850.25 -> 3,851 B (DeepSeek-V3 BF16: 70,272 B).
        CSA2 (DeepSeek-V4.1): one ``kv_row_bytes`` main + one ``index_row_bytes`` index record per
        ``r`` tokens of each KV source only (the other layers read the sources' rows); V4.1-Flash:
        3 * (288 + 68) / 2 + (288 + 68) = 890 B. This is the prefix-cacheable, transferable part.
        """
        if self.is_csa2:  # one main + one index record per r tokens of each KV source (window: per seq)
            return math.ceil(sum((self.kv_row_bytes + self.index_row_bytes) / self.compress_ratios[i]
                                 for i in self.kv_source_layers))
        if self.is_compressed:  # amortised compressed rows + indexer keys (window: kv_bytes_per_seq_fixed)
            b = sum((self.kv_row_bytes + (self.index_row_bytes if r == 4 else 0)) / r
                    for r in self.compress_ratios if r)
            return math.ceil(b)
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes

    @property
    def weight_bytes_total(self) -> float:
        """Resident bytes of all weights (routed experts at their own width, e.g. FP4)."""
        return self.dense_weight_bytes + self.expert_weight_bytes

    @property
    def dense_weight_bytes(self) -> float:
        """Resident bytes of the non-expert part (incl. embedding table)."""
        return float(self.dense_params) * self.weight_bytes

    @property
    def dense_weight_read_bytes(self) -> float:
        """Non-expert bytes streamed from HBM once per step (the embedding table is not streamed)."""
        return float(self.dense_params - self.embedding_params) * self.weight_bytes

    @property
    def expert_param_bytes(self) -> float:
        """Bytes per routed-expert parameter (``expert_weight_bytes_per_param``, else ``weight_bytes``)."""
        b = self.expert_weight_bytes_per_param
        return float(self.weight_bytes if b is None else b)

    @property
    def expert_weight_bytes(self) -> float:
        """Resident bytes of all routed experts (FP4 experts: 0.53 B per parameter)."""
        return float(self.routed_expert_params) * self.expert_param_bytes


