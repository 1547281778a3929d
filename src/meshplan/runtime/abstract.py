"""Abstract values (shapes and dtypes) of pytrees: plan-cache keys, example arguments, and the
activations that flow through a chain of pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


def dtype_of(x: Any) -> Any:
    """The dtype of an array or of a Python scalar (as JAX would convert it)."""
    return x.dtype if hasattr(x, "dtype") else jax.numpy.asarray(x).dtype


def shapes_of(tree: Any) -> Any:
    """`tree` with every leaf replaced by its ShapeDtypeStruct."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), dtype_of(a)), tree)


def signature(args: Any) -> Any:
    """A hashable key of the pytree structure, shapes and dtypes of `args`."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(np.shape(a)), str(dtype_of(a))) for a in leaves)


def chain_inputs(fns: Sequence[Callable[..., Any]], params: Sequence[Any], x: Any) -> list[Any]:
    """ShapeDtypeStructs of each function's input when `fns[k](params[k], act)` are chained from
    `x` (the last function's output is not computed: it also takes the targets)."""
    acts = [shapes_of(x)]
    for fn, p in zip(fns[:-1], params[:-1], strict=False):
        acts.append(jax.eval_shape(fn, shapes_of(p), acts[-1]))
    return acts
