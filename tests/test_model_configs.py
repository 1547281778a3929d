"""Hugging Face config.json files read as published (parameter counts as the model cards state),
MoE accounting from the activated experts, and architectures refused by name."""

from __future__ import annotations

import json
import math

import pytest

from meshplan import ModelSpecError
from meshplan.models.training import block_training_graph
from meshplan.models.transformer import PRESETS, load_hf_config
from meshplan.simulator import TrainingJob

# Sizes from each model's published config.json; expected (total, activated) parameters in
# billions from the model cards / papers.
CONFIGS = {
    "mixtral-8x7b": ({"model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
                      "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                      "max_position_embeddings": 32768}, 46.7, 12.9),
    "deepseek-moe-16b": ({"model_type": "deepseek", "hidden_size": 2048, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "num_hidden_layers": 28, "intermediate_size": 10944,
                          "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                          "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                          "vocab_size": 102400, "max_position_embeddings": 4096}, 16.4, 2.8),
    "qwen2-7b": ({"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                  "num_hidden_layers": 28, "intermediate_size": 18944, "vocab_size": 152064,
                  "tie_word_embeddings": False}, 7.6, 7.6),
    "gpt2": ({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "vocab_size": 50257,
              "n_positions": 1024}, 0.124, 0.124),
    "gpt-neox-20b": ({"model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64,
                      "num_hidden_layers": 44, "intermediate_size": 24576, "vocab_size": 50432,
                      "max_position_embeddings": 2048, "tie_word_embeddings": False}, 20.6, 20.6),
    "gemma-7b": ({"model_type": "gemma", "hidden_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "head_dim": 256, "num_hidden_layers": 28, "intermediate_size": 24576, "vocab_size": 256000},
                 8.54, 8.54),
    "mistral-7b": ({"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
                    "vocab_size": 32000}, 7.24, 7.24),
}


def write(tmp_path, name, raw):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_published_parameter_counts(tmp_path, name):
    raw, total, active = CONFIGS[name]
    config = load_hf_config(write(tmp_path, name, raw))
    assert config.num_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert config.active_params() / 1e9 == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-moe-16b", "gemma-7b", "gpt2"])
def test_block_graph_holds_the_counted_parameters(tmp_path, name):
    """The training graph the planner prices holds exactly the block's counted weights (all
    experts, the shared ones, Gemma's 256-wide heads)."""
    config = load_hf_config(write(tmp_path, name, CONFIGS[name][0]))
    index = next((i for i in range(config.layers) if config.is_moe_layer(i)), 0)
    piece = block_training_graph(config.replace(layers=index + 1), index, 1, 16)
    held = sum(math.prod(piece.graph[w].shape) for w in piece.weights)
    assert held == config.block_params(config.is_moe_layer(index))


def test_moe_model_flops_count_the_activated_experts(tmp_path):
    mixtral = load_hf_config(write(tmp_path, "mixtral", CONFIGS["mixtral-8x7b"][0]))
    job = TrainingJob(mixtral, 256, 4096)
    assert job.model_flops == 6 * mixtral.flop_params() * 256 * 4096
    assert mixtral.flop_params() == mixtral.active_params() - 32000 * 4096
    assert job.model_flops < 0.3 * 6 * mixtral.num_params() * 256 * 4096
    assert PRESETS["mixtral-8x7b"].num_params() == mixtral.num_params()
    dense = PRESETS["llama2-7b"]
    assert dense.active_params() == dense.num_params()


def test_deepseek_first_block_is_dense(tmp_path):
    config = load_hf_config(write(tmp_path, "ds", CONFIGS["deepseek-moe-16b"][0]))
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert config.shared_experts == 2 and config.expert_width == 1408


@pytest.mark.parametrize(("model_type", "named"), [("deepseek_v3", "multi-head latent attention"),
                                                     ("mamba", "state-space"), ("rwkv", "'rwkv'")])
def test_unmodelled_architectures_are_refused_by_name(tmp_path, model_type, named):
    raw = {**CONFIGS["mistral-7b"][0], "model_type": model_type}
    with pytest.raises(ModelSpecError, match=named) as info:
        load_hf_config(write(tmp_path, "x", raw))
    assert "mixtral" in str(info.value)  # the message lists what is read
