"""The ILP optimum equals brute-force enumeration of every strategy combination."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from meshplan import GraphBuilder, InfeasiblePlanError, IntraOptions, LogicalMesh, solve_intra
from meshplan.cost import CostModel
from meshplan.intra import build_intra_problem

SIZES = st.sampled_from([2, 4, 8])


@st.composite
def small_graphs(draw):
    """A few parameters and 2-5 ops mixing dots, elementwise, transposes, reduces, broadcasts."""
    b = GraphBuilder("random")
    n, k, m = draw(SIZES), draw(SIZES), draw(SIZES)
    x = b.parameter((n, k), name="x")
    w = b.parameter((k, m), name="w")
    values = [b.matmul(x, w)]
    for step in range(draw(st.integers(1, 4))):
        v = values[-1]
        kind = draw(st.sampled_from(["dot", "exp", "transpose", "reduce", "add_param", "dot_t"]))
        shape = b.shape(v)
        if kind == "dot":
            w2 = b.parameter((shape[1], draw(SIZES)), name=f"w{step}")
            values.append(b.matmul(v, w2))
        elif kind == "dot_t":  # a weight-gradient-like contraction over the batch dim
            values.append(b.dot(v, v, (0,), (0,)))
        elif kind == "exp":
            values.append(b.exp(v))
        elif kind == "transpose":
            values.append(b.transpose(v, (1, 0)))
        elif kind == "reduce":
            r = b.reduce(v, (draw(st.integers(0, 1)),))
            values.append(b.broadcast(r, shape, (1,) if b.shape(r)[0] == shape[1] else (0,)))
        else:
            p = b.parameter(shape, name=f"p{step}")
            values.append(b.add(v, p))
            if draw(st.booleans()):
                b.alias(p, values[-1])
    b.outputs(values[-1], force_replicated=draw(st.booleans()))
    return b.build()


def brute_force(sg, budget):
    best = math.inf
    sizes = [sg.size(g) for g in sg.groups]
    for combo in itertools.product(*(range(s) for s in sizes)):
        choice = dict(zip(sg.groups, combo, strict=True))
        if sg.is_feasible(choice, budget):
            best = min(best, sg.evaluate(choice).total)
    return best


def _solved_like_brute_force(graph, mesh, options, budget_fraction, max_combinations):
    """The ILP's plan and the budget (`budget_fraction` of every value's bytes), its objective
    asserted equal to brute force; None when no plan fits (the ILP must say so too)."""
    sg, _, _, _ = build_intra_problem(graph, mesh, options)
    assume(math.prod(sg.size(g) for g in sg.groups) <= max_combinations)
    budget = None if budget_fraction is None else budget_fraction * sum(graph[v].nbytes for v in range(len(graph)))
    expected = brute_force(sg, budget)
    options = options.replace(memory_budget=budget)
    if math.isinf(expected):
        with pytest.raises(InfeasiblePlanError):
            solve_intra(graph, mesh, options)
        return None
    plan = solve_intra(graph, mesh, options)
    assert plan.objective == pytest.approx(expected, rel=1e-7, abs=1e-7)
    return plan, budget


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_graphs(), shape=st.sampled_from([(2, 2), (4, 1), (2, 1), (1, 2)]),
       beta=st.tuples(st.sampled_from([1.0, 0.1]), st.sampled_from([1.0, 0.01])),
       compute=st.booleans(), budget_fraction=st.sampled_from([None, 0.3, 0.6, 1.0]), reduce_scatter=st.booleans())
def test_ilp_equals_brute_force(graph, shape, beta, compute, budget_fraction, reduce_scatter):
    mesh = LogicalMesh(shape, (1.0, 0.5), beta)
    assume(max(d for n in graph.nodes for d in n.shape) >= max(shape))
    cost = CostModel(flops_per_second=50.0 if compute else None)
    solved = _solved_like_brute_force(graph, mesh, IntraOptions(cost=cost, reduce_scatter=reduce_scatter),
                                      budget_fraction, max_combinations=4000)
    if solved is None:
        return
    plan, budget = solved
    assert plan.solve.objective == pytest.approx(plan.objective, rel=1e-6, abs=1e-6)
    if budget is not None:
        assert plan.peak_memory <= budget * (1 + 1e-9)


def test_warm_started_ilp_found_by_hypothesis():
    """HiGHS 1.16 reported the optimum (83) of this model yet returned the column values of the
    warm start (100) when presolve alone solved it; `solve_mip` now checks the values."""
    from meshplan.ir import DType, Graph, Node, OpKind

    def dot(lhs: int, rhs: int) -> tuple:
        return (("lhs_batch", ()), ("lhs_contracting", (lhs,)), ("rhs_batch", ()), ("rhs_contracting", (rhs,)))

    nodes = (Node(0, OpKind.PARAMETER, (), (4, 2), DType.F32, (), "x", "", None),
             Node(1, OpKind.PARAMETER, (), (2, 4), DType.F32, (), "w", "", None),
             Node(2, OpKind.DOT, (0, 1), (4, 4), DType.F32, dot(1, 0), "", "", None),
             Node(3, OpKind.TRANSPOSE, (2,), (4, 4), DType.F32, (("perm", (1, 0)),), "", "", None),
             Node(4, OpKind.DOT, (3, 3), (4, 4), DType.F32, dot(0, 0), "", "", None),
             Node(5, OpKind.DOT, (4, 4), (4, 4), DType.F32, dot(0, 0), "", "", None))
    graph = Graph(nodes=nodes, outputs=(5,), aliases=(), force_replicated=(), name="random")
    mesh = LogicalMesh((2, 1), (1.0, 0.5), (1.0, 1.0))
    options = IntraOptions(cost=CostModel(flops_per_second=None), reduce_scatter=False)
    sg, _, _, _ = build_intra_problem(graph, mesh, options)
    budget = 0.3 * sum(graph[v].nbytes for v in range(len(graph)))
    expected = brute_force(sg, budget)
    assert expected == 83.0
    assert solve_intra(graph, mesh, options.replace(memory_budget=budget)).objective == pytest.approx(expected)


@st.composite
def tiny_graphs(draw):
    """x @ w and one more op: small enough that every combination of strategies on a 3-D mesh
    can be listed."""
    b = GraphBuilder("tiny")
    n, k, m = draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4, 8]))
    x = b.parameter((n, k), name="x")
    w = b.parameter((k, m), name="w")
    y = b.matmul(x, w)
    kind = draw(st.sampled_from(["exp", "transpose", "reduce", "dot_t"]))
    if kind == "exp":
        y = b.exp(y)
    elif kind == "transpose":
        y = b.transpose(y, (1, 0))
    elif kind == "reduce":
        y = b.reduce(y, (draw(st.integers(0, 1)),))
    else:
        y = b.dot(y, y, (0,), (0,))
    b.outputs(y, force_replicated=draw(st.booleans()))
    return b.build()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(graph=tiny_graphs(), shape=st.sampled_from([(2, 2, 2), (2, 2, 2), (2, 2, 2), (2, 1, 2), (1, 2, 2)]),
       beta=st.sampled_from([(1.0, 0.1, 0.01), (0.01, 1.0, 0.1)]), compute=st.booleans(),
       budget_fraction=st.sampled_from([None, 0.4, 1.0]), reduce_scatter=st.booleans())
def test_ilp_equals_brute_force_on_3d_meshes(graph, shape, beta, compute, budget_fraction, reduce_scatter):
    """Three mesh axes, each with its own link price: the ILP still finds the cheapest plan."""
    mesh = LogicalMesh(shape, (1.0, 0.5, 0.25), beta)
    cost = CostModel(flops_per_second=50.0 if compute else None)
    solved = _solved_like_brute_force(graph, mesh, IntraOptions(cost=cost, reduce_scatter=reduce_scatter),
                                      budget_fraction, max_combinations=6000)
    if solved is None:
        return
    plan, _ = solved
    # --hypothesis-show-statistics: about half the examples run on 2x2x2 and use all three axes
    event(f"{mesh.name} mesh, {len({a for c in plan.nodes for a in c.output.axes()})} axes used")
