"""Serve a Hugging Face Flax GPT-2 or LLaMA (small config, random weights) on 8 CPU devices:
prefill and decode planned by meshplan, greedy and sampled generation of batched prompts.

Run: python examples/serve.py [--model gpt2|llama] [--new-tokens N]
"""

from __future__ import annotations

import os

# XLA reads these once, when JAX initialises: set them before importing JAX.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

import meshplan  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers: Flax models are deprecated upstream
from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, GPT2Config, LlamaConfig  # noqa: E402


def build(name: str):
    if name == "gpt2":
        return FlaxGPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=8), seed=0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    return FlaxLlamaForCausalLM(config, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    model = build(args.model)
    server = meshplan.serve(model)  # ShardParallel on the default (2, 4) mesh of the 8 devices
    prompts = np.random.default_rng(0).integers(0, 256, (4, 8), dtype=np.int32)
    mask = np.ones_like(prompts)
    mask[1, :3] = 0  # the second prompt is 5 tokens long, left-padded
    greedy = server.generate(prompts, args.new_tokens, attention_mask=mask)
    stats = server.stats
    print(f"greedy: {greedy[0, 8:].tolist()}")
    print(f"prefill {stats.prefill_seconds:.2f} s, decode {stats.decode_seconds:.2f} s "
          "(first call: plans and compiles)")
    greedy = server.generate(prompts, args.new_tokens, attention_mask=mask)
    print(f"again: prefill {server.stats.prefill_tokens_per_second:.0f} tokens/s, "
          f"decode {server.stats.decode_tokens_per_second:.0f} tokens/s")
    sampled = server.generate(prompts, args.new_tokens, temperature=0.8, top_k=20, attention_mask=mask, seed=1)
    print(f"sampled: {sampled[0, 8:].tolist()}")
    reference = meshplan.Server.single_device(model).generate(prompts, args.new_tokens, attention_mask=mask)
    print(f"greedy equals one device: {bool(np.array_equal(greedy, reference))}")
    for phase, plan in server.get_plans().items():
        print(f"{phase} plan: mesh {plan.mesh.shape}, {len(plan.nodes)} nodes")
    for leaf, spec in list(server.cache_specs().items())[:3]:
        print(f"KV cache {leaf}: {spec}")


if __name__ == "__main__":
    main()
