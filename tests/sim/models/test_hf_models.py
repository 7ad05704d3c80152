"""Model specs from Hugging Face config.json (sim.models.hf) and the shipped config presets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sim.models.hf import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, model_from_hf_config
from sim.models.presets import DEEPSEEK_V3, DEEPSEEK_V4_FLASH, LLAMA_3_1_70B, MODELS, get_model
from sim.run.pool_perf import roofline_for_pool
from sim.scenario import PoolConfig, Scenario

DATA = Path(__file__).parents[2] / "data" / "hf"


@pytest.mark.parametrize("file,preset", [("deepseek-v4-flash.json", DEEPSEEK_V4_FLASH),
                                         ("deepseek-v3.json", DEEPSEEK_V3),
                                         ("llama-3.1-70b.json", LLAMA_3_1_70B)])
def test_config_json_equals_the_hand_written_preset(file, preset):
    # two independent routes to the same architecture: the checkpoint's config.json vs the preset
    # typed in from the papers / model cards
    m = model_from_hf_config(DATA / file, name=preset.name)
    assert dataclasses.asdict(m) == dataclasses.asdict(preset)


def test_shipped_qwen3_presets_match_published_sizes():
    q32, moe = get_model("qwen3-32b"), get_model("qwen3-30b-a3b")
    # Qwen3 model cards: 32.8B parameters; 30.5B total / 3.3B activated
    assert abs(q32.total_params / 32.8e9 - 1) < 0.01 and not q32.is_moe
    assert abs(moe.total_params / 30.5e9 - 1) < 0.01 and abs(moe.activated_params / 3.3e9 - 1) < 0.02
    # KV by hand: 2 x 64 layers x 8 heads x 128 x 2 B; 2 x 48 x 4 x 128 x 2 B
    assert q32.kv_bytes_per_token == 262_144 and moe.kv_bytes_per_token == 98_304
    assert {"qwen3-32b", "qwen3-30b-a3b", "llama-3.1-70b"} <= set(MODELS)


def test_mixtral_and_path_in_a_scenario(tmp_path):
    cfg = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))  # a folder holding config.json
    # Mixtral-8x7B: 46.7B total, 12.9B active (Mistral's announcement)
    assert abs(m.total_params / 46.7e9 - 1) < 0.01 and abs(m.activated_params / 12.9e9 - 1) < 0.01
    assert m.name == tmp_path.name
    sc = Scenario(model=str(tmp_path / "config.json"), hardware="H100", mixed=PoolConfig(dp_ranks=1, gpus_per_rank=2))
    assert roofline_for_pool(sc, sc.mixed).kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


@pytest.mark.parametrize("cfg,match", [
    ({"architectures": ["MambaForCausalLM"], "num_hidden_layers": 1}, "unsupported architecture 'MambaForCausalLM'"),
    ({"num_hidden_layers": 1}, "unsupported architecture None"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8,
      "intermediate_size": 8}, "no 'num_hidden_layers'"),
    ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": "2", "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 8, "intermediate_size": 8}, "num_hidden_layers must be an integer >= 1, got '2'"),
    # 0 layers: one message with the bound that holds (was: '>= 0' for -1, then 0 refused by another check)
    ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 0, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 8, "intermediate_size": 8}, "num_hidden_layers must be an integer >= 1, got 0"),
    ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": -1, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 8, "intermediate_size": 8}, "num_hidden_layers must be an integer >= 1, got -1"),
    ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 0,
      "vocab_size": 8, "intermediate_size": 8}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "mlp_only_layers": [0]}, "not modelled"),
    ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 8, "intermediate_size": 8, "torch_dtype": "float32"}, "unsupported torch_dtype"),
])
def test_clear_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        model_from_hf_config(cfg)


def test_unsupported_is_a_value_error_listing_the_supported(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        get_model(str(p))
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)
    assert str(e.value).startswith(f"{p}: unsupported architecture 'GPT2LMHeadModel'")  # names the file
    with pytest.raises(FileNotFoundError):
        get_model(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        get_model(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="or a Hugging Face config.json path"):
        get_model("no-such-model")


def test_deepseek_v2_lite_without_q_lora():
    # DeepSeek-V2-Lite config.json (architecture fields): the paper's 15.7B total / 2.4B activated
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
           "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
           "n_group": 1, "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 102400, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    m = model_from_hf_config(cfg, name="deepseek-v2-lite")
    assert m.q_lora_rank is None and m.max_routed_nodes == 0 and m.num_moe_layers == 26
    assert abs(m.total_params / 15.7e9 - 1) < 0.01
    # routed experts by hand: 26 MoE layers x 64 x 3 x 2048 x 1408, 6 of them per token
    assert m.routed_expert_params == 26 * 64 * 3 * 2048 * 1408
    assert m.activated_params == m.total_params - 26 * 58 * 3 * 2048 * 1408
    # 2.66B with the 0.21B input embedding and 0.21B LM head (the paper's 2.4B activated)
    assert 2.4e9 < m.activated_params - m.embedding_params < 2.5e9
    assert m.kv_bytes_per_token == 27 * 576 * 2
