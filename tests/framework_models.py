"""Models written with other people's libraries (test data): Hugging Face Flax GPT-2 and LLaMA
from small configs with random weights, a Flax nnx MLP and an Equinox MLP, each with a training
step `step(params, opt_state, batch...) -> (params, opt_state, loss)` in the order optax's docs use."""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import optax

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # transformers warns that its Flax models are deprecated
    from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, GPT2Config, LlamaConfig

VOCAB = 128


def gpt2(layers=1, hidden=64, heads=8, positions=64):
    config = GPT2Config(vocab_size=VOCAB, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return FlaxGPT2LMHeadModel(config, seed=0)


def llama(layers=1, hidden=64, heads=8, kv_heads=4, positions=64):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions)
    return FlaxLlamaForCausalLM(config, seed=0)


def tokens(batch=8, length=16, seed=3):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, VOCAB)


def lm_step(model, optimizer):
    """Next-token cross-entropy of a Hugging Face causal LM, one optimizer step."""
    def loss_fn(params, ids):
        logits = model(ids, params=params).logits[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d_in=32, hidden=64, d_out=16):
        self.up, self.norm = nnx.Linear(d_in, hidden, rngs=rngs), nnx.LayerNorm(hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d_out, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.norm(self.up(x))))


def nnx_mlp_program(optimizer, batch=32):
    """(step, params, batch): nnx's state split into Params and the rest, merged back in the loss."""
    graphdef, params, rest = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(params, x, y):
        return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

    return _regression_step(loss_fn, optimizer), params, _regression_data(batch)


def eqx_mlp_program(optimizer, batch=32):
    """(step, params, batch): an Equinox MLP partitioned into arrays and static parts, vmapped per example."""
    model = eqx.nn.MLP(32, 16, 64, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, x, y):
        return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - y) ** 2)

    return _regression_step(loss_fn, optimizer), params, _regression_data(batch)


def _regression_step(loss_fn, optimizer):
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _regression_data(batch):
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (batch, 32)), jax.random.normal(ky, (batch, 16))
