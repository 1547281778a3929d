"""solve_intra: Graph + LogicalMesh -> IntraPlan (strategies, ILP, solver, decoding)."""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import InfeasiblePlanError, MeshError, SolverError
from meshplan.intra.ilp import VariableMap, build_ilp
from meshplan.intra.layers import shared_groups
from meshplan.intra.method_layout import MethodLayout, free_aliased_results, pin_method_layout
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan, Resharding, chosen_strategy
from meshplan.intra.problem.graph_problem import graph_problem
from meshplan.intra.program import LinearProgram
from meshplan.intra.search.problem_solver import ProblemOptions, solve_problem
from meshplan.intra.solvers import SolveResult, SolveStatus, solve_program
from meshplan.intra.strategy_graph import StrategyGraph, build_strategy_graph, reprice_strategy_graph
from meshplan.ir.graph import Graph, check_graph
from meshplan.sharding.enumerate import UnsupportedOpWarning, enumerate_strategies, reprice_parameters
from meshplan.sharding.spec import ShardingSpec


def build_intra_problem(graph: Graph, mesh: LogicalMesh, options: IntraOptions | None = None
                        ) -> tuple[StrategyGraph, LinearProgram, VariableMap, tuple[str, ...]]:
    """Enumerate strategies, merge followers and build the explicit ILP (no solving; for
    looking inside with `--dump-lp` and for tests of the strategy graph)."""
    options = options or IntraOptions()
    sg, unsupported = build_strategies(graph, mesh, options)
    canon = shared_groups(sg) if options.share_layers else None
    lp, vm = build_ilp(sg, budget_of(mesh, options), canon)
    return sg, lp, vm, unsupported


def build_strategies(graph: Graph, mesh: LogicalMesh, options: IntraOptions,
                     forbid_gathers: bool = True) -> tuple[StrategyGraph, tuple[str, ...]]:
    """Enumerate strategies and merge followers into a StrategyGraph; name unsupported ops."""
    check_graph(graph)
    check_mesh_fits(graph, mesh)
    if options.layout is not MethodLayout.AUTO:
        graph = free_aliased_results(graph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnsupportedOpWarning)
        nodes = enumerate_strategies(graph, mesh, options.cost, options.rules)
    unsupported = tuple(sorted({graph[n.node].op for n in nodes if n.fallback}))
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=3)
    sg = build_strategy_graph(graph, mesh, options.cost, nodes)
    dropped = pin_method_layout(sg, options.layout, forbid_gathers)
    if dropped:
        warnings.warn(f"{graph.name!r}: the {options.layout.value} layout cannot be kept at {len(dropped)} node(s), "
                      f"planned by cost there: {', '.join(dropped[:8])}{' ...' if len(dropped) > 8 else ''}",
                      LayoutWarning, stacklevel=3)
    return sg, unsupported


def solve_intra_prices(graph: Graph, mesh: LogicalMesh, options: IntraOptions,
                       memory_prices: tuple[float, ...]) -> list[IntraPlan]:
    """`solve_intra` once per memory price (`CostModel.memory_price`), the other options fixed:
    the strategies are enumerated and the strategy graph built once, then re-priced (the
    plans are the same as separate `solve_intra` calls)."""
    plans: list[IntraPlan] = []
    first: StrategyGraph | None = None
    unsupported: tuple[str, ...] = ()
    for price in memory_prices:
        priced = replace(options, cost=replace(options.cost, memory_price=price))
        start = time.perf_counter()
        if first is None:
            sg, unsupported = build_strategies(graph, mesh, priced)
            first = sg
        else:
            nodes = reprice_parameters(graph, mesh, priced.cost, priced.rules, first.nodes)
            sg = reprice_strategy_graph(first, priced.cost, nodes)
        plans.append(_solve_strategy_graph(sg, graph, mesh, priced, start, unsupported))
    return plans


def solve_intra(graph: Graph, mesh: LogicalMesh, options: IntraOptions | None = None) -> IntraPlan:
    """Choose one sharding strategy per node minimizing compute + communication + resharding.

    Args:
        graph: the operator graph of one stage.
        mesh: the logical mesh it runs on (its memory_per_device is the default budget).
        options: cost model, strategy space, memory budget, solver, layer sharing, ...

    Returns:
        The plan: chosen strategies, objective and breakdown, peak memory, solver result.

    Raises:
        InfeasiblePlanError: no plan fits the memory budget (the message gives the smallest
            budget that would work) or the forced shardings contradict each other.
    """
    options = options or IntraOptions()
    start = time.perf_counter()
    sg, unsupported = build_strategies(graph, mesh, options)
    try:
        return _solve_strategy_graph(sg, graph, mesh, options, start, unsupported)
    except InfeasiblePlanError:
        if options.layout is not MethodLayout.TENSOR_PARALLEL:
            raise
    # Some weight's uses ask for layouts no single one serves without a collective (a tied
    # embedding is looked up by rows and multiplied by columns): plan again letting weights move.
    warnings.warn(f"{graph.name!r}: the {options.layout.value} layout converts some weights with collectives: "
                  "no layout of theirs serves every use (e.g. a tied embedding)", LayoutWarning, stacklevel=2)
    sg, unsupported = build_strategies(graph, mesh, options, forbid_gathers=False)
    return _solve_strategy_graph(sg, graph, mesh, options, start, unsupported)


def _solve_strategy_graph(sg: StrategyGraph, graph: Graph, mesh: LogicalMesh, options: IntraOptions, start: float,
                          unsupported: tuple[str, ...]) -> IntraPlan:
    budget = budget_of(mesh, options)
    gp = graph_problem(sg, budget, shared_groups(sg) if options.share_layers else None)
    build_s = time.perf_counter() - start
    solution = solve_problem(gp.problem, ProblemOptions(time_limit=options.time_limit, mip_gap=options.mip_gap,
                                                        backend=options.solver))
    if solution.status is SolveStatus.INFEASIBLE:
        raise _infeasible(sg, graph, mesh, budget, options)
    if not solution.has_solution:
        raise SolverError(
            f"{options.solver} found no plan for {graph.name!r} on mesh {mesh.name} within "
            f"{options.time_limit:g} s; raise the time limit or share repeated layers (share_layers=True)")
    result = SolveResult(solution.status, solution.cost, solution.bound, solution.gap, solution.wall_s,
                         solution.backend)
    size = (solution.stats.get("mip_columns", 0), solution.stats.get("mip_rows", 0))
    return _plan(sg, gp.group_choice(solution.choice), result, options, budget, build_s, unsupported, size)


def budget_of(mesh: LogicalMesh, options: IntraOptions) -> float | None:
    return options.memory_budget if options.memory_budget is not None else mesh.memory_per_device


class LayoutWarning(UserWarning):
    """Some values cannot take the layout the method promises; the cost model chose theirs."""


class PaddedSplitWarning(UserWarning):
    """A mesh axis divides no tensor dim evenly: every split over it is padded."""


def check_mesh_fits(graph: Graph, mesh: LogicalMesh) -> None:
    """Raise MeshError when a mesh axis is larger than every tensor dim of the graph; warn
    when it divides none of them (splits over it are then padded up)."""
    dims = {d for n in graph.nodes for d in n.shape}
    largest = max(dims, default=0)
    for axis, size in enumerate(mesh.shape):
        if size > 1 and size > largest:
            raise MeshError(
                f"mesh axis {axis} has {size} devices but the largest tensor dim of graph "
                f"{graph.name!r} is {largest}: nothing can be split over it. Use a smaller mesh axis "
                f"or a larger batch.")
        if size > 1 and not any(d % size == 0 for d in dims):
            warnings.warn(f"mesh axis {axis} ({size} devices) divides no tensor dim of {graph.name!r}; "
                          "splits over it are padded up", PaddedSplitWarning, stacklevel=3)


def _infeasible(sg: StrategyGraph, graph: Graph, mesh: LogicalMesh, budget: float | None,
                options: IntraOptions) -> InfeasiblePlanError:
    if budget is None:
        return InfeasiblePlanError(
            f"no plan of {graph.name!r} on mesh {mesh.name} satisfies the alias and forced-sharding "
            "constraints; check the aliases (parameter and update must be able to share a layout)")
    lp, _ = build_ilp(sg, None, shared_groups(sg) if options.share_layers else None, minimize_memory=True)
    result = solve_program(lp, options.solver, options.time_limit, 1e-4)
    need = result.objective if result.has_solution else None
    text = (f"graph {graph.name!r} needs at least {_gb(need)} per device on mesh {mesh.name}"
            if need is not None else f"graph {graph.name!r} does not fit on mesh {mesh.name}")
    return InfeasiblePlanError(
        f"{text}, but the budget is {_gb(budget)}. Use more devices, a smaller batch, or raise "
        "the memory budget.", min_budget_bytes=need)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e7 else f"{nbytes:.0f} bytes"


def _plan(sg: StrategyGraph, group_choice: dict[int, int], result: SolveResult, options: IntraOptions,
          budget: float | None, build_s: float, unsupported: tuple[str, ...], size: tuple[int, int]) -> IntraPlan:
    graph = sg.graph
    choice = sg.node_choices(group_choice)
    chosen, reshardings = [], []
    aliased = {param for param, _ in graph.aliases}
    for node in graph.nodes:
        s = sg.nodes[node.id].strategies[choice[node.id]]
        chosen.append(chosen_strategy(node, s, aliased))
        for operand, required in zip(node.operands, s.operands, strict=True):
            produced = sg.nodes[operand].strategies[choice[operand]].output
            collectives = sg.reshard(operand, produced, required)
            if collectives:
                reshardings.append(Resharding(graph[operand].label, node.label, node.id, produced, required,
                                              collectives))
    for node_id in graph.force_replicated:
        produced = chosen[node_id].output
        collectives = sg.reshard(node_id, produced, ShardingSpec.replicated(produced.rank))
        if collectives:
            reshardings.append(Resharding(graph[node_id].label, "<replicated output>", node_id, produced,
                                          ShardingSpec.replicated(produced.rank), collectives))
    breakdown = sg.evaluate(group_choice)
    return IntraPlan(graph.name, sg.mesh, tuple(chosen), breakdown.total, breakdown, sg.peak_memory(group_choice),
                     budget, result, tuple(reshardings), options.share_layers, len(sg.groups), size[0], size[1],
                     build_s, unsupported)
