"""Flax linen models shaped like the ones Alpa's own tests train (test data, written here): an
n-layer ReLU MLP, a stack of BERT layers with one combined query/key/value kernel (optionally
rematerialised with `nn.remat`) and a GShard-style mixture-of-experts layer. Each comes with a
`TrainState` step `step(state, batch) -> state` as Alpa's tests write it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState


class MLP(nn.Module):
    layers: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers - 1):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.hidden)(x)


class SelfAttention(nn.Module):
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x, mask):
        b, s, h = x.shape
        # heads major, as Megatron lays out the combined kernel: a column split keeps whole heads
        qkv = nn.Dense(3 * h, name="qkv_combined")(x).reshape(b, s, self.heads, 3, h // self.heads)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (h // self.heads) ** 0.5
        scores = jnp.where(mask[:, None, None, :] > 0, scores, -1e9)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, h)
        return nn.LayerNorm()(x + nn.Dense(h, name="output")(attn))


class BertLayer(nn.Module):
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x, mask):
        x = SelfAttention(self.hidden, self.heads, name="attention")(x, mask)
        y = nn.Dense(self.hidden, name="output")(nn.gelu(nn.Dense(4 * self.hidden, name="intermediate")(x)))
        return nn.LayerNorm()(x + y)


class BertLayers(nn.Module):
    layers: int
    hidden: int
    heads: int
    remat: bool = False

    @nn.compact
    def __call__(self, x, mask):
        layer = nn.remat(BertLayer) if self.remat else BertLayer
        for i in range(self.layers):
            x = layer(self.hidden, self.heads, name=str(i))(x, mask)
        return x


class MoE(nn.Module):
    """Top-1 routing of token groups to experts with a fixed capacity (GShard's dispatch and
    combine einsums); expert weights are [experts, ...] tensors."""

    hidden: int
    experts: int
    group_size: int
    capacity: int

    @nn.compact
    def __call__(self, x):
        b, s, m = x.shape
        groups = x.reshape(b * s // self.group_size, self.group_size, m)
        probs = jax.nn.softmax(nn.Dense(self.experts, use_bias=False, name="wg")(groups), axis=-1)
        chosen = jax.nn.one_hot(jnp.argmax(probs, axis=-1), self.experts)  # [g, s, e]
        position = jnp.cumsum(chosen, axis=1) * chosen - 1.0  # slot of each token in its expert
        dispatch = jax.nn.one_hot(position, self.capacity) * chosen[..., None]  # [g, s, e, c]
        combine = dispatch * jnp.sum(probs * chosen, axis=-1)[..., None, None]
        init = nn.initializers.normal(m ** -0.5)
        wi = self.param("wi", init, (self.experts, m, 4 * m))
        wo = self.param("wo", init, (self.experts, 4 * m, m))
        routed = jnp.einsum("gsec,gsm->egcm", dispatch, groups)
        out = jnp.einsum("egch,ehm->egcm", jax.nn.relu(jnp.einsum("egcm,emh->egch", routed, wi)), wo)
        return jnp.einsum("gsec,egcm->gsm", combine, out).reshape(b, s, m)


class MoELayer(nn.Module):
    hidden: int
    heads: int
    experts: int
    group_size: int
    capacity: int

    @nn.compact
    def __call__(self, x, mask):
        x = SelfAttention(self.hidden, self.heads, name="attention")(x, mask)
        return nn.LayerNorm()(x + MoE(self.hidden, self.experts, self.group_size, self.capacity, name="moe")(x))


def train_state(model: nn.Module, *example, optimizer=None) -> TrainState:
    params = jax.jit(model.init)(jax.random.PRNGKey(0), *example)  # one compile, not one per initializer
    return TrainState.create(apply_fn=model.apply, params=params, tx=optimizer or optax.adam(1e-2))


def mse_step(state: TrainState, batch: dict) -> TrainState:
    """Alpa's tests' step: mean squared error of the model on batch["inputs"], one optimizer step."""
    return mse_step_with_loss(state, batch)[0]


def mse_step_with_loss(state: TrainState, batch: dict) -> tuple[TrainState, jax.Array]:
    """`mse_step` that also returns the loss."""
    def loss(params):
        return jnp.mean((state.apply_fn(params, *batch["inputs"]) - batch["label"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value


def mlp_program(layers=4, batch=64, hidden=32, optimizer=None):
    x = jax.random.normal(jax.random.key(1), (batch, hidden))
    y = jax.random.normal(jax.random.key(2), (batch, hidden))
    return mse_step, train_state(MLP(layers, hidden), x, optimizer=optimizer), {"inputs": (x,), "label": y}


def _tokens(batch, seq, hidden):
    x = jax.random.normal(jax.random.key(1), (batch, seq, hidden))
    mask = jnp.ones((batch, seq), jnp.int32).at[:, -2:].set(0)
    return x, mask, jax.random.normal(jax.random.key(2), (batch, seq, hidden))


def bert_program(layers=2, batch=16, seq=8, hidden=32, heads=8, remat=False, optimizer=None):
    x, mask, y = _tokens(batch, seq, hidden)
    state = train_state(BertLayers(layers, hidden, heads, remat), x, mask, optimizer=optimizer)
    return mse_step, state, {"inputs": (x, mask), "label": y}


def moe_program(batch=16, seq=8, hidden=32, heads=8, experts=8, group_size=16, capacity=4, optimizer=None):
    x, mask, y = _tokens(batch, seq, hidden)
    state = train_state(MoELayer(hidden, heads, experts, group_size, capacity), x, mask, optimizer=optimizer)
    return mse_step, state, {"inputs": (x, mask), "label": y}
