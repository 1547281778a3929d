"""parallel.donation and parallelize(donate_argnums=...): donated buffers reused on 8 CPU devices.

Measured on JAX 0.10.2, CPU backend: donation is real. The compiled HLO carries
`input_output_alias`, donated arrays are deleted by the call, and each new parameter shard
sits at the buffer address of the old one; jax emits no "donated buffers were not usable".
"""

from __future__ import annotations

import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshplan import IntraOptions, OptionsError
from meshplan.capture import capture
from meshplan.cluster.costs import DeviceCosts
from meshplan.parallel import DataParallel, ShardParallel, Zero3Parallel, parallelize
from meshplan.parallel import donation as donation_module
from meshplan.parallel.donation import Donation, UnusedDonationWarning, drop_unplaceable, pair_donated
from test_api import mlp_adam_program, train


def test_pairs_take_the_first_free_result_of_the_same_shape_and_dtype():
    def step(a, b, c, n):
        return {"c": c * 2, "a": a + 1, "b": b - 1}, jnp.sum(a), n.astype(jnp.float32)

    a, b, c = jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((8, 4))
    captured = capture(step, a, b, c, jnp.ones((4, 8), jnp.int32))
    # results, flat: a+1, b-1, c*2 (dict keys sorted), sum, n as float32[4, 8]
    assert pair_donated(captured, [0, 1, 2, 3]) == Donation(pairs=((0, 0), (1, 1), (2, 2)), unmatched=(3,))
    assert pair_donated(captured, [1]) == Donation(pairs=((1, 0),))  # jit pairs b with a+1 too


def test_dropping_an_unplaceable_argument_pairs_the_rest_as_jit_will(monkeypatch):
    """Once argument 0 is not donated, jit gives its result to argument 1: plan that pair."""
    captured = capture(lambda a, b: (a * 2, b + 1), jnp.ones((8, 8)), jnp.ones((8, 8)))
    first_pair = (captured.input_nodes[0], captured.output_nodes[0])
    monkeypatch.setattr(donation_module, "unshareable_pairs",
                        lambda graph, mesh, options, pairs: {pair for pair in pairs if pair == first_pair})
    donation = pair_donated(captured, [0, 1])
    assert donation == Donation(pairs=((0, 0), (1, 1)))
    assert drop_unplaceable(captured, donation, DeviceCosts().mesh((8,)), IntraOptions()) == Donation(
        pairs=((1, 0),), unplaceable=(0,))


def alias_table(hlo: str) -> list[tuple[int, int]]:
    """(parameter, result) pairs of the compiled module's input_output_alias."""
    header = hlo.splitlines()[0]
    return sorted((int(p), int(r)) for r, p in re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", header))


def shard_pointers(tree):
    return [s.data.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree) for s in x.addressable_shards]


@pytest.mark.parametrize("method", [ShardParallel(), DataParallel()], ids=lambda m: type(m).__name__)
def test_donated_training_step_reuses_buffers_and_matches(method):
    step, state, batch = mlp_adam_program()
    parallel = parallelize(step, method=method, donate_argnums=(0,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedDonationWarning)
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        new_state, _ = parallel(state, batch)
    last = parallel._last
    leaves = len(jax.tree_util.tree_leaves(state))  # params, m, v (3 each) and t: 10
    assert [a for a, _ in last.donation.pairs] == list(range(leaves))  # the state comes first: step(state, batch)
    assert [r for _, r in last.donation.pairs] == list(range(leaves))  # new state, leaf for leaf
    assert alias_table(last.sharded.executable.as_text()) == sorted(last.donation.pairs)
    for a, r in last.donation.pairs:  # the ILP gave every pair one layout
        node_in, node_out = last.captured.input_nodes[a], last.captured.output_nodes[r]
        assert (node_in, node_out) in last.captured.graph.aliases
        assert last.plan.strategy(node_in).output == last.plan.strategy(node_out).output
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(state))  # moved first, so copied
    # From the second call on the state is laid out as planned: donated, deleted, buffers reused.
    pointers = shard_pointers(new_state)
    newer_state, _ = parallel(new_state, batch)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(new_state))
    assert shard_pointers(newer_state) == pointers
    got, got_losses = train(parallel, state, batch)
    want, want_losses = train(parallelize(step, method=method), state, batch)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-5)
    for value, expected in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
    _, jit_losses = train(jax.jit(step), state, batch)
    np.testing.assert_allclose(got_losses, jit_losses, rtol=1e-5, atol=1e-5)


def test_zero3_cannot_donate_biases_and_says_so(tmp_path):
    """Under forced data parallelism the bias gradient is all-reduced, so a bias update is offered
    only replicated while Zero3Parallel keeps the bias itself split: no common layout."""
    step, state, batch = mlp_adam_program()
    parallel = parallelize(step, method=Zero3Parallel(), donate_argnums=(0,))
    with pytest.warns(UnusedDonationWarning, match=r"args\[0\]\[0\]\['b1'\] float32\[256\], args\[0\]\[1\]\['b1'\] "
                                                    r"float32\[256\], args\[0\]\[2\]\['b1'\] float32\[256\] \(the "
                                                    r"planner offers the argument and its result no common layout"):
        new_state, _ = parallel(state, batch)
    assert parallel._last.donation.unplaceable == (0, 3, 6)  # flat: params, m, v (b1 first in each), t, x, y
    assert alias_table(parallel._last.sharded.executable.as_text()) == sorted(parallel._last.donation.pairs)
    parallel(new_state, batch)
    assert {k: x.is_deleted() for k, x in new_state[0].items()} == {"b1": False, "w1": True, "w2": True}
    auto = parallelize(step, method=Zero3Parallel(), donate_argnums="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedDonationWarning)  # "auto" donates what it can, silently
        auto(state, batch)
    auto.dump_debug_info(tmp_path)
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    assert report["not_donated"] == [{"argument": f"args[0][{i}]['b1']", "reason": "no common layout with its result"}
                                     for i in range(3)]
    assert len(report["donated"]) == 7 and report["involuntary_rematerializations"] == 0


def test_auto_donates_all_but_the_batch_and_unmatched_leaves_warn():
    def step(params, batch, lr):
        return jax.tree_util.tree_map(lambda p: p - lr * jnp.mean(batch), params), jnp.sum(batch, axis=0)

    params, batch, lr = {"w": jnp.ones((8, 8))}, jnp.ones((16, 4)), jnp.float32(0.1)
    auto = parallelize(step, donate_argnums="auto")  # batch_argnums=(1,): params and lr
    auto(params, batch, lr)
    assert auto._last.donation == Donation(pairs=((0, 0),), unmatched=(2,))
    explicit = parallelize(step, donate_argnums=(0, 2))
    with pytest.warns(UnusedDonationWarning, match=r"args\[2\] float32\[\] \(no result of the same shape and dtype"):
        explicit(params, batch, lr)


def test_donate_argnums_errors_are_clear():
    with pytest.raises(OptionsError, match=r"donate_argnums='all'\): use \"auto\" or a tuple of argument positions"):
        parallelize(lambda x: x, donate_argnums="all")
    with pytest.raises(OptionsError, match=r"donate_argnums=\(3,\)\): position\(s\) \[3\] are out of range for "
                                           r"<lambda> called with 1 argument"):
        parallelize(lambda x: x * 2, donate_argnums=(3,))(jnp.ones(8))
