"""runtime.hlo_collectives and runtime.collective_check: compiled collectives read from HLO text,
compared with the plan's after the documented normalisation; resharding priced as XLA runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from meshplan.cluster.costs import DeviceCosts
from meshplan.cost.model import CostModel
from meshplan.report.collectives_text import collectives_lines
from meshplan.runtime.collective_check import PlannedCollective, compare
from meshplan.runtime.diagnostics import compile_lowered
from meshplan.runtime.hlo_collectives import CompiledCollective, axis_groups, hlo_collectives
from meshplan.runtime.sharded import make_jax_mesh, partition_spec
from meshplan.sharding.resharding import resharding_collectives
from meshplan.sharding.spec import ShardingSpec, conversion_path

HLO = "\n".join((
    "HloModule m",
    "ENTRY %main (p: f32[64,32]) -> f32[8] {",
    "  %p = f32[64,32]{1,0} parameter(0)",
    "  %g = f32[64,32]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}",
    "  %a = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add",
    "  %t = f32[8]{0} all-reduce(%x), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
    "  %m = f32[32]{0} all-gather(%q), channel_id=4, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], "
    "device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={0}",
    "  %both = (f32[32]{0}, f32[16,16]{1,0}) all-reduce(%u, %v), channel_id=5, "
    "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, to_apply=%add",
    "  %pairs = f32[8]{0} all-reduce(%x), channel_id=6, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add",
    "  %rs = f32[8,32]{1,0} reduce-scatter(%p), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}",
    "  %a2a = (f32[2,32]{1,0}, f32[2,32]{1,0}, f32[2,32]{1,0}, f32[2,32]{1,0}) all-to-all(%c0, %c1, %c2, %c3), "
    "channel_id=8, replica_groups=[2,4]<=[8]",
    "  %cp = f32[4,4]{1,0} collective-permute(%y), channel_id=9, "
    "source_target_pairs={{0,0},{4,1},{1,2},{5,3},{2,4},{6,5},{3,6},{7,7}}",
    "  %ags = (f32[4]{0}, f32[32]{0}) all-gather-start(%z), channel_id=10, replica_groups=[1,8]<=[8], "
    "dimensions={0}, metadata={op_name=\"jit(f)/dot_general\"}",
    "  %agd = f32[32]{0} all-gather-done(%ags)",
    "}"))


def test_hlo_collectives_read_every_group_form_kind_and_size():
    found = {c.name: c for c in hlo_collectives(HLO, (2, 4))}
    assert set(found) == {"g", "a", "t", "m", "both", "pairs", "rs", "a2a", "cp", "ags"}  # -done not counted
    assert found["g"].axes == (0,) and found["g"].buffers == (64 * 32 * 4,)  # explicit groups, gathered output
    assert found["a"].axes == (1,) and found["t"].axes == (0,)  # iota groups, plain and transposed
    assert found["m"].axes == (1,)  # Shardy's mesh form with permuted device ids
    assert found["both"].axes == (0, 1) and found["both"].buffers == (128, 1024)  # combined: one per operand
    assert found["pairs"].axes is None  # groups of no set of mesh axes
    assert found["rs"].axes == (0, 1) and found["rs"].buffers == (64 * 32 * 4,)  # reduce-scatter: its input
    assert found["a2a"].axes == (1,) and found["a2a"].buffers == (4 * 2 * 32 * 4,)  # tuple form: one collective
    assert found["cp"].kind == "collective-permute" and found["cp"].axes == (0, 1)
    assert found["ags"].kind == "all-gather" and found["ags"].op_name == "jit(f)/dot_general"


def test_hlo_collectives_read_shardy_sub_axes():
    """Shardy names a group over part of an axis of its (reshaped) mesh as a sub-axis 'a':(pre)size:
    the `size` devices after every `pre`-th along it (seen on a 2x2x2 pipeshard stage: a 2-way
    all-to-all over mesh axis 2 of a mesh whose axis_2 holds axes 0 and 2)."""
    line = ("  %s = (f32[2,64]{1,0}, f32[2,64]{1,0}) all-to-all(%c0, %c1), channel_id=3, replica_groups="
            "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_2':(PRE)2}")
    minor, major = (hlo_collectives(line.replace("PRE", pre), (2, 2, 2))[0] for pre in ("2", "1"))
    assert minor.axes == (2,) and major.axes == (0,)


def test_axis_groups_of_a_row_major_mesh():
    assert axis_groups((2, 4), (0,)) == {frozenset({j, 4 + j}) for j in range(4)}
    assert axis_groups((2, 4), (1,)) == {frozenset(range(4)), frozenset(range(4, 8))}
    assert axis_groups((2, 4), (0, 1)) == {frozenset(range(8))}


def planned(kind, axes, nbytes, compiled_kind=None):
    return PlannedCollective(kind, axes, nbytes, compiled_kind or kind, f"{kind} at test")


def test_compare_applies_the_normalisation_and_names_the_rest():
    plan = [planned("all-reduce", (0,), 64), planned("all-reduce", (0,), 128),
            planned("reduce-scatter", (0,), 256, "all-reduce"),  # as the cpu backend emits it
            planned("all-reduce", (0, 1), 32),  # emitted one axis at a time
            planned("all-gather", (1,), 512)]  # not compiled
    compiled = [CompiledCollective("all-reduce", "combined", (0,), (64, 128, 256)),
                CompiledCollective("all-reduce", "x", (0,), (32,)), CompiledCollective("all-reduce", "y", (1,), (32,)),
                CompiledCollective("collective-permute", "cp", (0, 1), (16,), "jit(f)/add")]
    check = compare(plan, compiled, "cpu")
    assert not check.agrees
    assert check.missing == (plan[-1],)
    assert check.unplanned == (("collective-permute", (0, 1), 16, "jit(f)/add"),)
    rows = {(r.kind, r.axes): (r.planned, r.compiled, r.instructions) for r in check.rows}
    assert rows == {("all-reduce", (0,)): (3, 3, 2), ("all-reduce", (0, 1)): (1, 1, 0),
                    ("all-reduce", (1,)): (0, 0, 1), ("all-gather", (1,)): (1, 0, 0),
                    ("collective-permute", (0, 1)): (0, 1, 1)}
    assert check.counts("planned") == {"all-reduce": 3, "reduce-scatter": 1, "all-gather": 1}
    assert check.counts() == {"all-reduce": 4, "collective-permute": 1}
    assert compare(plan[:4], compiled[:3], "cpu").agrees
    assert not compare([planned("reduce-scatter", (0,), 256)], compiled[:1], "gpu").agrees  # GPUs keep it
    lines = collectives_lines({**check.to_dict(), "layout": "ShardParallel: the cost model's choice"})
    assert lines[0] == ("the executable differs from the plan: 1 of 5 planned collective(s) not compiled, "
                        "1 of 5 compiled collective(s) not planned")
    assert "  planned, not compiled: all-gather on axes 1, 512 B (all-gather at test)" in lines
    assert "  compiled, not planned: collective-permute on axes 0,1, 16 B (from jit(f)/add)" in lines
    assert "1 planned reduce-scatter(s) counted as all-reduce: the cpu backend emits them so" in lines
    assert lines[-1].startswith("normalised: compiled: a combined collective")


# (src, dst) conversions on (2, 4) and (4, 2) meshes, each compiled alone: what XLA emits, which the
# resharding rule prices. Not covered: exchanging axes between two dims (S0S1R -> S1S0R), which
# XLA does with an all-to-all over groups of no mesh axes and a collective-permute (the rule
# prices a gather, so plans avoid it), and moving the major axis of a dim away (RS01R -> S0S1R:
# XLA permutes, then exchanges over groups of no mesh axes; the rule prices a permute and an
# all-to-all over axis 0, the same bytes).
CONVERSIONS = [("S0RR", "RS0R"), ("S0RS1", "RS0S1"), ("S01RR", "RS01R"), ("RRS01", "S01RR"),  # all-to-all
               ("S0S1R", "RS1S0"), ("RS1R", "RS01R"), ("RS01R", "RS1R"),  # collective-permutes
               ("RRS01", "S1S0R"), ("S0S1R", "RRS01"), ("S1S0R", "RRR"), ("S01RR", "S0RR"),  # all-gathers
               ("S01RR", "RRS0"),  # an all-gather, then an all-to-all
               ("RRS1", "RRS0"), ("S1RR", "RS0R"),  # an all-gather, then a slice
               # a slice over the added axis, then an all-to-all of the smaller shard (and a
               # permute where the added axis lands before the moved one)
               ("RRS1", "S01RR"), ("RRS1", "S1S0R"), ("RRS0", "S01RR"), ("RRS0", "RS01R"), ("RRS1", "S10RR")]


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_resharding_is_priced_as_xla_emits_it(mesh_shape):
    logical = DeviceCosts().mesh(mesh_shape)
    mesh = make_jax_mesh(logical)
    shape = (16, 16, 16)
    named = lambda spec: NamedSharding(mesh, partition_spec(spec))  # noqa: E731
    for src, dst in CONVERSIONS:
        a, b = ShardingSpec.parse(src), ShardingSpec.parse(dst)
        path = conversion_path(a, b, logical)  # the runtime converts through it, as the rule prices

        def convert(x, path=path, named=named):
            x = x * 2
            for step in path:
                x = jax.lax.with_sharding_constraint(x, named(step))
            return x + 1

        fn = jax.jit(convert, in_shardings=named(a), out_shardings=named(b))
        compiled, diagnostics = compile_lowered(fn.lower(jax.ShapeDtypeStruct(shape, jnp.float32)))
        assert diagnostics.num_rematerializations == 0, (src, dst)
        got = hlo_collectives(compiled.as_text(), mesh_shape)
        want = [planned(c.kind.value, c.axes, round(c.nbytes)) for c in
                resharding_collectives(shape, 4, a, b, logical, CostModel())]
        check = compare(want, got, "cpu")
        assert check.agrees, (src, dst, check.missing, check.unplanned)
