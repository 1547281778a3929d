"""Capture rules for random numbers: `random_bits` (what dropout and sampling draw), the key
primitives (`random_seed`, `random_split`, `random_fold_in`, `random_wrap`, `random_unwrap`),
`rng_bit_generator` and `threefry2x32`.

With JAX's partitionable threefry (`jax_threefry_partitionable`, the default since JAX 0.5)
the bits at each position depend on the key and the position only, so `random_bits` may be
split any way and every device draws just its part: the sharded run draws the same numbers as
one device. Everything else here is planned replicated: keys are tiny, and the values of
`rng_bit_generator` and of a hand-rolled threefry depend on how their counters are laid out.
"""

from __future__ import annotations

import jax

from meshplan.capture.flatten import Step
from meshplan.capture.rules import ir_dtype, register
from meshplan.ir import GraphBuilder

_KEY_OPS = ("random_seed", "random_split", "random_fold_in", "random_wrap", "random_unwrap", "random_clone",
            "rng_bit_generator", "threefry2x32")


@register("random_bits")
def _random_bits(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.random(xs, step.avals[0].shape, ir_dtype(step.avals[0].dtype), "random_bits", _partitionable())]


@register(*_KEY_OPS)
def _key_op(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.random(xs, aval.shape, ir_dtype(aval.dtype), step.name, output=k) for k, aval in enumerate(step.avals)]


def _partitionable() -> bool:
    return bool(jax.config.jax_threefry_partitionable) and jax.config.jax_default_prng_impl == "threefry2x32"
