"""Hand-offs between stages (meshplan.runtime.handoff). Across processes they are checked by
tests/test_multihost.py (pipelined steps equal one device); here, what one process can check: the
plain `device_put` in one process, and how point-to-point sends are grouped into permutations."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.runtime.handoff import _holds_once, _rounds, move, owns


def test_in_one_process_a_hand_off_is_device_put():
    devices = jax.devices()
    source = NamedSharding(Mesh(np.array(devices[:4]), ("d",)), PartitionSpec("d"))
    target = NamedSharding(Mesh(np.array(devices[4:]), ("d",)), PartitionSpec())
    value = jax.device_put(np.arange(16.0).reshape(8, 2), source)
    moved = move(value, target)
    assert moved.sharding == target and owns(target)
    np.testing.assert_array_equal(moved, np.arange(16.0).reshape(8, 2))


def test_sends_are_grouped_so_that_no_device_sends_twice_in_a_round():
    pairs = [(0, 4), (1, 5), (0, 6), (1, 7), (0, 8)]  # 2 senders, 5 receivers: the whole value to each
    rounds = _rounds(pairs)
    assert [len({src for src, _ in group}) == len(group) for group in rounds] == [True] * 3
    assert sorted(p for group in rounds for p in group) == sorted(pairs)
    assert len(rounds) == 3


def test_only_layouts_without_replicas_cross_shard_by_shard():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    assert _holds_once(NamedSharding(mesh, PartitionSpec("a", "b")), (8, 4))
    assert not _holds_once(NamedSharding(mesh, PartitionSpec("a")), (8, 4))  # replicated along b
    assert not _holds_once(NamedSharding(mesh, PartitionSpec()), (8, 4))
