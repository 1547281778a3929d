"""A whole train step under PipeshardParallel: its gradient found, its loss pipelined, its update per stage.

`step(state, batch) -> (new_state, metrics)` computes its gradient with `jax.grad` or
`jax.value_and_grad` and applies its optimizer itself. Traced with the gradient calls marked
(runtime.gradient), the step falls into three parts:

* the *loss*: the marked loss jaxpr, with what the step computes for it beforehand from
  non-differentiated inputs (e.g. `ids[:, :-1]`) folded in front; traced again at micro-batch
  shapes and cut into layers (runtime.loss_layers) that the pipeline runs forward and backward
  per micro-batch, accumulating gradients; the program each micro-batch runs is rewritten so
  that the micro-batches' losses and gradients add up to the full batch's
  (runtime.micro_batching: means, sums, weighted means, dropout);
* the *update*: every equation after the gradient that the step's results need (optimizer,
  metrics), at full-batch shapes, run on the stages' devices: each equation goes to the stage
  that holds its largest input (a weight's gradient, its optimizer moments follow it),
  equations on values no stage holds (a step counter) follow their first consumer, and the
  equations are grouped into as few jitted pieces as their dependencies allow; the few scalars
  that cross stages (a shared step count, a global gradient norm) are handed off
  (runtime.handoff: `device_put` in one process, a jitted program across processes);
* a weight read by layers of several stages (tied embeddings) gets each stage's gradient,
  summed on the first such stage (its *owner*) before the update, which runs there.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.errors import OptionsError
from meshplan.launch.progress import building
from meshplan.runtime.gradient import GradientCall, gradient_calls, nested_gradient, trace_with_gradients
from meshplan.runtime.handoff import absent, is_multi_process, move, owns, settled
from meshplan.runtime.replay import read, replay


@dataclass(frozen=True, slots=True)
class TracedStep:
    """A step traced with its gradient marked.

    Attributes:
        closed: the step's jaxpr (flat step inputs), the gradient as one equation.
        out_tree: the step's result structure.
        gradient: the gradient equation.
        differentiated: the step inputs (flat positions) the gradient is taken for, in the
            order of the gradient equation's results.
    """

    closed: ClosedJaxpr
    out_tree: Any
    gradient: GradientCall
    differentiated: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LossProgram:
    """The loss as a jaxpr of step inputs.

    Attributes:
        closed: the loss jaxpr (prelude folded in), inputs `inputs` of the step.
        inputs: flat step input positions of its inputs, in order.
        weights: positions (into `inputs`) of the differentiated ones.
    """

    closed: ClosedJaxpr
    inputs: tuple[int, ...]
    weights: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class UpdatePiece:
    """Equations of the update run as one jitted function on one stage's devices."""

    stage: int
    eqns: tuple[Any, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]


def trace_step(fn: Any, args: Sequence[Any], name: str) -> TracedStep | None:
    """Trace `fn(*args)` with its gradient marked; None when it computes no gradient.

    Raises:
        OptionsError: several gradients, a gradient inside a nested `jax.jit`, or a gradient
            with respect to something that is not a step argument.
    """
    closed, out_shape = trace_with_gradients(fn, args)
    calls = gradient_calls(closed.jaxpr)
    if not calls:
        inner = nested_gradient(closed.jaxpr)
        if inner is not None:
            raise OptionsError(f"{name} computes its gradient inside a nested `{inner}` (e.g. a jax.jit inside the "
                               f"step); PipeshardParallel needs jax.grad/jax.value_and_grad at the step's top level: "
                               f"drop the inner jax.jit (parallelize compiles the step)")
        return None
    if len(calls) > 1:
        raise OptionsError(f"{name} computes {len(calls)} gradients (jax.grad/jax.value_and_grad calls); "
                           f"PipeshardParallel pipelines a step with one: take one gradient of the summed loss")
    call = calls[0]
    eqn = closed.jaxpr.eqns[call.index]
    position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    differentiated = []
    for v, d in zip(eqn.invars, call.differentiated, strict=True):
        if not d:
            continue
        if isinstance(v, Literal) or v not in position:
            raise OptionsError(f"{name} differentiates with respect to a value it computes ({v.aval.str_short()}); "
                               f"PipeshardParallel needs the gradient taken with respect to step arguments "
                               f"(the weights as passed in): move that computation into the loss function")
        differentiated.append(position[v])
    if len(set(differentiated)) != len(differentiated):
        raise OptionsError(f"{name} differentiates with respect to one argument twice; pass each weight once")
    return TracedStep(closed, jax.tree_util.tree_structure(out_shape), call, tuple(differentiated))


def same_gradient(full: TracedStep, micro: TracedStep, name: str) -> None:
    """Raise unless the step traced at micro-batch shapes takes the same gradient as at full shapes."""
    if (full.differentiated != micro.differentiated or full.gradient.differentiated != micro.gradient.differentiated
            or full.gradient.num_aux != micro.gradient.num_aux):
        raise OptionsError(f"{name} takes a different gradient when its batch is cut into micro-batches; "
                           f"PipeshardParallel needs a step whose structure does not depend on the batch size")


def loss_program(step: TracedStep, name: str) -> LossProgram:
    """The gradient's loss (and aux values) as a jaxpr of step inputs, with the equations computing its
    non-differentiated operands (from step inputs) folded in front.

    Raises:
        OptionsError: a folded equation reads a differentiated input (its effect on the
            gradient would be lost).
    """
    jaxpr = step.closed.jaxpr
    eqn = jaxpr.eqns[step.gradient.index]
    prelude = _ancestors(jaxpr, step.gradient.index)
    weights = {jaxpr.invars[i] for i in step.differentiated}
    for i in prelude:
        read_weights = [v for v in jaxpr.eqns[i].invars if not isinstance(v, Literal) and v in weights]
        if read_weights:
            raise OptionsError(f"{name} computes `{jaxpr.eqns[i].primitive.name}` of a weight it differentiates "
                               f"before taking the gradient and passes the result to the loss; JAX does not "
                               f"differentiate through it, and PipeshardParallel cannot cut it: do that inside the "
                               f"loss function")
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    read_vars = [v for i in prelude for v in jaxpr.eqns[i].invars] + list(eqn.invars)
    inputs = tuple(sorted({position[v] for v in read_vars if not isinstance(v, Literal) and v in position}))
    consts = dict(zip(jaxpr.constvars, step.closed.consts, strict=True))
    prelude_eqns = [jaxpr.eqns[i] for i in prelude]

    def loss(*values: Any) -> Any:
        env = replay(prelude_eqns, {**consts, **{jaxpr.invars[i]: v for i, v in zip(inputs, values, strict=True)}})
        return jaxpr_as_fun(step.gradient.loss)(*(read(env, v) for v in eqn.invars))  # the loss, then aux values

    closed = jax.make_jaxpr(loss)(*(jax.ShapeDtypeStruct(jaxpr.invars[i].aval.shape, jaxpr.invars[i].aval.dtype)
                                    for i in inputs))
    return LossProgram(closed, inputs, tuple(inputs.index(i) for i in step.differentiated))


def _ancestors(jaxpr: Any, index: int) -> list[int]:
    """Indices of the equations before `index` whose results it needs, in order."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns[:index]) for v in e.outvars}
    needed, stack = set(), [v for v in jaxpr.eqns[index].invars if not isinstance(v, Literal)]
    while stack:
        i = producer.get(stack.pop())
        if i is not None and i not in needed:
            needed.add(i)
            stack.extend(v for v in jaxpr.eqns[i].invars if not isinstance(v, Literal))
    return sorted(needed)


def update_pieces(step: TracedStep, homes: dict[Any, int]) -> tuple[UpdatePiece, ...]:
    """The equations after the gradient that the step's results need, grouped into pieces per stage.

    Args:
        step: the traced step (full-batch shapes).
        homes: the stage of each value that has one (weights, their gradients, the loss).
    """
    jaxpr = step.closed.jaxpr
    order = _needed(jaxpr, step.gradient.index)
    stage_of = _eqn_stages(jaxpr, order, dict(homes))
    groups = _grouped(jaxpr, order, stage_of)
    later_reads: list[set[Any]] = []
    reads: set[Any] = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    for _, eqns in reversed(groups):
        later_reads.append(set(reads))
        reads |= {v for i in eqns for v in jaxpr.eqns[i].invars if not isinstance(v, Literal)}
    later_reads.reverse()
    pieces = []
    consts = set(jaxpr.constvars)
    for (stage, eqns), later in zip(groups, later_reads, strict=True):
        defined = [v for i in eqns for v in jaxpr.eqns[i].outvars]
        own = set(defined)
        inputs = _unique(v for i in eqns for v in jaxpr.eqns[i].invars
                         if not isinstance(v, Literal) and v not in own and v not in consts)
        pieces.append(UpdatePiece(stage, tuple(jaxpr.eqns[i] for i in eqns), tuple(inputs),
                                  tuple(v for v in defined if v in later)))
    return tuple(pieces)


def _needed(jaxpr: Any, gradient: int) -> list[int]:
    """Indices of the equations (not the gradient) the step's results need, in order."""
    needed_vars = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    order = []
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if i == gradient or not any(v in needed_vars for v in eqn.outvars):
            continue
        order.append(i)
        needed_vars.update(v for v in eqn.invars if not isinstance(v, Literal))
    return order[::-1]


def _eqn_stages(jaxpr: Any, order: list[int], homes: dict[Any, int]) -> dict[int, int]:
    """Each equation's stage: that of its largest input with a stage; else its first consumer's; else 0."""
    stage_of: dict[int, int] = {}
    for i in order:
        eqn = jaxpr.eqns[i]
        placed = [(_bytes(v.aval), -homes[v]) for v in eqn.invars if not isinstance(v, Literal) and v in homes]
        if placed:
            stage_of[i] = -max(placed)[1]
            homes.update((v, stage_of[i]) for v in eqn.outvars)
    consumers: dict[Any, list[int]] = {}
    for i in order:
        for v in jaxpr.eqns[i].invars:
            if not isinstance(v, Literal):
                consumers.setdefault(v, []).append(i)
    for i in reversed(order):
        if i in stage_of:
            continue
        after = [stage_of[j] for v in jaxpr.eqns[i].outvars for j in consumers.get(v, ()) if j in stage_of]
        stage_of[i] = after[0] if after else 0
    return stage_of


def _grouped(jaxpr: Any, order: list[int], stage_of: dict[int, int]) -> list[tuple[int, list[int]]]:
    """A topological order of `order` that stays on one stage as long as it can, as runs per stage."""
    producer = {v: i for i in order for v in jaxpr.eqns[i].outvars}
    waiting = {i: {producer[v] for v in jaxpr.eqns[i].invars if not isinstance(v, Literal) and v in producer}
               for i in order}
    users: dict[int, list[int]] = {}
    for i, deps in waiting.items():
        for d in deps:
            users.setdefault(d, []).append(i)
    ready = [i for i in order if not waiting[i]]
    groups: list[tuple[int, list[int]]] = []
    while ready:
        stage = groups[-1][0] if groups and any(stage_of[i] == groups[-1][0] for i in ready) else stage_of[min(ready)]
        if not groups or groups[-1][0] != stage:
            groups.append((stage, []))
        i = min(j for j in ready if stage_of[j] == stage)
        ready.remove(i)
        groups[-1][1].append(i)
        for u in users.get(i, ()):
            waiting[u].discard(i)
            if not waiting[u]:
                ready.append(u)
    return groups


def _unique(values: Any) -> list[Any]:
    seen: dict[Any, None] = {}
    for v in values:
        seen.setdefault(v, None)
    return list(seen)


def _bytes(aval: Any) -> float:
    try:
        return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)
    except TypeError:
        return 0.0


# --- execution ------------------------------------------------------------------------------------

class UpdateRunner:
    """Runs the update pieces on their stages' meshes; jitted functions are built once.

    `donated` step inputs (flat positions; the caller handed their buffers over) are donated to
    the last piece that reads them, each paired with the first result of that piece of its shape
    and dtype that no earlier input took (jax.jit's own rule): the new weights and optimizer state
    are written into the old ones' buffers. A donated input that the step returns as it is, or
    that no piece result can take, is not donated (`not_donated`).
    """

    def __init__(self, step: TracedStep, pieces: Sequence[UpdatePiece], meshes: Sequence[Mesh],
                 donated: Sequence[int] = ()) -> None:
        self.step, self.pieces, self.meshes = step, tuple(pieces), tuple(meshes)
        jaxpr = step.closed.jaxpr
        self._consts = {v: _host(c) for v, c in zip(jaxpr.constvars, step.closed.consts, strict=True)}
        self.donations = _donations(step, self.pieces, donated)
        taken = {jaxpr.invars.index(piece.inputs[i]) for piece, d in zip(self.pieces, self.donations, strict=True)
                 for i in d}
        self.not_donated = tuple(sorted(set(donated) - taken))
        self._fns = tuple(self._piece_fn(p) for p in self.pieces)
        self._jitted: dict[tuple[int, Any], Any] = {}
        self._last_inputs: dict[int, list[jax.ShapeDtypeStruct]] = {}

    def compiled_piece(self, n: int) -> Any:
        """Piece n compiled for the inputs of the last call (its HLO shows the buffers it aliases)."""
        inputs = self._last_inputs[n]
        return self._jit(n, inputs).lower(*inputs).compile()

    def _jit(self, n: int, inputs: Sequence[Any]) -> Any:
        """Piece n jitted; a result that takes a donated input's buffer is laid out as that input
        (XLA reuses a buffer only for the same layout, and the next step finds the value in place).
        In a job of several processes every result's layout is declared (`_declared_shardings`)."""
        key = self._key(n, inputs)
        if key not in self._jitted:
            out = self._declared_shardings(n, inputs)
            self._jitted[key] = jax.jit(self._fns[n], donate_argnums=tuple(self.donations[n]),
                                        out_shardings=tuple(out))
        return self._jitted[key]

    def _key(self, n: int, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """What piece n's jitted function depends on besides the piece: its inputs' layouts."""
        return (n, tuple(inputs[i].sharding for i in self.donations[n]) if not is_multi_process()
                else tuple(x.sharding for x in inputs))

    def _declared_shardings(self, n: int, inputs: Sequence[Any]) -> list[Any]:
        """Piece n's result layouts: a donated input's for the result taking its buffer; in a job of
        several processes, where every process must know each result's layout without running the
        piece, the first input of the same shape and dtype's for the others, else replicated."""
        piece, donated = self.pieces[n], self.donations[n]
        out: list[Any] = [None] * len(piece.outputs)
        for i, j in donated.items():
            out[j] = inputs[i].sharding
        if is_multi_process():
            whole = NamedSharding(self.meshes[piece.stage], PartitionSpec())
            for j, v in enumerate(piece.outputs):
                if out[j] is None:
                    out[j] = next((x.sharding for x, u in zip(inputs, piece.inputs, strict=True)
                                   if _same_aval(u.aval, v.aval)), whole)
        return out

    def _piece_fn(self, piece: UpdatePiece) -> Any:
        consts = self._consts

        def run(*values: Any) -> tuple[Any, ...]:
            env = replay(piece.eqns, {**consts, **dict(zip(piece.inputs, values, strict=True))})
            return tuple(env[v] for v in piece.outputs)

        return run

    def __call__(self, env: dict[Any, Any]) -> Any:
        """The step's results, from `env` holding its inputs and the gradient's results."""
        for n, (piece, donated) in enumerate(zip(self.pieces, self.donations, strict=True)):
            mesh = self.meshes[piece.stage]
            inputs = [on_mesh(_own_copy(env[v], mesh) if i in donated else env[v], mesh)
                      for i, v in enumerate(piece.inputs)]
            self._last_inputs[n] = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in inputs]
            if owns(mesh):
                fresh = self._key(n, inputs) not in self._jitted
                with building() if fresh else contextlib.nullcontext():  # compiles: for the hang watch
                    values = settled(self._jit(n, inputs)(*inputs))
            else:  # another process's piece: its results' layouts only
                values = [absent(v.aval.shape, v.aval.dtype, where) for v, where in
                          zip(piece.outputs, self._declared_shardings(n, inputs), strict=True)]
            env.update(zip(piece.outputs, (on_mesh(v, mesh) for v in values), strict=True))
        jaxpr = self.step.closed.jaxpr
        outs = [v.val if isinstance(v, Literal) else self._consts[v] if v in self._consts else env[v]
                for v in jaxpr.outvars]
        return jax.tree_util.tree_unflatten(self.step.out_tree, outs)


def _donations(step: TracedStep, pieces: Sequence[UpdatePiece], donated: Sequence[int]) -> list[dict[int, int]]:
    """Per piece, {input position: result position} of the donated inputs it consumes and the
    results written into their buffers (see UpdateRunner)."""
    jaxpr = step.closed.jaxpr
    returned = {v: k for k, v in reversed(list(enumerate(jaxpr.outvars))) if not isinstance(v, Literal)}
    candidates = {jaxpr.invars[i] for i in donated} - set(returned)
    last_reader = {v: n for n, piece in enumerate(pieces) for v in piece.inputs if v in candidates}
    result = []
    for n, piece in enumerate(pieces):  # the step's results first, in its result order (jit's rule on the step)
        free = sorted(range(len(piece.outputs)), key=lambda j: (returned.get(piece.outputs[j], len(returned)), j))
        taken = {}
        for i, v in enumerate(piece.inputs):
            if last_reader.get(v) != n:
                continue
            match = next((j for j in free if _same_aval(piece.outputs[j].aval, v.aval)), None)
            if match is not None:
                free.remove(match)
                taken[i] = match
        result.append(taken)
    return result


def _same_aval(a: Any, b: Any) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _own_copy(value: Any, mesh: Mesh) -> Any:
    """`value` itself when it is on `mesh` (the caller's donated array: consumed), else a copy,
    so that donating it never deletes an array the caller did not hand over (jax.device_put may
    keep the source's buffer: JAX 0.10 CPU, one device -> replicated)."""
    sharding = getattr(value, "sharding", None)
    if sharding is not None and sharding.device_set == set(mesh.devices.flat):
        return value
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return value  # on another process's devices: the hand-off makes new buffers
    return jnp.array(value, copy=True)


def on_mesh(value: Any, mesh: Mesh) -> Any:
    """`value` where it is when on `mesh`'s devices, else a replicated copy there."""
    sharding = getattr(value, "sharding", None)
    if sharding is not None and sharding.device_set == set(mesh.devices.flat):
        return value
    return move(value, NamedSharding(mesh, PartitionSpec()))


def _host(value: Any) -> Any:
    try:
        return np.asarray(value)
    except TypeError:
        return value


_add = jax.jit(jnp.add)


def summed(contributions: Sequence[Any]) -> Any:
    """The sum of one weight's gradient contributions, on the first one's devices and layout."""
    total = contributions[0]
    for c in contributions[1:]:
        c = move(c, total.sharding)
        if not is_multi_process():
            total = _add(total, c)
        elif owns(total.sharding):
            total = settled(move(_add(total, c), total.sharding))
    return total
