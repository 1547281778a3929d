"""Exact micro-batching: a program at full and at micro-batch shapes -> the program each micro-batch runs.

A pipeline runs a step's loss (or a whole forward step) once per micro-batch. Averaging the
micro-batches' losses is exact only for a plain mean over examples; a sum, a mean over the
non-padding tokens `sum(l * mask) / sum(mask)`, a regularizer added to a mean, an integer count
among the metrics or a dropout mask each need their own rule. This module finds the rule by
comparing the program traced at full-batch and at micro-batch shapes equation by equation (the
two traces have the same equations; a dim that is `count` times longer at full shapes carries
the batch) and gives every value a kind:

* EXAMPLES: it carries the batch along those dims; micro-batch m holds rows m of the full value.
* SUM: a sum over examples (`reduce_sum` or `dot_general` over every batch dim of a value that
  depends on the weights), then linear steps (+, -, scaling by a value that is the same in every
  micro-batch): the full value is the sum of the micro-batches' values.
* SAME: it does not depend on the batch (weights, literals, a step count, a random key).
* STATISTIC: it depends on the batch but not on the weights and has no batch dim (the number of
  non-padding tokens `sum(mask)`; the element count jnp.mean divides by, a literal `count` times
  larger at full shapes): computed once from the full batch before the pipeline runs, and every
  micro-batch reads that value. So `sum(l * mask) / sum(mask)` becomes the SUM
  `sum(l_m * mask_m) / D`, D the full batch's denominator: the micro-batches' values add up to
  the full loss, and, since D does not depend on the weights, so do their gradients.
* MIXED: anything else that depends on the weights and the batch (a max over the batch, a
  product of two sums, a division by a weight-dependent value, batch statistics of
  activations); refused with the construct named when it reaches a result.

The program each micro-batch runs (`MicroProgram.closed`) reads the statistics as extra inputs,
adds a SAME term to a SUM (a regularizer) in micro-batch 0 only, and draws random values created
along the batch (dropout masks) as rows of the full batch's draw (runtime.random_rows). Results
are rebuilt from micro-batches by their rule: SUM summed, EXAMPLES joined along the batch dim,
SAME or STATISTIC taken once. The first result of a loss is always a SUM, so the pipeline sums
the micro-batches' losses and seeds every backward with 1.

What this module does not prove: that EXAMPLES values keep examples apart (no op mixes rows
along a batch dim before the final sum); that is the batch dim's own property, checked where the
batch is found (meshplan.capture.batch).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from meshplan.errors import OptionsError
from meshplan.runtime.random_rows import RANDOM_DRAWS, counter_based, draw_rows
from meshplan.runtime.replay import inline_calls, read, replay, source_of

try:  # private in JAX 0.10: names the user's source line in refusals
    from jax._src.source_info_util import summarize as _summarize
except ImportError:  # pragma: no cover
    _summarize = None


class Kind(enum.Enum):
    """How a value of the program relates to the micro-batches (see the module docstring)."""

    SAME = "same"
    EXAMPLES = "examples"
    SUM = "sum"
    STATISTIC = "statistic"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class Rule:
    """How one result of the program is rebuilt from its micro-batches' values.

    Attributes:
        how: "sum" (add them), "join" (concatenate along `dim`) or "same" (every micro-batch
            has the full value: take one).
        dim: the batch dim of a joined result.
    """

    how: str
    dim: int | None = None


@dataclass(frozen=True, slots=True)
class MicroProgram:
    """The program one micro-batch runs, and how its results make the full batch's.

    Attributes:
        closed: at micro-batch shapes; inputs: the program's, then the statistics, then (when
            `indexed`) the micro-batch's index as an int32 scalar.
        rules: per result, how the full value is rebuilt.
        statistics: at full shapes, the statistics from the program inputs at positions
            `statistic_inputs`; None when there are none.
        statistic_inputs: positions (into the program's inputs) that `statistics` reads.
        indexed: whether `closed` takes the micro-batch index.
        is_mean: whether the mean of the micro-batches' first results as traced (without this
            rewrite) is already the full batch's: a mean over examples, as Alpa assumes.
    """

    closed: ClosedJaxpr
    rules: tuple[Rule, ...]
    statistics: ClosedJaxpr | None
    statistic_inputs: tuple[int, ...]
    indexed: bool
    is_mean: bool = False

    @property
    def num_statistics(self) -> int:
        """How many statistics `closed` reads after the program's inputs."""
        return 0 if self.statistics is None else len(self.statistics.out_avals)


@dataclass(frozen=True, slots=True)
class _Value:
    kind: Kind
    weighted: bool  # depends on the weights
    dims: tuple[int, ...] = ()  # the dims that carry the batch (EXAMPLES)
    reason: str = ""  # MIXED: the construct that made it so
    counts: int = 0  # SUM: divisions by the batch's element count on every way here (-1: not the same on all)


_LINEAR = frozenset({"neg", "reduce_sum", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                     "copy", "copy_p", "slice", "reduce_precision", "convert_element_type"})
_ADDS = frozenset({"add", "sub", "add_any"})


def micro_batch_program(full: ClosedJaxpr, micro: ClosedJaxpr, weights: Sequence[int], count: int, what: str,
                        loss: bool = True) -> MicroProgram:
    """The program each of `count` micro-batches runs so that its results rebuild `full`'s exactly.

    Args:
        full: the program at full-batch shapes.
        micro: the same program traced at micro-batch shapes (batch inputs `count` times shorter).
        weights: positions of the inputs that are weights (differentiated, or a forward step's
            parameters): values computed from them are never precomputed as statistics.
        count: the number of micro-batches.
        what: the program's name in messages (e.g. "train_step's loss").
        loss: the first result is a loss, whose micro-batch values must sum to the full loss.

    Raises:
        OptionsError: the traces differ in structure, or a result cannot be rebuilt exactly.
    """
    full, micro = inline_calls(full), inline_calls(micro)
    _check_aligned(full.jaxpr, micro.jaxpr, what)
    analysis = _Analysis(full, micro, frozenset(weights), count, what)
    analysis.run()
    is_mean = loss and analysis.is_mean()
    rules = analysis.output_rules(loss)
    statistics, inputs = analysis.statistics_program()
    return MicroProgram(analysis.rewritten(loss), rules, statistics, inputs, analysis.indexed, is_mean)


def _check_aligned(full: Any, micro: Any, what: str) -> None:
    names = lambda j: [e.primitive.name for e in j.eqns]  # noqa: E731
    if (names(full) != names(micro) or len(full.invars) != len(micro.invars)
            or len(full.constvars) != len(micro.constvars) or len(full.outvars) != len(micro.outvars)):
        raise OptionsError(f"{what} traces to different programs at full-batch and micro-batch shapes (e.g. a "
                           f"Python branch on the batch size); PipeshardParallel needs a program whose operations do "
                           f"not depend on the batch size")


def scaled_dims(full_aval: Any, micro_aval: Any, count: int) -> tuple[int, ...] | None:
    """The dims that are `count` times longer at full shapes; None when the shapes disagree otherwise."""
    a, b = tuple(getattr(full_aval, "shape", ())), tuple(getattr(micro_aval, "shape", ()))
    if len(a) != len(b):
        return None
    dims = tuple(d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return dims if all(a[d] == count * b[d] for d in dims) else None


@dataclass(slots=True)
class _Analysis:
    """Kinds of the values of `micro` (aligned with `full` equation by equation), and the rewrite
    they call for: operands read as full-batch values, terms kept in micro-batch 0, draws by rows."""

    full: ClosedJaxpr
    micro: ClosedJaxpr
    weights: frozenset[int]
    count: int
    what: str
    values: dict[Any, _Value] = field(default_factory=dict)
    full_var: dict[Any, Any] = field(default_factory=dict)  # micro var -> full var
    fixed: dict[tuple[int, int], Any] = field(default_factory=dict)  # (eqn, operand) -> full value (literal/const)
    read_statistic: dict[tuple[int, int], Any] = field(default_factory=dict)  # (eqn, operand) -> micro var
    statistic_vars: list[Any] = field(default_factory=list)  # micro vars read as statistics, in input order
    first_only: set[tuple[int, int]] = field(default_factory=set)  # SAME operands of a SUM, kept in micro-batch 0
    draws: dict[int, tuple[tuple[int, ...], int, bool]] = field(default_factory=dict)  # eqn -> shape, dim, counters
    indexed: bool = False

    # --- kinds ------------------------------------------------------------------------------------

    def run(self) -> None:
        full, micro = self.full.jaxpr, self.micro.jaxpr
        for pos, (f, m) in enumerate(zip(full.invars, micro.invars, strict=True)):
            self.full_var[m] = f
            dims = self._dims(f.aval, m.aval, f"input {pos}")
            if dims and pos in self.weights:
                raise OptionsError(f"{self.what}: weight input {pos} ({f.aval.str_short()}) is cut into micro-batches "
                                   f"along dims {dims}, as if it were the batch; pass parallelize(..., "
                                   f"batch_argnums=...) with the positions of the batch arguments")
            self.values[m] = _Value(Kind.EXAMPLES if dims else Kind.SAME, pos in self.weights, dims)
        for f, m, fc, mc in zip(full.constvars, micro.constvars, self.full.consts, self.micro.consts, strict=True):
            self.full_var[m] = f
            if np.shape(fc) != np.shape(mc):
                raise OptionsError(f"{self.what} closes over an array whose shape depends on the batch size "
                                   f"({m.aval.str_short()} at micro-batch shapes); compute it inside the step")
            self.values[m] = _Value(Kind.SAME if _equal(fc, mc) else Kind.STATISTIC, False)
        for i, (f, m) in enumerate(zip(full.eqns, micro.eqns, strict=True)):
            self.full_var.update(zip(m.outvars, f.outvars, strict=True))
            self._eqn(i, f, m)

    def _dims(self, full_aval: Any, micro_aval: Any, where: str) -> tuple[int, ...]:
        dims = scaled_dims(full_aval, micro_aval, self.count)
        if dims is None:
            raise OptionsError(f"{self.what}: {where} has shape {tuple(full_aval.shape)} at full-batch shapes and "
                               f"{tuple(micro_aval.shape)} per micro-batch, not {self.count} times longer along the "
                               f"batch; PipeshardParallel needs values whose shape changes only along the batch")
        return dims

    def _operand(self, full_var: Any, micro_var: Any) -> _Value:
        if isinstance(micro_var, Literal):
            if _equal(full_var.val, micro_var.val):
                return _Value(Kind.SAME, False)
            return _Value(Kind.STATISTIC, False)  # a count literal: fixed to the full value where read
        return self.values[micro_var]

    def _eqn(self, i: int, f: Any, m: Any) -> None:
        ins = [self._operand(fv, mv) for fv, mv in zip(f.invars, m.invars, strict=True)]
        outs = [self._dims(fv.aval, mv.aval, f"`{m.primitive.name}`'s result{_at(m)}")
                for fv, mv in zip(f.outvars, m.outvars, strict=True)]
        result = self._kinds(i, f, m, ins, outs)
        self.values.update(zip(m.outvars, result, strict=True))

    def _kinds(self, i: int, f: Any, m: Any, ins: list[_Value], outs: list[tuple[int, ...]]) -> list[_Value]:
        weighted = any(v.weighted for v in ins)
        mixed = next((v for v in ins if v.kind is Kind.MIXED), None)
        if mixed is not None:
            return [_Value(Kind.MIXED, weighted, d, mixed.reason) for d in outs]
        batchy = any(v.kind is not Kind.SAME for v in ins)
        if not weighted and not any(outs):  # a function of the batch alone: computed once at full shapes
            return [_Value(Kind.STATISTIC if batchy else Kind.SAME, False) for _ in outs]
        self._fix_statistics(i, f.invars, m.invars, ins)  # read from here on as full-batch values: SAME
        ins = [_Value(Kind.SAME, v.weighted) if v.kind is Kind.STATISTIC else v for v in ins]
        if all(outs):
            return self._examples(i, f, m, ins, outs, weighted)
        if any(outs):
            return [_Value(Kind.MIXED, weighted, d, self._reason(m, "mixes the batch into results without it"))
                    for d in outs]
        if any(v.kind is Kind.EXAMPLES for v in ins):
            return [self._reduction(m, ins)] * len(outs)
        if any(v.kind is Kind.SUM for v in ins):
            return [self._linear(i, m, ins)] * len(outs)
        return [_Value(Kind.SAME, True) for _ in outs]

    def _examples(self, i: int, f: Any, m: Any, ins: list[_Value], outs: list[tuple[int, ...]],
                  weighted: bool) -> list[_Value]:
        if any(v.kind is Kind.SUM for v in ins):
            reason = self._reason(m, "uses a sum over the batch of weight-dependent values per example "
                                     "(batch statistics of activations, e.g. BatchNorm in training mode)")
            return [_Value(Kind.MIXED, weighted, d, reason) for d in outs]
        if m.primitive.name in RANDOM_DRAWS and not ins[0].dims:
            return [self._draw(i, f, m, outs[0], weighted)]
        return [_Value(Kind.EXAMPLES, weighted, d) for d in outs]

    def _draw(self, i: int, f: Any, m: Any, dims: tuple[int, ...], weighted: bool) -> _Value:
        key_rank = len(m.invars[0].aval.shape)
        if len(dims) != 1:
            return _Value(Kind.MIXED, weighted, dims, self._reason(m, "draws random values along several batch dims"))
        self.draws[i] = (tuple(f.params["shape"]), dims[0] - key_rank, counter_based(m))
        self.indexed = True
        return _Value(Kind.EXAMPLES, weighted, dims)

    def _reduction(self, m: Any, ins: list[_Value]) -> _Value:
        name = m.primitive.name
        if name == "reduce_sum" and set(ins[0].dims) <= set(m.params["axes"]):
            return _Value(Kind.SUM, True)
        if name == "dot_general" and all(v.kind is not Kind.SUM for v in ins):
            contracting, _ = m.params["dimension_numbers"]
            if all(set(v.dims) <= set(c) for v, c in zip(ins, contracting, strict=True)):
                return _Value(Kind.SUM, True)
        return _Value(Kind.MIXED, True, (), self._reason(m, "over the batch of a value computed from the weights "
                                                            "(only sums over examples add up across micro-batches)"))

    def _linear(self, i: int, m: Any, ins: list[_Value]) -> _Value:
        name, sums = m.primitive.name, [v.kind is Kind.SUM for v in ins]
        ok = ((name in _LINEAR and len(ins) == 1 and _keeps_sum(m))
              or name in _ADDS
              or (name in ("mul", "dot_general") and sum(sums) == 1)
              or (name == "div" and sums == [True, False])
              or (name == "concatenate" and all(sums))
              or (name == "select_n" and not sums[0] and all(sums[1:])))
        if not ok:
            return _Value(Kind.MIXED, True, (), self._reason(m, "applied to a sum over the batch (the micro-batches' "
                                                                "values would not add up to the full batch's)"))
        if name in _ADDS:
            self.first_only.update((i, j) for j, s in enumerate(sums) if not s)
            self.indexed |= not all(sums)
        counts = {v.counts for v in ins if v.kind is Kind.SUM}
        divided = name == "div" and self._is_count(i, 1, m)
        return _Value(Kind.SUM, True, counts=counts.pop() + divided if len(counts) == 1 and -1 not in counts else -1)

    def _is_count(self, i: int, j: int, m: Any) -> bool:
        """Operand j of equation i is an element count of the batch: a literal `count` times larger at full shapes."""
        var = m.invars[j]
        return ((i, j) in self.fixed and isinstance(var, Literal) and np.ndim(var.val) == 0
                and np.isclose(float(self.fixed[(i, j)]), self.count * float(var.val)))

    def _fix_statistics(self, i: int, full_vars: Sequence[Any], micro_vars: Sequence[Any],
                        ins: Sequence[_Value]) -> None:
        """Operands `ins` of equation `i` (or of the results, i = len(eqns)) that are statistics are
        read as the full batch's values from here on: literals and constants fixed, others inputs."""
        for j, (v, full_var, var) in enumerate(zip(ins, full_vars, micro_vars, strict=True)):
            if v.kind is not Kind.STATISTIC:
                continue
            if isinstance(var, Literal):
                self.fixed[(i, j)] = full_var.val
            elif var in self.micro.jaxpr.constvars:
                self.fixed[(i, j)] = self._full_const(var)
            else:
                self.read_statistic[(i, j)] = var
                if var not in self.statistic_vars:
                    self.statistic_vars.append(var)

    def _full_const(self, var: Any) -> Any:
        consts = dict(zip(self.full.jaxpr.constvars, self.full.consts, strict=True))
        return consts[self.full_var[var]]

    def _reason(self, m: Any, text: str) -> str:
        return f"`{m.primitive.name}`{_at(m)} {text}"

    # --- results ----------------------------------------------------------------------------------

    def is_mean(self) -> bool:
        """Whether averaging the micro-batches' first results (as they are traced) gives the full
        batch's: a mean over examples (a sum over the batch divided once, on every way, by the
        batch's element count), plus terms that do not depend on the batch; no statistics and no
        draws along the batch."""
        if self.statistic_vars or self.draws:
            return False
        value = self._operand(self.full.jaxpr.outvars[0], self.micro.jaxpr.outvars[0])
        return value.kind is Kind.SAME or (value.kind is Kind.SUM and value.counts == 1)

    def output_rules(self, loss: bool) -> tuple[Rule, ...]:
        jaxpr, end = self.micro.jaxpr, len(self.micro.jaxpr.eqns)
        rules = []
        for j, var in enumerate(jaxpr.outvars):
            value = self._operand(self.full.jaxpr.outvars[j], var)
            if value.kind is Kind.MIXED:
                raise OptionsError(self._refusal(j, loss, value.reason))
            if value.kind is Kind.STATISTIC:
                only = [value if k == j else _Value(Kind.SAME, False) for k in range(len(jaxpr.outvars))]
                self._fix_statistics(end, self.full.jaxpr.outvars, jaxpr.outvars, only)
            if loss and j == 0 and value.kind is not Kind.SUM:
                self.first_only.add((end, 0))  # a loss that does not depend on the batch: counted once
                self.indexed = True
            if value.kind is Kind.SUM or (loss and j == 0):
                rules.append(Rule("sum"))
            elif value.kind is Kind.EXAMPLES:
                if len(value.dims) != 1:
                    raise OptionsError(self._refusal(j, loss, f"a result carrying the batch along dims {value.dims}"))
                rules.append(Rule("join", value.dims[0]))
            else:
                rules.append(Rule("same"))
        return tuple(rules)

    def _refusal(self, j: int, loss: bool, reason: str) -> str:
        result = "its loss" if loss and j == 0 else f"result {j}" + (" (an aux value)" if loss else "")
        return (f"{self.what}: {result} cannot be rebuilt exactly from micro-batches: {reason}. PipeshardParallel "
                f"rebuilds values per example (joined along the batch), sums over examples (added up), values that do "
                f"not depend on the batch, and sums scaled by values that do not depend on the weights (a mean, "
                f"sum(l * mask) / sum(mask)); write the loss and metrics in these forms, or use num_micro_batches=1")

    def statistics_program(self) -> tuple[ClosedJaxpr | None, tuple[int, ...]]:
        """The statistics at full shapes, from the program inputs they need."""
        if not self.statistic_vars:
            return None, ()
        jaxpr = self.full.jaxpr
        targets = [self.full_var[v] for v in self.statistic_vars]
        needed = _ancestors(jaxpr, targets)
        eqns = [jaxpr.eqns[k] for k in needed]
        read_vars = {v for e in eqns for v in e.invars if not isinstance(v, Literal)} | set(targets)
        inputs = tuple(p for p, v in enumerate(jaxpr.invars) if v in read_vars)
        consts = dict(zip(jaxpr.constvars, self.full.consts, strict=True))

        def statistics(*values: Any) -> list[Any]:
            env = replay(eqns, {**consts, **{jaxpr.invars[p]: x for p, x in zip(inputs, values, strict=True)}})
            return [env[v] for v in targets]

        avals = [_struct(jaxpr.invars[p].aval) for p in inputs]
        return jax.make_jaxpr(statistics)(*avals), inputs

    def rewritten(self, loss: bool) -> ClosedJaxpr:
        """The program one micro-batch runs (see MicroProgram.closed)."""
        jaxpr, consts = self.micro.jaxpr, self.micro.consts
        end = len(jaxpr.eqns)
        stat_avals = [_struct(v.aval) for v in self.statistic_vars]

        def program(*args: Any) -> list[Any]:
            n = len(jaxpr.invars)
            stats = dict(zip(self.statistic_vars, args[n:n + len(stat_avals)], strict=True))
            index = args[-1] if self.indexed else None
            env = {**dict(zip(jaxpr.constvars, consts, strict=True)), **dict(zip(jaxpr.invars, args[:n], strict=True))}
            for i, eqn in enumerate(jaxpr.eqns):
                values = self._inputs(i, eqn.invars, env, stats, index)
                with source_of(eqn):
                    if i in self.draws:
                        shape, dim, counters = self.draws[i]
                        outs = [draw_rows(eqn, values[0], shape, dim, index * eqn.params["shape"][dim], counters)]
                    else:
                        outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
                        outs = outs if eqn.primitive.multiple_results else [outs]
                env.update(zip(eqn.outvars, outs, strict=True))
            return self._inputs(end, jaxpr.outvars, env, stats, index)

        avals = [*(_struct(v.aval) for v in jaxpr.invars), *stat_avals,
                 *((jax.ShapeDtypeStruct((), jnp.int32),) if self.indexed else ())]
        return jax.make_jaxpr(program)(*avals)

    def _inputs(self, i: int, variables: Sequence[Any], env: dict[Any, Any], stats: dict[Any, Any],
                index: Any) -> list[Any]:
        values = []
        for j, var in enumerate(variables):
            if (i, j) in self.fixed:
                value = self.fixed[(i, j)]
            elif (i, j) in self.read_statistic:
                value = stats[self.read_statistic[(i, j)]]
            else:
                value = read(env, var)
            if (i, j) in self.first_only:
                value = jnp.where(index == 0, value, jnp.zeros_like(value))
            values.append(value)
        return values


def _keeps_sum(m: Any) -> bool:
    """A linear one-operand op keeps a sum a sum, except a conversion from floats to integers."""
    if m.primitive.name != "convert_element_type":
        return True
    return not (jnp.issubdtype(m.invars[0].aval.dtype, jnp.inexact)
                and not jnp.issubdtype(m.params["new_dtype"], jnp.inexact))


def _ancestors(jaxpr: Any, targets: Sequence[Any]) -> list[int]:
    producer = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
    needed, stack = set(), list(targets)
    while stack:
        k = producer.get(stack.pop())
        if k is not None and k not in needed:
            needed.add(k)
            stack.extend(v for v in jaxpr.eqns[k].invars if not isinstance(v, Literal))
    return sorted(needed)


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(np.shape(a) == np.shape(b) and np.array_equal(np.asarray(a), np.asarray(b)))
    except TypeError:  # e.g. key arrays
        return a is b


def _at(eqn: Any) -> str:
    where = _summarize(eqn.source_info) if _summarize is not None else ""
    return f" at {where}" if where else ""
