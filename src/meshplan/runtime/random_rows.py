"""Random draws along the batch, micro-batch by micro-batch: the rows the full batch's draw would give.

A step that draws random values over an activation's shape (a dropout mask: `random_bits` with
the shape of `[batch, seq, features]`) draws other values when traced one micro-batch long. To
train like one device, micro-batch m must see rows m of the full draw. JAX's default generator
(threefry, partitionable since JAX 0.5) makes every value a function of the key and of the
value's flat index in the full shape only, so micro-batch m computes exactly its rows: counters
of the full shape, sliced to its rows, through threefry (the cost of a micro-batch-sized draw;
drawing the full shape and slicing it costs the full draw in every micro-batch, measured 7x on
CPU, since XLA does not push the slice into the generator). Other generators, key splits and
draws whose key is not a single key take that slower, always exact path.

The counter path copies how `jax.random` turns threefry outputs into bits
(`_threefry_random_bits_partitionable`); a self-check against `jax.random.bits` on the first use
per bit width sends any JAX version where that differs to the exact slow path.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # private in JAX 0.10; without it every draw takes the slow path
    from jax._src.random.prng import iota_2x32_shape
except ImportError:  # pragma: no cover
    iota_2x32_shape = None
from jax.extend.random import threefry2x32_p

RANDOM_DRAWS = ("random_bits", "random_split")  # primitives that draw values of a `shape` param


def counter_based(eqn: Any) -> bool:
    """Whether `eqn`'s draw can compute just a micro-batch's rows (else it draws the full shape).

    Call outside any trace: the first call per bit width runs the self-check."""
    key = eqn.invars[0].aval
    if eqn.primitive.name != "random_bits" or iota_2x32_shape is None or key.shape != ():
        return False
    if not (jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.dtype._impl.name == "threefry2x32"):
        return False
    return bool(jax.config.jax_threefry_partitionable) and _counters_match_jax(eqn.params["bit_width"])


def draw_rows(eqn: Any, key: Any, full_shape: tuple[int, ...], dim: int, start: Any, counters: bool) -> Any:
    """Rows `start : start + n` along `dim` of `eqn`'s draw at `full_shape` (n: its own size there).

    Args:
        eqn: a `random_bits` or `random_split` equation traced at micro-batch shapes.
        key: its key operand.
        full_shape: the `shape` param at full-batch shapes.
        dim: the dim of `shape` that carries the batch.
        start: the first row of this micro-batch (a traced int32).
        counters: `counter_based(eqn)`: compute only these rows.
    """
    rows = tuple(eqn.params["shape"])[dim]
    if counters:
        return _threefry_rows(key, eqn.params["bit_width"], tuple(full_shape), dim, start, rows)
    params = {**eqn.primitive.get_bind_params(eqn.params), "shape": tuple(full_shape)}
    full = eqn.primitive.bind(key, **params)
    return lax.dynamic_slice_in_dim(full, start, rows, axis=np.ndim(key) + dim)


_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _threefry_rows(key: Any, bit_width: int, full_shape: tuple[int, ...], dim: int, start: Any, rows: int) -> Any:
    hi, lo = iota_2x32_shape(full_shape)
    starts = [0] * len(full_shape)
    starts[dim] = start
    sizes = list(full_shape)
    sizes[dim] = rows
    hi, lo = (lax.dynamic_slice(c, starts, sizes) for c in (hi, lo))
    data = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(data[0], data[1], hi, lo)
    dtype = _UINT[bit_width]
    if bit_width == 64:
        return lax.shift_left(bits1.astype(dtype), jnp.asarray(32, dtype)) | bits2.astype(dtype)
    bits = bits1 ^ bits2
    return bits if bit_width == 32 else bits.astype(dtype)


@functools.cache
def _counters_match_jax(bit_width: int) -> bool:
    """Whether the counter path gives `jax.random.bits`' rows on this JAX (checked once per width)."""
    if bit_width not in _UINT or (bit_width == 64 and not jax.config.jax_enable_x64):
        return False
    with jax.ensure_compile_time_eval():
        key = jax.random.key(1234)
        full = jax.random.bits(key, (6, 3, 5), _UINT[bit_width])
        rows = jax.jit(_threefry_rows, static_argnums=(1, 2, 3, 5))(key, bit_width, (6, 3, 5), 1, 1, 2)
        return bool(jnp.array_equal(rows, full[:, 1:3]))
