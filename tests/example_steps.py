"""Train and eval steps in the form the authors of Flax's examples (lm1b, linen; gemma, nnx) and of
Hugging Face's Flax example scripts (run_summarization_flax.py, run_clm_flax.py,
run_mlm_flax.py) write them, on tiny models with random weights (test data, written here from
reading those scripts; the cross-device reductions of their pmapped versions are left out, as a
one-device step has none). Each `*_program()` returns `(step, state, extra_args, batch)`: the
step is called as `step(state, batch, *extra_args)` and returns `(new_state, metrics)` or, for
run_mlm, `(new_state, metrics, new_dropout_rng)`.

What these forms exercise under micro-batching: constants before the gradient (`jnp.where(x >
0, 1, 0)`, `inputs > pad_id`, `fold_in(rng, state.step)`), losses that are weighted means over
non-padding tokens (lm1b, gemma) or sums divided after the gradient by an int32 token count that
the metrics return (summarization, MLM), dropout from a key split or folded per step, per-example logits
returned as aux values and metrics computed from them after the gradient.
"""

from __future__ import annotations

import warnings
from typing import Any

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import common_utils, train_state

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # transformers warns that its Flax models are deprecated
    from transformers import (
        BartConfig,
        BertConfig,
        FlaxBartForConditionalGeneration,
        FlaxBertForMaskedLM,
        FlaxGPT2LMHeadModel,
        GPT2Config,
    )

VOCAB, BATCH, LENGTH = 64, 8, 8


def token_batch(seed: int = 5, pad_tail: bool = True) -> np.ndarray:
    """Token ids with a padded (0) tail of random length per row, as packed-free lm1b batches have."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
    if pad_tail:
        for row, keep in enumerate(rng.integers(2, LENGTH + 1, size=BATCH)):
            ids[row, keep:] = 0
    return ids


# --- Flax lm1b (linen): a decoder-only Transformer with dropout and sinusoidal positions ---------------

def sinusoidal(length: int, dim: int) -> np.ndarray:
    position = np.arange(length)[:, None]
    scale = np.exp(-np.log(10000.0) * np.arange(0, dim, 2) / dim)
    table = np.zeros((length, dim), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(position * scale), np.cos(position * scale)
    return table


class LinenBlock(nn.Module):
    dim: int
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout,
                                            deterministic=False)(h, h, mask=mask)
        x = x + nn.Dropout(self.dropout, deterministic=False)(h)
        h = nn.Dense(2 * self.dim)(nn.LayerNorm()(x))
        h = nn.Dense(self.dim)(nn.relu(h))
        return x + nn.Dropout(self.dropout, deterministic=False)(h)


class LinenLM(nn.Module):
    """lm1b's TransformerLM in miniature: shift right, embed (shared with the logits), blocks."""

    dim: int = 32
    heads: int = 4
    depth: int = 1
    dropout: float = 0.1

    @nn.compact
    def __call__(self, inputs):
        embed = nn.Embed(VOCAB, self.dim)
        x = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]  # shift right: predict token t from tokens < t
        mask = nn.combine_masks(nn.make_attention_mask(x > 0, x > 0), nn.make_causal_mask(x))
        h = embed(x) + sinusoidal(inputs.shape[1], self.dim)[None]
        h = nn.Dropout(self.dropout, deterministic=False)(h)
        for _ in range(self.depth):
            h = LinenBlock(self.dim, self.heads, self.dropout)(h, mask)
        return embed.attend(nn.LayerNorm()(h))


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """As lm1b/wmt/gemma's train.py: (sum of the smoothed cross-entropy, normalizing factor)."""
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(confidence * jnp.log(confidence)
                             + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
    soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence, off_value=low_confidence)
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits, targets, weights=None):
    loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor = np.prod(logits.shape[:-1])
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    acc, _ = compute_weighted_accuracy(logits, labels, weights)
    return {"loss": loss, "accuracy": acc, "denominator": weight_sum}


def lm1b_program(optimizer=None):
    model = LinenLM()
    inputs = token_batch()
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, inputs)["params"]
    learning_rate_fn = optax.linear_schedule(1e-2, 1e-3, 10)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optimizer or optax.adamw(learning_rate_fn, weight_decay=0.1))

    def train_step(state, batch, dropout_rng, label_smoothing=0.1):
        inputs = batch["inputs"]
        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        dropout_rng = jax.random.fold_in(dropout_rng, state.step)

        def loss_fn(params):
            logits = model.apply({"params": params}, inputs, rngs={"dropout": dropout_rng})
            loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, label_smoothing)
            mean_loss = loss / weight_sum
            return mean_loss, logits

        step = state.step
        lr = learning_rate_fn(step)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, logits), grads = grad_fn(state.params)
        new_state = state.apply_gradients(grads=grads)
        metrics = compute_metrics(logits, inputs, weights)
        metrics["learning_rate"] = lr
        return new_state, metrics

    return train_step, state, (jax.random.key(2),), {"inputs": inputs}


# --- Flax gemma (nnx): rotary attention, the model split into graphdef and params --------------------

def rotary(x, positions, base=10_000):
    half = x.shape[-1] // 2
    freq = positions[..., None] / base ** (jnp.arange(half) / half)
    sin, cos = jnp.sin(freq)[..., None, :], jnp.cos(freq)[..., None, :]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class GemmaBlock(nnx.Module):
    def __init__(self, dim, heads, rngs):
        self.heads = heads
        self.pre_attention_norm, self.pre_ffw_norm = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.gate, self.up = nnx.Linear(dim, 2 * dim, rngs=rngs), nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, x, positions, attention_mask):
        batch, length, dim = x.shape
        q, k, v = jnp.split(self.qkv(self.pre_attention_norm(x)).reshape(batch, length, self.heads, -1), 3, -1)
        q, k = rotary(q, positions), rotary(k, positions)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
        logits = jnp.where(attention_mask[:, None], logits, -1e9)
        h = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v).reshape(batch, length, dim)
        x = x + self.out(h)
        h = self.pre_ffw_norm(x)
        return x + self.down(nnx.gelu(self.gate(h)) * self.up(h))


class GemmaLM(nnx.Module):
    def __init__(self, dim=32, heads=4, depth=1, rngs=None):
        self.embedder = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.blocks = nnx.List([GemmaBlock(dim, heads, rngs) for _ in range(depth)])
        self.final_norm = nnx.RMSNorm(dim, rngs=rngs)

    def __call__(self, inputs, positions, attention_mask):
        x = self.embedder(inputs) * np.sqrt(self.embedder.features)
        for block in self.blocks:
            x = block(x, positions, attention_mask)
        return self.embedder.attend(self.final_norm(x)), None  # (logits, cache) as gemma's Transformer


class NnxTrainState(train_state.TrainState):
    graphdef: Any = struct.field(pytree_node=False)


def make_causal_attn_mask(input_mask):
    causal = jnp.tril(jnp.ones((input_mask.shape[-1],) * 2, dtype=jnp.bool_))
    return input_mask[..., None, :] & causal[None]


def gemma_program(optimizer=None):
    graphdef, params = nnx.split(GemmaLM(rngs=nnx.Rngs(0)), nnx.Param)
    learning_rate_fn = optax.constant_schedule(3e-3)
    state = NnxTrainState.create(apply_fn=None, graphdef=graphdef, params=params,
                                 tx=optimizer or optax.adamw(learning_rate_fn))
    ids = token_batch(seed=7)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:],
             "inputs_position": np.tile(np.arange(LENGTH - 1, dtype=np.int32), (BATCH, 1)),
             "inputs_segmentation": (ids[:, :-1] > 0).astype(np.int32)}

    def train_step(state, batch, label_smoothing=0.0):
        train_keys = ["inputs", "inputs_position", "inputs_segmentation", "targets"]
        inputs, inputs_positions, inputs_segmentation, targets = (batch.get(k, None) for k in train_keys)
        pad_id = 0
        weights = jnp.where(inputs > pad_id, 1, 0).astype(jnp.float32)
        input_mask = inputs > pad_id
        attention_mask = make_causal_attn_mask(input_mask)
        mask = inputs_segmentation[:, :, None] == inputs_segmentation[:, None, :]
        attention_mask = jnp.logical_and(mask, attention_mask)

        def loss_fn(params):
            module = nnx.merge(state.graphdef, params)
            logits, _ = module(inputs, positions=inputs_positions, attention_mask=attention_mask)
            loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
            mean_loss = loss / weight_sum
            return mean_loss, logits

        step = state.step
        lr = learning_rate_fn(step)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, logits), grads = grad_fn(state.params)
        new_state = state.apply_gradients(grads=grads)
        metrics = compute_metrics(logits, targets, weights)
        metrics["learning_rate"] = lr
        return new_state, metrics

    return train_step, state, (), batch


# --- Hugging Face run_summarization_flax.py: a summed loss and an int32 token count -----------------
# The script trains BART or T5 alike; T5 is not used here because transformers 4.46's Flax T5 calls
# jnp.clip(a_max=...), which JAX 0.10 removed.

class DropoutTrainState(train_state.TrainState):
    dropout_rng: jnp.ndarray


def hf_state(model, optimizer, seed=0):
    return DropoutTrainState.create(apply_fn=model.__call__, params=model.params, tx=optimizer,
                                    dropout_rng=jax.random.PRNGKey(seed))


def summarization_program(optimizer=None):
    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=LENGTH, dropout=0.1, attention_dropout=0.1, pad_token_id=0,
                        decoder_start_token_id=0)
    model = FlaxBartForConditionalGeneration(config, seed=0)
    linear_decay_lr_schedule_fn = optax.linear_schedule(1e-3, 0.0, 10)
    state = hf_state(model, optimizer or optax.adamw(linear_decay_lr_schedule_fn, weight_decay=0.01))
    labels = token_batch(seed=11)
    batch = {"input_ids": token_batch(seed=12), "attention_mask": (token_batch(seed=12) > 0).astype(np.int32),
             "decoder_input_ids": np.pad(labels, ((0, 0), (1, 0)))[:, :-1],
             "decoder_attention_mask": (labels > 0).astype(np.int32), "labels": labels}

    def loss_fn(logits, labels, padding_mask, label_smoothing_factor=0.0):
        vocab_size = logits.shape[-1]
        confidence = 1.0 - label_smoothing_factor
        low_confidence = (1.0 - confidence) / (vocab_size - 1)
        normalizing_constant = -(confidence * jnp.log(confidence)
                                 + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
        soft_labels = common_utils.onehot(labels, vocab_size, on_value=confidence, off_value=low_confidence)
        loss = optax.softmax_cross_entropy(logits, soft_labels)
        loss = loss - normalizing_constant
        loss = loss * padding_mask  # ignore padded tokens from loss
        loss = loss.sum()
        num_labels = padding_mask.sum()
        return loss, num_labels

    def train_step(state, batch, label_smoothing_factor=0.1):
        dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

        def compute_loss(params):
            labels = batch.pop("labels")
            logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng, train=True)[0]
            loss, num_labels = loss_fn(logits, labels, batch["decoder_attention_mask"], label_smoothing_factor)
            return loss, num_labels

        grad_fn = jax.value_and_grad(compute_loss, has_aux=True)
        (loss, num_labels), grad = grad_fn(state.params)
        loss = jax.tree_util.tree_map(lambda x: x / num_labels, loss)  # true loss = total loss / total samples
        grad = jax.tree_util.tree_map(lambda x: x / num_labels, grad)  # true grad = total grad / total samples
        new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
        metrics = {"loss": loss, "learning_rate": linear_decay_lr_schedule_fn(state.step), "num_labels": num_labels}
        return new_state, metrics

    def eval_step(params, batch, label_smoothing_factor=0.1):
        labels = batch.pop("labels")
        logits = model(**batch, params=params, train=False)[0]
        loss, num_labels = loss_fn(logits, labels, batch["decoder_attention_mask"], label_smoothing_factor)
        return {"loss": loss / num_labels, "num_labels": num_labels, "logits": logits}

    return train_step, state, (), batch, eval_step


# --- Hugging Face run_clm_flax.py: GPT-2 with dropout, a mean loss over shifted tokens ---------------

def clm_program(optimizer=None):
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1)
    model = FlaxGPT2LMHeadModel(config, seed=0)
    linear_decay_lr_schedule_fn = optax.linear_schedule(1e-3, 0.0, 10)
    state = hf_state(model, optimizer or optax.adamw(linear_decay_lr_schedule_fn, weight_decay=0.01))
    ids = token_batch(seed=13, pad_tail=False)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids.copy()}

    def loss_fn(logits, labels):
        shift_logits = logits[..., :-1, :]
        shift_labels = labels[..., 1:]
        loss = optax.softmax_cross_entropy(shift_logits, common_utils.onehot(shift_labels, shift_logits.shape[-1]))
        return loss.mean()

    def train_step(state, batch):
        dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

        def compute_loss(params):
            labels = batch.pop("labels")
            logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng, train=True)[0]
            loss = loss_fn(logits, labels)
            return loss

        grad_fn = jax.value_and_grad(compute_loss)
        loss, grad = grad_fn(state.params)
        new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
        metrics = {"loss": loss, "learning_rate": linear_decay_lr_schedule_fn(state.step)}
        return new_state, metrics

    return train_step, state, (), batch


# --- Hugging Face run_mlm_flax.py: BERT with dropout, a summed masked loss divided by the label count --

def mlm_program(optimizer=None):
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=LENGTH, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    model = FlaxBertForMaskedLM(config, seed=0)
    linear_decay_lr_schedule_fn = optax.linear_schedule(1e-3, 0.0, 10)
    state = train_state.TrainState.create(apply_fn=model.__call__, params=model.params,
                                          tx=optimizer or optax.adamw(linear_decay_lr_schedule_fn))
    ids = token_batch(seed=17, pad_tail=False)
    masked = np.random.default_rng(3).random(ids.shape) < 0.3
    batch = {"input_ids": np.where(masked, 1, ids).astype(np.int32), "attention_mask": np.ones_like(ids),
             "token_type_ids": np.zeros_like(ids), "labels": np.where(masked, ids, 0).astype(np.int32)}

    def train_step(state, batch, dropout_rng):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

        def loss_fn(params):
            labels = batch.pop("labels")
            logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng, train=True)[0]
            label_mask = jnp.where(labels > 0, 1.0, 0.0)  # compute loss, ignore padded input tokens
            loss = optax.softmax_cross_entropy(logits, common_utils.onehot(labels, logits.shape[-1])) * label_mask
            loss = loss.sum()  # take average
            num_labels = label_mask.sum()
            return loss, num_labels

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, num_labels), grad = grad_fn(state.params)
        loss = jax.tree_util.tree_map(lambda x: x / num_labels, loss)  # true loss = total loss / total samples
        grad = jax.tree_util.tree_map(lambda x: x / num_labels, grad)  # true grad = total grad / total samples
        new_state = state.apply_gradients(grads=grad)
        metrics = {"loss": loss, "learning_rate": linear_decay_lr_schedule_fn(state.step)}
        return new_state, metrics, new_dropout_rng

    return train_step, state, (jax.random.PRNGKey(4),), batch
