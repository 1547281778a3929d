"""The runtime's max pooling gradient split along rows (runtime/halo_pooling.py) on a 2x2 mesh,
rows over one axis and the batch or the channels over the other, equals JAX's on one device,
ties included (integer-valued inputs: the first maximum of a window must win on both), and
compiles to the collective-permutes the rule prices: halo rows of the pooled input in, the
halo rows' sums out, each halo rows x the rest of the device's block."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshplan import GraphBuilder, LogicalMesh
from meshplan.runtime.halo_pooling import halo_select_and_scatter_add, halo_split
from meshplan.runtime.hlo_collectives import hlo_collectives
from meshplan.runtime.sharded import make_jax_mesh, partition_spec
from meshplan.sharding.spec import ShardingSpec


def _gradient_equation(x, window, stride, padding):
    """The select_and_scatter_add equation of a max pooling's gradient, as JAX traces it."""
    def pool(x):
        return jax.lax.reduce_window(x, -np.inf, jax.lax.max, (1, window, window, 1), (1, stride, stride, 1),
                                     padding)
    pooled, vjp = jax.vjp(pool, x)
    jaxpr = jax.make_jaxpr(vjp)(pooled)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "select_and_scatter_add"]
    return eqn, pooled.shape


BATCH_ROWS, ROWS_CHANNELS = ShardingSpec.of(0, 1, None, None), ShardingSpec.of(None, 0, None, 1)


@pytest.mark.parametrize(("window", "stride", "padding", "rows_each_way", "spec"), [
    (3, 2, "SAME", (0, 1), BATCH_ROWS),  # ResNet's pooling: the next row in, the sums on it out
    (3, 1, "SAME", (1, 1), ROWS_CHANNELS),
    (5, 1, ((0, 0), (2, 2), (2, 2), (0, 0)), (2, 2), BATCH_ROWS)], ids=["3s2", "3s1", "5s1"])
def test_split_max_pooling_gradient_equals_one_device(window, stride, padding, rows_each_way, spec):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, (2, 16, 8, 4)).astype(np.float32)  # many ties
    eqn, pooled_shape = _gradient_equation(x, window, stride, padding)
    cotangent = rng.standard_normal(pooled_shape).astype(np.float32)
    b = GraphBuilder("pool")
    node = b.select_and_scatter_add(b.parameter(pooled_shape), b.parameter(x.shape), eqn.params["window_dimensions"],
                                    eqn.params["window_strides"], eqn.params["padding"])
    node = b.build()[node]
    logical = LogicalMesh((2, 2), (1.0, 1.0), (1.0, 1.0))
    split = halo_split(node, pooled_shape, spec, logical.shape)
    assert split is not None and (split.dim, split.halo.left, split.halo.right) == (1, *rows_each_way)
    mesh = make_jax_mesh(logical)
    layout = partition_spec(spec)
    run = jax.jit(halo_select_and_scatter_add(eqn.primitive, eqn.params, split, mesh, layout),
                  in_shardings=(NamedSharding(mesh, layout),) * 2, out_shardings=NamedSharding(mesh, layout))
    want = jax.jit(lambda c, x: eqn.primitive.bind(c, x, **eqn.params))(cotangent, x)
    np.testing.assert_allclose(run(cotangent, x), want, rtol=1e-6, atol=1e-6)
    # a row of a device's block: 8 columns x 4 channels (2 when split) x 2 images (1 when split) x 4 B
    row_bytes = 8 * (2 if spec.dims[3] else 4) * (1 if spec.dims[0] else 2) * 4
    compiled = hlo_collectives(run.lower(cotangent, x).compile().as_text(), logical.shape)
    assert sorted((c.kind, c.axes, sum(c.buffers)) for c in compiled) == sorted(
        ("collective-permute", (split.axis,), n * row_bytes) for n in rows_each_way * 2 if n)
