"""Training steps written as their authors write them, on models whose positions carry meaning
(test data for the batch finder): Hugging Face's run_clm_flax.py step on a Flax causal LM, a Flax
linen decoder with sinusoidal position embeddings trained as Flax's lm1b example does, a Flax nnx
model with rotary embeddings trained as Flax's gemma example does, and Alpa's pipeline MLP test.
Small configs, random weights."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state
from flax.training.common_utils import onehot

from meshplan.runtime import mark_pipeline_boundary

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # transformers warns that its Flax models are deprecated
    from transformers import FlaxMistralForCausalLM, MistralConfig

VOCAB = 64


# --- Hugging Face: run_clm_flax.py's train step -----------------------------------------------------

class ClmTrainState(train_state.TrainState):
    dropout_rng: jnp.ndarray


def mistral(layers=1, hidden=32, heads=4, kv_heads=2, positions=32):
    config = MistralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=positions, sliding_window=4)
    return FlaxMistralForCausalLM(config, seed=0)


def clm_state(model, optimizer):
    return ClmTrainState.create(apply_fn=model.__call__, params=model.params, tx=optimizer,
                                dropout_rng=jax.random.PRNGKey(0))


def clm_batch(batch=4, length=8, seed=3):
    ids = jax.random.randint(jax.random.key(seed), (batch, length), 1, VOCAB)
    return {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": ids}


def clm_loss(logits, labels):
    shift_logits = logits[..., :-1, :]
    shift_labels = labels[..., 1:]
    loss = optax.softmax_cross_entropy(shift_logits, onehot(shift_labels, shift_logits.shape[-1]))
    return loss.mean()


def clm_train_step(state, batch):
    """The step of run_clm_flax.py, without its pmap (pmean of the gradient and metrics)."""
    dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

    def compute_loss(params):
        inputs = dict(batch)
        labels = inputs.pop("labels")
        logits = state.apply_fn(**inputs, params=params, dropout_rng=dropout_rng, train=True)[0]
        return clm_loss(logits, labels)

    loss, grad = jax.value_and_grad(compute_loss)(state.params)
    new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
    return new_state, {"loss": loss}


# --- Flax lm1b: a linen decoder with sinusoidal positions ---------------------------------------------

def sinusoidal_table(max_len, features, max_scale=10_000.0):
    """[1, max_len, features]: sines in the first half, cosines in the second."""
    position = np.arange(max_len)[:, None]
    rates = np.exp(-np.log(max_scale) * np.arange(features // 2) / (features // 2 - 1))
    return jnp.asarray(np.concatenate([np.sin(position * rates), np.cos(position * rates)], axis=1)[None],
                       dtype=jnp.float32)


def shift_right(x):
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class DecoderBlock(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x, mask, deterministic):
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=0.0)(
            nn.LayerNorm()(x), mask=mask, deterministic=deterministic)
        x = x + h
        h = nn.Dense(x.shape[-1])(nn.relu(nn.Dense(self.mlp_dim)(nn.LayerNorm()(x))))
        return x + nn.Dropout(rate=0.0)(h, deterministic=deterministic)


class Lm1bDecoder(nn.Module):
    vocab: int = VOCAB
    features: int = 32
    heads: int = 4
    mlp_dim: int = 64
    layers: int = 1
    max_len: int = 32

    @nn.compact
    def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None, train=False):
        """Packed examples (several per row) give their positions and segment ids."""
        mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs))
        if inputs_segmentation is not None:
            mask = nn.combine_masks(mask, nn.make_attention_mask(inputs_segmentation, inputs_segmentation, jnp.equal))
        embed = nn.Embed(self.vocab, self.features)
        y = embed(shift_right(inputs))
        table = sinusoidal_table(self.max_len, self.features)
        y = y + (table[:, :inputs.shape[1]] if inputs_positions is None else table[0][inputs_positions])
        for _ in range(self.layers):
            y = DecoderBlock(self.heads, self.mlp_dim)(y, mask, not train)
        return embed.attend(nn.LayerNorm()(y))  # the output projection shares the embedding


def weighted_cross_entropy(logits, targets, weights):
    """(sum of the weighted token losses, sum of the weights)."""
    loss = -jnp.sum(onehot(targets, logits.shape[-1]) * jax.nn.log_softmax(logits), axis=-1)
    return (loss * weights).sum(), weights.sum()


def lm_metrics(logits, targets, weights):
    loss, weight_sum = weighted_cross_entropy(logits, targets, weights)
    accuracy = ((jnp.argmax(logits, axis=-1) == targets) * weights).sum()
    return {"loss": loss, "accuracy": accuracy, "denominator": weight_sum}


def lm1b_program(optimizer, batch=4, length=8):
    """(step, state, batch, dropout_rng): the step of Flax's lm1b example, at a fixed learning rate, on
    packed examples (two per row, padded at the end), as its input pipeline makes them."""
    model = Lm1bDecoder()
    inputs = jax.random.randint(jax.random.key(5), (batch, length), 1, VOCAB).at[:, -2:].set(0)
    half = length // 2
    positions = jnp.tile(jnp.concatenate([jnp.arange(half), jnp.arange(length - half)]), (batch, 1))
    segments = jnp.tile(jnp.repeat(jnp.array([1, 2]), jnp.array([half, length - half])), (batch, 1))
    data = {"inputs": inputs, "inputs_position": positions, "inputs_segmentation": segments * (inputs > 0)}
    params = model.init(jax.random.key(0), inputs)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)

    def train_step(state, batch, dropout_rng):
        inputs, positions, segments = (batch.get(k) for k in ("inputs", "inputs_position", "inputs_segmentation"))
        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        dropout_rng = jax.random.fold_in(dropout_rng, state.step)

        def loss_fn(params):
            logits = model.apply({"params": params}, inputs, inputs_positions=positions,
                                 inputs_segmentation=segments, train=True, rngs={"dropout": dropout_rng})
            loss, weight_sum = weighted_cross_entropy(logits, inputs, weights)
            return loss / weight_sum, logits

        (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), lm_metrics(logits, inputs, weights)

    return train_step, state, data, jax.random.PRNGKey(1)


# --- Flax gemma: an nnx model with rotary embeddings ---------------------------------------------------

def apply_rope(x, positions, max_wavelength=10_000):
    """Rotary embeddings of x[batch, length, heads, head_dim] at positions[batch, length]."""
    half = x.shape[-1] // 2
    timescale = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
    angle = (positions[..., None] / timescale)[..., None, :]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class RMSNorm(nnx.Module):
    def __init__(self, features):
        self.scale = nnx.Param(jnp.zeros((features,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * (1 + self.scale[...])


class Attention(nnx.Module):
    def __init__(self, features, heads, kv_heads, head_dim, rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nnx.Linear(features, heads * head_dim, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(features, 2 * kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(heads * head_dim, features, use_bias=False, rngs=rngs)

    def __call__(self, x, positions, mask):
        b, t, _ = x.shape
        q = apply_rope(self.q(x).reshape(b, t, self.heads, self.head_dim), positions) * self.head_dim**-0.5
        k, v = jnp.split(self.kv(x).reshape(b, t, 2 * self.kv_heads, self.head_dim), 2, axis=2)
        k = jnp.repeat(apply_rope(k, positions), self.heads // self.kv_heads, axis=2)
        v = jnp.repeat(v, self.heads // self.kv_heads, axis=2)
        logits = jnp.where(mask[:, None], jnp.einsum("btnh,bsnh->bnts", q, k), -2.3819763e38)
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
        return self.out(out.reshape(b, t, -1))


class GatedMLP(nnx.Module):
    def __init__(self, features, hidden, rngs):
        self.gate = nnx.Linear(features, 2 * hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, features, use_bias=False, rngs=rngs)

    def __call__(self, x):
        gate, up = jnp.split(self.gate(x), 2, axis=-1)
        return self.down(nnx.gelu(gate) * up)


class GemmaStyle(nnx.Module):
    def __init__(self, rngs, vocab=VOCAB, features=32, heads=4, kv_heads=2, layers=1):
        self.embed = nnx.Embed(vocab, features, rngs=rngs)
        self.norms = nnx.List([RMSNorm(features) for _ in range(2 * layers + 1)])
        self.attention = nnx.List([Attention(features, heads, kv_heads, features // heads, rngs)
                                   for _ in range(layers)])
        self.mlps = nnx.List([GatedMLP(features, 2 * features, rngs) for _ in range(layers)])

    def __call__(self, tokens, positions, attention_mask):
        x = self.embed(tokens) * jnp.sqrt(jnp.float32(self.embed.features))
        for k, (attention, mlp) in enumerate(zip(self.attention, self.mlps, strict=True)):
            x = x + attention(self.norms[2 * k](x), positions, attention_mask)
            x = x + mlp(self.norms[2 * k + 1](x))
        return self.embed.attend(self.norms[-1](x))


class NnxTrainState(train_state.TrainState):
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)


def causal_attention_mask(input_mask):
    """[batch, length, length]: a token attends to the non-padding tokens up to itself."""
    length = input_mask.shape[-1]
    return input_mask[:, None, :] & jnp.tril(jnp.ones((length, length), jnp.bool_))


def gemma_program(optimizer, batch=4, length=8):
    """(step, state, batch): the step of Flax's gemma example (learning_rate_fn bound, packed
    examples' positions given in the batch)."""
    graphdef, params = nnx.split(GemmaStyle(nnx.Rngs(0)), nnx.Param)
    state = NnxTrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=optimizer)
    inputs = jax.random.randint(jax.random.key(6), (batch, length), 1, VOCAB)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    data = {"inputs": inputs, "inputs_position": positions, "targets": jnp.roll(inputs, -1, axis=1)}

    def train_step(state, batch, learning_rate_fn, pad_id=0):
        inputs, positions, targets = batch["inputs"], batch["inputs_position"], batch["targets"]
        weights = jnp.where(inputs > pad_id, 1, 0).astype(jnp.float32)
        attention_mask = causal_attention_mask(inputs > pad_id)

        def loss_fn(params):
            logits = nnx.merge(state.graphdef, params)(inputs, positions, attention_mask)
            loss, weight_sum = weighted_cross_entropy(logits, targets, weights)
            return loss / weight_sum, logits

        (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        metrics = lm_metrics(logits, targets, weights)
        metrics["learning_rate"] = learning_rate_fn(state.step)
        return state.apply_gradients(grads=grads), metrics

    step = functools.partial(train_step, learning_rate_fn=optax.constant_schedule(1e-3))
    step.__name__ = "train_step"
    return step, state, data


# --- Alpa's pipeline MLP test (tests/pipeline_parallel of alpa-projects/alpa) --------------------------

class PipelineMLP(nn.Module):
    """Four dense layers with a pipeline boundary after the second."""

    hidden_dim: int
    output_dim: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden_dim)(x)
        x = nn.relu(x)
        x = nn.Dense(self.hidden_dim)(x)
        x = mark_pipeline_boundary(x)
        x = nn.Dense(self.hidden_dim)(x)
        return nn.Dense(self.output_dim)(x)


def alpa_mlp_program(batch_size=64, hidden_dim=16):
    """(step, state, batch): Alpa's run_mlp: the MLP with adam, the step returning its new state and
    the first gradient leaf."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (batch_size, hidden_dim), jnp.float32)
    y = jax.random.normal(jax.random.PRNGKey(1), (batch_size, hidden_dim), jnp.float32)
    model = PipelineMLP(hidden_dim=hidden_dim, output_dim=hidden_dim)
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(key, x), tx=optax.adam(1e-2))

    def train_step(state, batch):
        def loss_func(params):
            out = state.apply_fn(params, batch["x"])
            return jnp.mean((out - batch["y"]) ** 2)

        grads = jax.grad(loss_func)(state.params)
        return state.apply_gradients(grads=grads), jax.tree_util.tree_leaves(grads)[0]

    return train_step, state, {"x": x, "y": y}
