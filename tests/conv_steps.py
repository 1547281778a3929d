"""Convolutional train steps in the form Flax's examples write them, on tiny configurations
(test data, written here from reading flax/examples/imagenet and flax/examples/mnist; the
pmapped ImageNet step's cross-device means are left out, as a one-device step has none).

Each `*_program()` returns `(step, state, extra_args, batch)`; the step is called as
`step(state, batch, *extra_args)` and returns `(new_state, metrics)`.

- ResNet (imagenet/models.py, train.py): convolutions without bias, BatchNorm in training mode
  with mutable `batch_stats` (momentum 0.9), a 7x7 stride-2 stem, 3x3 stride-2 max pooling,
  residual blocks with 1x1 projections, a global mean, cross-entropy on one-hot labels plus an
  L2 weight penalty, SGD with Nesterov momentum on a cosine schedule.
- CNN (mnist/train.py): two 3x3 convolutions with 2x2 average pooling, two dense layers,
  cross-entropy, SGD with momentum; the gradient and the update as the example's two functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import common_utils, train_state

NUM_CLASSES, BATCH = 10, 8
ModuleDef = Any


class ResNetBlock(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class ResNetTrainState(train_state.TrainState):
    batch_stats: Any


def cross_entropy_loss(logits, labels):
    one_hot_labels = common_utils.onehot(labels, num_classes=NUM_CLASSES)
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels))


def compute_metrics(logits, labels):
    return {"loss": cross_entropy_loss(logits, labels), "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def resnet_train_step(state, batch, learning_rate_fn):
    def loss_fn(params):
        logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                 batch["image"], mutable=["batch_stats"])
        loss = cross_entropy_loss(logits, batch["label"])
        weight_l2 = sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1)
        loss = loss + 0.0001 * 0.5 * weight_l2
        return loss, (new_model_state, logits)

    lr = learning_rate_fn(state.step)
    aux, grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = lr
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def image_batch(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image": rng.standard_normal((BATCH, *shape)).astype(np.float32),
            "label": rng.integers(0, NUM_CLASSES, size=BATCH).astype(np.int32)}


def numpy_init(model: nn.Module, images: np.ndarray, seed: int, **kwargs) -> dict[str, Any]:
    """The model's variables with NumPy random values (compiling Flax's initializers for a ResNet
    takes ~40 s on a loaded 2-core machine; the test needs random weights, not those): kernels
    N(0, 1/fan_in), biases and BatchNorm offsets N(0, 0.1), scales 1 + N(0, 0.1); running
    statistics as Flax starts them (means 0, variances 1)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(model.init, **kwargs), jax.random.PRNGKey(0), images)

    def value(path, leaf):
        name = jax.tree_util.keystr(path)
        if "batch_stats" in name:
            return np.full(leaf.shape, 1.0 if "var" in name else 0.0, np.float32)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if name.endswith("['kernel']"):
            return noise / np.sqrt(np.prod(leaf.shape[:-1]))
        return 0.1 * noise + (1.0 if name.endswith("['scale']") else 0.0)

    return jax.tree_util.tree_map_with_path(value, shapes)


def resnet_program(stage_sizes=(1, 1), num_filters=4, image=16):
    """A ResNet-18-style model (basic blocks) with `stage_sizes` blocks of `num_filters`·2^i channels."""
    model = ResNet(stage_sizes=stage_sizes, block_cls=ResNetBlock, num_classes=NUM_CLASSES,
                   num_filters=num_filters)
    batch = image_batch((image, image, 3), seed=3)
    variables = numpy_init(model, batch["image"], seed=0, train=False)
    learning_rate_fn = optax.cosine_decay_schedule(0.1, decay_steps=10)
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=0.9, nesterov=True)
    state = ResNetTrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                    batch_stats=variables["batch_stats"])
    return functools.partial(resnet_train_step, learning_rate_fn=learning_rate_fn), state, (), batch


class CNN(nn.Module):
    """flax/examples/mnist's CNN, its widths as fields (32, 64, 256 there)."""

    features: tuple[int, int, int] = (32, 64, 256)

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=self.features[0], kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=self.features[1], kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=self.features[2])(x)
        x = nn.relu(x)
        return nn.Dense(features=NUM_CLASSES)(x)


def apply_model(state, images, labels):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, NUM_CLASSES)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return grads, loss, accuracy


def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def mnist_train_step(state, batch):
    """One iteration of the example's train_epoch loop."""
    grads, loss, accuracy = apply_model(state, batch["image"], batch["label"])
    return update_model(state, grads), {"loss": loss, "accuracy": accuracy}


def mnist_program(features=(4, 8, 16), image=16):
    model = CNN(features=features)
    batch = image_batch((image, image, 1), seed=4)
    params = numpy_init(model, batch["image"], seed=1)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1, 0.9))
    return mnist_train_step, state, (), batch
