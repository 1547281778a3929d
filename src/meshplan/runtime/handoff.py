"""Hand-offs between the devices of pipeline stages, in one process or across the processes of a
multi-controller job (jax.distributed).

In one process a hand-off is `jax.device_put`. Across processes `device_put` cannot move an array
between disjoint device sets on CPU or GPU in JAX 0.10 (only TPU runtimes, or a DCN socket flag), so
a hand-off is one jitted program over the union of the two device sets: a `shard_map` whose
`ppermute`s send each destination device its data from a source device, through XLA's own
collectives (gloo on CPU, NCCL on GPUs). Every process of a job walks the same hand-offs in the same
order: the processes that own source or destination devices run the program, the others only
record where the result lives (an array with no shards here, `absent`). Two layouts:

- same shards: source and destination split the value alike over as many devices, each element
  on one device; device i of the source sends its shard to the destination device holding the
  same slice (bytes per device: one shard);
- other layouts over as many devices (replicated ones included), when dim 0 divides: each side
  converts between its layout and dim 0 split over its devices (a program on its own devices:
  slicing, or a collective inside the stage), and the rows cross as above;
- otherwise the source stage first gathers the value whole on each of its devices, each
  destination device receives it whole from a source device (rounds of `ppermute` when there are
  more destination devices than source ones), and the destination cuts its layout from it locally.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def is_multi_process() -> bool:
    """Whether JAX runs several processes (jax.distributed)."""
    return jax.process_count() > 1


def settled(tree: Any) -> Any:
    """`tree` once computed, in a job of several processes (else at once). A process then has at most
    one program in flight, so every device runs the programs of the global order one after the other:
    with several asynchronously dispatched collective programs in flight, a job of 4 CPU processes
    (gloo) hung in 2 of 6 runs of tests/test_multihost.py's 4 x 2 test; waiting for each program,
    10 of 10 passed (the cause inside XLA's CPU client was not found)."""
    if is_multi_process():
        jax.block_until_ready(tree)
    return tree


def owns(where: Any) -> bool:
    """Whether this process holds a device of `where` (a Mesh or a Sharding)."""
    devices = where.devices.flat if isinstance(where, Mesh) else where.device_set
    here = jax.process_index()
    return any(d.process_index == here for d in devices)


def absent(shape: Sequence[int], dtype: Any, sharding: Any) -> jax.Array:
    """A global array laid out as `sharding` of which this process holds no shard (it owns none of its devices)."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def absent_like(tree: Any) -> Any:
    """`absent` arrays for a pytree of ShapeDtypeStructs that carry their shardings."""
    return jax.tree_util.tree_map(lambda s: absent(s.shape, s.dtype, s.sharding), tree)


def move(value: Any, target: Any) -> Any:
    """`value` laid out as `target` (a Sharding): `jax.device_put` in one process or for host values
    (NumPy arrays and uncommitted JAX arrays, which every process holds alike), else a hand-off
    program run by the processes that own a source or a destination device."""
    if not is_multi_process() or not isinstance(value, jax.Array) or not getattr(value, "_committed", True):
        return jax.device_put(value, target)
    source = value.sharding
    if source == target or source.is_equivalent_to(target, value.ndim):
        return value
    if source.device_set | target.device_set <= set(jax.local_devices()):
        return jax.device_put(value, target)
    if not (owns(source) or owns(target)):
        return absent(value.shape, value.dtype, target)
    if source.device_set == target.device_set:
        return _reshard(value, target)
    count = len(source.device_set)
    if _same_shards(source, target, value.ndim) and _holds_once(source, value.shape):
        return _send_shards(value, target)
    if value.ndim and count == len(target.device_set) and value.shape[0] % count == 0:
        # Across the link in rows, one share per device (what the cost model prices); each side
        # converts between its layout and rows among its own devices.
        rows = _send_shards(_reshard(value, _rows(source)), _rows(target))
        return _reshard(rows, target)
    copies = _send_shards(_reshard(value, _replicated(source)), _replicated(target))
    return _reshard(copies, target)


def move_tree(tree: Any, targets: Any) -> Any:
    """`move` over a pytree; `targets` is one sharding or a pytree prefix of shardings."""
    return jax.tree_util.tree_map(lambda where, sub: jax.tree_util.tree_map(lambda v: move(v, where), sub),
                                  targets, tree, is_leaf=lambda x: x is None)


def _replicated(sharding: Any) -> NamedSharding:
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else Mesh(np.array(sharding._device_assignment),
                                                                        ("devices",))
    return NamedSharding(mesh, PartitionSpec())


def _rows(sharding: Any) -> NamedSharding:
    """Dim 0 split over `sharding`'s devices, in its device order."""
    return NamedSharding(Mesh(np.array(sharding._device_assignment), ("rows",)), PartitionSpec("rows"))


def _reshard(value: jax.Array, target: Any) -> jax.Array:
    """`value` laid out as `target` on the same devices (a program of the processes owning them)."""
    if not owns(target):
        return absent(value.shape, value.dtype, target)
    return settled(_identity(target)(value))


@functools.cache
def _identity(target: Any) -> Any:
    return jax.jit(lambda x: x, out_shardings=target)


def _same_shards(source: Any, target: Any, ndim: int) -> bool:
    """Whether `source` and `target` cut a value into the same slices over as many devices."""
    return (len(source.device_set) == len(target.device_set)
            and source._to_xla_hlo_sharding(ndim) == target._to_xla_hlo_sharding(ndim))


def _holds_once(sharding: Any, shape: tuple[int, ...]) -> bool:
    """Whether `sharding` keeps each element on one device only (nothing replicated)."""
    return int(np.prod(sharding.shard_shape(shape))) * len(sharding.device_set) == int(np.prod(shape))


def _slices(sharding: Any, shape: tuple[int, ...]) -> dict[Any, tuple[tuple[int, int], ...]]:
    """Device -> the slice of a `shape` value it holds, as hashable (start, stop) pairs."""
    return {d: tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
            for d, index in sharding.devices_indices_map(shape).items()}


def _send_shards(value: jax.Array, target: Any) -> jax.Array:
    """`value` sent shard by shard to `target`'s devices, which slice it alike (`_same_shards`), or
    whole to each of them from a source device (a replicated value)."""
    shape = value.shape
    source_slices, target_slices = _slices(value.sharding, shape), _slices(target, shape)
    senders: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, piece in source_slices.items():
        senders.setdefault(piece, []).append(device)
    union = list(dict.fromkeys([*value.sharding._device_assignment, *target._device_assignment]))
    position = {d: i for i, d in enumerate(union)}
    pairs: list[tuple[int, int]] = []
    used: dict[tuple[tuple[int, int], ...], int] = {}
    for device in target._device_assignment:  # each destination device from the next sender of its slice
        piece = target_slices[device]
        choices = senders[piece]
        pairs.append((position[choices[used.get(piece, 0) % len(choices)]], position[device]))
        used[piece] = used.get(piece, 0) + 1
    local = value.addressable_shards[0].data.shape if value.addressable_shards else _shard_shape(target, shape)
    program = _permute_program(tuple(union), _rounds(pairs), local, jnp.dtype(value.dtype))
    mine = {s.device: s.data for s in value.addressable_shards}
    buffers = [mine[d][None] if d in mine else _zeros(local, value.dtype, d)
               for d in union if d.process_index == jax.process_index()]
    stacked = jax.make_array_from_single_device_arrays((len(union), *local), program.in_sharding, buffers)
    received = settled(program.fn(stacked))
    arrived = {s.device: s.data for s in received.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, target, [arrived[d][0] for d in target._device_assignment if d.process_index == jax.process_index()],
        dtype=value.dtype)


def _shard_shape(sharding: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sharding.shard_shape(shape))


def _zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> jax.Array:
    return jax.device_put(np.zeros((1, *shape), dtype), device)


def _rounds(pairs: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """`pairs` (sender, receiver) grouped into permutations: in each round a device sends at most once."""
    rounds: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for group in rounds:
            if all(pair[0] != p[0] for p in group):
                group.append(pair)
                break
        else:
            rounds.append([pair])
    return tuple(tuple(group) for group in rounds)


class _Program:
    """A jitted hand-off over the union of two device sets and the sharding of its stacked input."""

    def __init__(self, union: tuple[Any, ...], rounds: tuple[tuple[tuple[int, int], ...], ...]) -> None:
        mesh = Mesh(np.array(union), ("handoff",))
        self.in_sharding = NamedSharding(mesh, PartitionSpec("handoff"))
        receivers = [np.zeros(len(union), bool) for _ in rounds]
        for received, group in zip(receivers, rounds, strict=True):
            received[[dst for _, dst in group]] = True

        def send(block: jax.Array) -> jax.Array:
            me = jax.lax.axis_index("handoff")
            out = block
            for received, group in zip(receivers, rounds, strict=True):
                arrived = jax.lax.ppermute(block, "handoff", group)
                out = jnp.where(jnp.asarray(received)[me], arrived, out)
            return out

        spec = PartitionSpec("handoff")
        self.fn = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec))


@functools.cache
def _permute_program(union: tuple[Any, ...], rounds: tuple[tuple[tuple[int, int], ...], ...],
                     local: tuple[int, ...], dtype: Any) -> _Program:
    del local, dtype  # part of the cache key only: jax.jit caches per shape itself
    return _Program(union, rounds)
