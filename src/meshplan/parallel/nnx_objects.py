"""Flax nnx objects as arguments of a parallelized step: traced as their state, updated in place.

An nnx module, optimizer, metric or `Rngs` is a mutable Python object (a graph node), and an nnx
step changes it in place (`optimizer.update(model, grads)`, `metrics.update(...)`) and may return
nothing. A trace can take only arrays, so, as `nnx.jit` does, every such object among the
arguments is split into a graph definition and its state, all of them together so that references
shared between them stay shared (`split_objects`); the state is what is captured, planned and
run. Inside the trace the state is merged back into fresh objects that the step mutates
(`merge_objects`); after the step they are split again (`states_of`), the new state becomes a
result of the parallelized program, and `write_back` puts it into the caller's objects.

A Variable passed on its own is an object too (`counter[...] += 1` in the step counts); an
`nnx.State` (the functional API: `params = nnx.state(model)`) is a pytree of arrays and stays an
ordinary argument, Variables in it included.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import jax

from meshplan.errors import OptionsError


@dataclass(frozen=True, slots=True)
class ObjectState:
    """Where an nnx object was among the arguments: its state (None when it is a second reference
    to an object met before), and the graph definition of all the call's objects."""

    graphdef: Any
    index: int
    state: Any


jax.tree_util.register_pytree_with_keys(
    ObjectState,
    lambda o: (((jax.tree_util.GetAttrKey("state"), o.state),), (o.graphdef, o.index)),
    lambda aux, children: ObjectState(aux[0], aux[1], children[0]),
    flatten_func=lambda o: ((o.state,), (o.graphdef, o.index)))


def split_objects(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """`tree` with each nnx object replaced by an ObjectState, and the objects in order."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # nnx was never imported: no argument can be an nnx object
        return tree, ()
    is_object = lambda x: _kind(x, nnx) == "object"  # noqa: E731
    leaves, structure = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: _kind(x, nnx) != "value")
    objects = tuple(leaf for leaf in leaves if is_object(leaf))
    if not objects:
        return tree, ()
    graphdef, state = nnx.split(objects)
    held = iter(ObjectState(graphdef, k, state.get(k)) for k in range(len(objects)))  # state None: a repeat
    leaves = [next(held) if is_object(leaf) else leaf for leaf in leaves]
    return jax.tree_util.tree_unflatten(structure, leaves), objects


def merge_objects(tree: Any) -> tuple[Any, tuple[Any, ...], Any]:
    """`tree` with each ObjectState replaced by a fresh nnx object holding that state, the fresh
    objects and their graph definition (the inverse of `split_objects`, inside a trace)."""
    is_state = lambda x: isinstance(x, ObjectState)  # noqa: E731
    leaves, structure = jax.tree_util.tree_flatten(tree, is_leaf=is_state)
    held = [leaf for leaf in leaves if is_state(leaf)]
    if not held:
        return tree, (), None
    nnx = sys.modules["flax.nnx"]
    graphdef = held[0].graphdef
    objects = nnx.merge(graphdef, nnx.State({o.index: o.state for o in held if o.state is not None}))
    leaves = [objects[leaf.index] if is_state(leaf) else leaf for leaf in leaves]
    return jax.tree_util.tree_unflatten(structure, leaves), objects, graphdef


def states_of(objects: tuple[Any, ...], graphdef: Any, name: str) -> tuple[Any, ...]:
    """The state of each object after the step, in the order `split_objects` gave them.

    Raises:
        OptionsError: the step changed the objects' structure or static attributes.
    """
    nnx = sys.modules["flax.nnx"]
    new_graphdef, state = nnx.split(objects)
    if new_graphdef != graphdef:
        raise OptionsError(
            f"{name} changes the structure of the nnx objects passed to it (adds or removes a Variable or "
            f"submodule, or sets a static attribute such as model.train()/model.eval()); a parallelized step "
            f"updates its objects' values in place only: make such changes outside the step, before calling it")
    return tuple(state.get(i) for i in range(len(objects)))


def write_back(objects: tuple[Any, ...], states: tuple[Any, ...]) -> None:
    """Put the new states into the caller's objects (their Variables now hold the results)."""
    nnx = sys.modules["flax.nnx"]
    nnx.update(objects, nnx.State({i: s for i, s in enumerate(states) if s is not None}))


def check_no_objects(tree: Any, what: str, name: str) -> None:
    """Raise if `tree` (a step's results) holds an nnx object (a Variable is a value there): it would
    come back as a copy that no caller reference points to."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    is_object = lambda x: _kind(x, nnx) == "object" and not isinstance(x, nnx.Variable)  # noqa: E731
    found = [jax.tree_util.keystr(path) for path, leaf in
             jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_object)[0] if is_object(leaf)]
    if found:
        raise OptionsError(
            f"{name} returns nnx object(s) at {what}{', '.join(found)}; a parallelized step updates the nnx objects "
            f"passed to it in place (as nnx.jit does), so return only arrays (e.g. the loss and metrics) and keep "
            f"using the objects you passed")


def has_objects(tree: Any) -> bool:
    """Whether `tree` holds ObjectStates (a call that passed nnx objects)."""
    return any(isinstance(leaf, ObjectState) for leaf in
               jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ObjectState)))


_KIND_OF_TYPE: dict[type, str] = {}  # a memo: nnx.graph.is_graph_node costs ~30 us a value, a call has hundreds


def _kind(x: Any, nnx: Any) -> str:
    """"object" (an nnx graph node: module, optimizer, Rngs, Variable), "state" (an nnx.State) or
    "value". Graph nodes are registered by type, so the answer is kept per type; JAX arrays are
    values (nnx would also count a mutable array ref as a node; those are not supported here)."""
    kind = _KIND_OF_TYPE.get(type(x))
    if kind is None:
        if isinstance(x, nnx.State):
            kind = "state"
        elif isinstance(x, jax.Array) or not nnx.graph.is_graph_node(x):
            kind = "value"
        else:
            kind = "object"
        _KIND_OF_TYPE[type(x)] = kind
    return kind
