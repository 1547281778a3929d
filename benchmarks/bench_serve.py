"""Generation throughput of Hugging Face Flax GPT-2 and LLaMA (small configs, random weights):
prefill and decode tokens/s served by meshplan on 8 CPU devices (ShardParallel, 2x4 mesh,
planned KV cache) against the same steps under plain `jax.jit` on one device.
Writes benchmarks/results/serve.json. Run: python benchmarks/bench_serve.py

With 2 cores the 8 "devices" share the same CPU: the sharded steps pay for collectives and
dispatch to 8 devices without more compute, so they are expected to be slower here. What this
records is the cost of serving through a plan on this machine, not an accelerator speed-up.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import statistics  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

from meshplan.serving import Server, serve  # noqa: E402

from common import save  # noqa: E402

warnings.simplefilter("ignore")
from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

BATCH, PROMPT, NEW, REPEATS = 8, 64, 32, 3


def models() -> dict:
    gpt2 = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=128, n_embd=256, n_layer=4, n_head=8), seed=0)
    llama = FlaxLlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                             max_position_embeddings=128), seed=0)
    return {"gpt2 (4 layers, 256 hidden)": gpt2, "llama (4 layers, 256 hidden, GQA 8/4)": llama}


def measure(server: Server, prompts: np.ndarray) -> tuple[dict, np.ndarray]:
    server.generate(prompts, NEW)  # plans and compiles
    runs = []
    for _ in range(REPEATS):
        out = server.generate(prompts, NEW)
        runs.append(server.stats)
    return {"prefill_tokens_per_s": statistics.median(s.prefill_tokens_per_second for s in runs),
            "decode_tokens_per_s": statistics.median(s.decode_tokens_per_second for s in runs)}, out


def main() -> None:
    prompts = np.random.default_rng(0).integers(0, 1024, (BATCH, PROMPT), dtype=np.int32)
    cases = []
    for name, model in models().items():
        sharded, single = serve(model), Server.single_device(model)
        got, tokens = measure(sharded, prompts)
        want, reference = measure(single, prompts)
        specs = sorted(set(sharded.cache_specs().values()))
        case = {"model": name, "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW, "mesh": [2, 4],
                "meshplan_8_devices": got, "jit_1_device": want, "kv_cache_specs": specs,
                "tokens_equal": bool(np.array_equal(tokens, reference))}
        print(case)
        cases.append(case)
    print(save("serve", cases))


if __name__ == "__main__":
    main()
