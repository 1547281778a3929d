"""SpmdFunction: one step captured, planned on one logical mesh and run sharded.

On the first call with new argument shapes the function is captured (meshplan.capture),
planned on a logical mesh of the visible devices (solve_intra), jitted as planned
(execute_sharded) and compiled at once, counting XLA's involuntary full rematerializations
(runtime.diagnostics); later calls with the same shapes reuse that executable. Donated
arguments (donate_argnums) are paired with results of the same shape and dtype
(parallel.donation); the pairs are planned as aliases and their buffers reused by XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from meshplan.capture import BatchInputs, Captured, capture, find_batch_inputs, tag_batch_inputs, warn_if_unproven
from meshplan.cluster.costs import DeviceCosts
from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import InfeasiblePlanError, OptionsError
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import format_graph
from meshplan.parallel.call import CallForm
from meshplan.parallel.donation import Donation, alias_donated, drop_unplaceable, pair_donated, warn_not_donated
from meshplan.parallel.function import DebugFile, ParallelizedFunction
from meshplan.parallel.methods import SpmdMethod
from meshplan.plan import single_stage_plan
from meshplan.runtime.abstract import shapes_of
from meshplan.runtime.diagnostics import CompileDiagnostics, warn_if_rematerialized
from meshplan.runtime.sharded import ShardedFunction, execute_sharded, make_jax_mesh, partition_spec, placeable_spec


@dataclasses.dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one input signature produced."""

    captured: Captured  # graph aliases include the donated pairs
    plan: IntraPlan
    sharded: ShardedFunction  # bound to its compiled executable
    example: tuple[Any, ...]  # ShapeDtypeStructs of the arguments
    in_shardings: tuple[Any, ...]  # NamedShardings of the arguments, same pytree
    donation: Donation  # flat indices of the arguments
    diagnostics: CompileDiagnostics
    batch: BatchInputs | None  # the batch leaves (None when the method needs none)


class SpmdFunction(ParallelizedFunction[_Compiled]):
    """A function planned and sharded per input signature over one logical mesh.

    Donated arguments (`donate_argnums`) already laid out as planned, e.g. the previous step's
    results, are consumed: their arrays are deleted by the call. Arguments that must first be
    moved to the planned layout (e.g. freshly made on one device) are copied, only the copy is
    donated, and the originals stay valid.
    """

    def __init__(self, fn: Callable[..., Any] | CallForm, method: SpmdMethod, devices: Sequence[Any] | None,
                 batch_argnums: tuple[int, ...] | None, donate_argnums: tuple[int, ...] | str = (),
                 costs: DeviceCosts | None = None) -> None:
        """`batch_argnums` and `donate_argnums` are slot indices (CallForm.slot)."""
        super().__init__(fn, method, devices, costs)
        self.batch_argnums, self.donate_argnums = batch_argnums, donate_argnums

    def _run(self, args: tuple[Any, ...]) -> Any:
        compiled = self._compiled(args)
        if compiled.donation.pairs:
            args = _copy_misplaced_donations(args, compiled)
        # Arguments committed elsewhere (e.g. the previous step's outputs, laid out as the plan
        # chose for outputs) are moved to the planned input layout; the executable rejects them.
        return compiled.sharded(*_place(args, compiled.in_shardings))

    def get_plan(self) -> IntraPlan:
        """The IntraPlan of the last call.

        Raises:
            OptionsError: the function has not been called yet.
        """
        return super().get_plan()

    def get_input_shardings(self) -> tuple[Any, ...]:
        """Where the last call's executable takes its arguments: NamedShardings in the arguments'
        pytree structure (place arguments there once to skip moving them on every call)."""
        return self._require_last().in_shardings

    def describe_batch(self) -> str:
        """The batch leaves of the last call, the dim split and why, e.g. "args[2] i32[8, 16] (dim 0),
        inferred: proved independent: ...; other candidates: ..."; "none" when the method splits
        no batch."""
        return _batch_text(self._require_last(), self.method)

    def _plan_of(self, compiled: _Compiled) -> IntraPlan:
        return compiled.plan

    def _debug_files(self, compiled: _Compiled) -> dict[str, DebugFile]:
        """graph.txt (captured graph, with donation aliases), plan.json (a one-stage Plan holding
        the IntraPlan), hlo.txt (compiled HLO), memory.txt (compiled.memory_analysis()), cost.json
        (compiled.cost_analysis()), shardings.txt (input and output shardings of the compiled
        function), diagnostics.json (involuntary full rematerializations XLA reported while
        compiling, with its messages; compile time; donated argument -> result pairs)."""
        executable = compiled.sharded.executable
        batch = (("batch", _batch_text(compiled, self.method)),) if self.method.splits_batch else ()
        plan = single_stage_plan(compiled.plan, "parallelize", self.__name__,
                                 options=(("method", type(self.method).__name__), *batch))
        return {"graph.txt": format_graph(compiled.captured.graph), "hlo.txt": executable.as_text(),
                "memory.txt": str(executable.memory_analysis()) + "\n", "shardings.txt": _shardings_text(executable),
                "plan.json": plan.to_dict(), "cost.json": _jsonable(executable.cost_analysis()),
                "diagnostics.json": _diagnostics(compiled)}

    def _build(self, args: tuple[Any, ...]) -> _Compiled:
        devices = list(self.devices) if self.devices is not None else jax.devices()
        shape = self.method.mesh(len(devices))
        captured = capture(self.fn, *args, name=self.__name__)
        batch = self._batch_inputs(captured)
        if self.method.splits_batch:
            captured = tag_batch_inputs(captured, batch.dims)
        donated_args = self._donated_positions(args, batch)
        self.costs.check_devices(len(devices), f"parallelize({self.__name__})")
        mesh = self.costs.mesh(shape)
        donation, plan = self._solve(captured, pair_donated(captured, self._donated_leaves(args, donated_args)), mesh)
        if self.donate_argnums != "auto":  # "auto" donates what can be donated, silently
            warn_not_donated(captured, donation, self.__name__, stacklevel=4)
        captured = alias_donated(captured, donation)
        jax_mesh = make_jax_mesh(mesh, devices if self.devices else None)
        example = shapes_of(args)
        sharded, diagnostics = execute_sharded(captured, plan, jax_mesh, donation.donated).compile(*example)
        warn_if_rematerialized(diagnostics, f"{self.__name__} on mesh {mesh.name}", stacklevel=4)
        specs = [NamedSharding(jax_mesh, partition_spec(placeable_spec(plan.strategy(n).output,
                                                                     captured.graph[n].shape, plan.mesh)))
                 for n in captured.input_nodes]
        return _Compiled(captured, plan, sharded, example, jax.tree_util.tree_unflatten(captured.in_tree, specs),
                         donation, diagnostics, batch)

    def _solve(self, captured: Captured, donation: Donation, mesh: LogicalMesh) -> tuple[Donation, IntraPlan]:
        """Plan with the donated pairs as aliases. When that is infeasible, drop the pairs that
        share no layout and retry, and last plan without any pair (an error then is not the
        donation's)."""
        options = self.method.options(self.costs)
        solve = lambda d: solve_intra(alias_donated(captured, d).graph, mesh, options)  # noqa: E731
        try:
            return donation, solve(donation)
        except InfeasiblePlanError:
            if not donation.pairs:
                raise
        pruned = drop_unplaceable(captured, donation, mesh, options)
        if pruned.pairs and pruned.pairs != donation.pairs:
            try:
                return pruned, solve(pruned)
            except InfeasiblePlanError:
                pass
        undonated = donation.without_pairs()
        return undonated, solve(undonated)

    def _batch_inputs(self, captured: Captured) -> BatchInputs | None:
        """The batch leaves, when the method splits them or "auto" donation must leave them out."""
        if not self.method.splits_batch and self.donate_argnums != "auto":
            return None
        batch = find_batch_inputs(captured, self.batch_argnums, self.__name__)
        if self.method.splits_batch:
            warn_if_unproven(batch, captured, self.__name__, stacklevel=5)
        if self.method.splits_batch and not batch.dims:
            raise OptionsError(
                f"{type(self.method).__name__} splits the batch, but no input of {self.__name__} looks like one: "
                "every input with a dim comes back updated, like weights or optimizer state; pass "
                "parallelize(..., batch_argnums=(i, ...)) with the positions of the batch arguments")
        return batch

    def _donated_positions(self, args: tuple[Any, ...], batch: BatchInputs | None) -> tuple[int, ...]:
        """Positions of the donated arguments."""
        if self.donate_argnums == "auto":
            return tuple(i for i in range(len(args)) if i not in batch.argnums)
        bad = [i for i in self.donate_argnums if not 0 <= i < len(args)]
        if bad:
            raise OptionsError(
                f"parallelize(..., donate_argnums={self.donate_argnums}): position(s) {bad} are out of range "
                f"for {self.__name__} called with {len(args)} argument(s); give positions 0..{len(args) - 1}")
        return tuple(self.donate_argnums)

    def _donated_leaves(self, args: tuple[Any, ...], positions: tuple[int, ...]) -> list[int]:
        """Flat leaf indices of the arguments at `positions`."""
        leaves, start = [], 0
        for position, arg in enumerate(args):
            count = len(jax.tree_util.tree_leaves(arg))
            if position in positions:
                leaves.extend(range(start, start + count))
            start += count
        return leaves


def _batch_text(compiled: _Compiled, method: SpmdMethod) -> str:
    """The batch the method splits and why (BatchInputs.explain); "none" when it splits none."""
    if compiled.batch is None or not method.splits_batch:
        return "none"
    return compiled.batch.explain(compiled.captured)


def _copy_misplaced_donations(ordered: tuple[Any, ...], compiled: _Compiled) -> tuple[Any, ...]:
    """Copy donated leaves that are not yet laid out as planned, so that only copies are donated.

    jax.device_put may share a buffer with its source even with may_alias=False (measured on
    JAX 0.10 CPU: one device -> replicated keeps device 0's buffer); donating the result would
    then delete an array the caller did not hand over laid out as planned.
    """
    flat, tree = jax.tree_util.tree_flatten(ordered)
    targets = jax.tree_util.tree_leaves(compiled.in_shardings)
    for i in compiled.donation.donated:
        if not _is_placed(flat[i], targets[i]):
            flat[i] = jax.numpy.array(flat[i], copy=True)
    return jax.tree_util.tree_unflatten(tree, flat)


def _place(args: tuple[Any, ...], shardings: Any) -> Any:
    """`args` laid out as `shardings`, moving only the leaves that are not yet: a decode step's
    weights are already in place, and a device_put of every leaf cost 8x the step itself."""
    flat, tree = jax.tree_util.tree_flatten(args)
    targets = jax.tree_util.tree_leaves(shardings)
    moving = [i for i, (x, s) in enumerate(zip(flat, targets, strict=True)) if not _is_placed(x, s)]
    for i, moved in zip(moving, jax.device_put([flat[i] for i in moving], [targets[i] for i in moving]), strict=True):
        flat[i] = moved
    return jax.tree_util.tree_unflatten(tree, flat)


def _is_placed(value: Any, sharding: Any) -> bool:
    if not isinstance(value, jax.Array):
        return False
    return value.sharding == sharding or value.sharding.is_equivalent_to(sharding, value.ndim)


def _diagnostics(compiled: _Compiled) -> dict[str, Any]:
    graph, captured = compiled.captured.graph, compiled.captured
    donated = [{"argument": graph[captured.input_nodes[a]].name, "result": r} for a, r in compiled.donation.pairs]
    not_donated = [{"argument": graph[captured.input_nodes[a]].name, "reason": "no result of its shape and dtype"}
                   for a in compiled.donation.unmatched]
    not_donated += [{"argument": graph[captured.input_nodes[a]].name, "reason": "no common layout with its result"}
                    for a in compiled.donation.unplaceable]
    return {**compiled.diagnostics.to_dict(), "donated": donated, "not_donated": not_donated}


def _shardings_text(compiled: Any) -> str:
    lines = [f"input {i}: {s}" for i, s in enumerate(jax.tree_util.tree_leaves(compiled.input_shardings))]
    lines += [f"output {i}: {s}" for i, s in enumerate(jax.tree_util.tree_leaves(compiled.output_shardings))]
    return "\n".join(lines) + "\n"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
