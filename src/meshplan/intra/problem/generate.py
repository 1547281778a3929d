"""Random strategy problems shaped like the IOPDDL contest's: seed -> problem in the contest format.

The contest's instances come from sharding real training and inference graphs; what makes them
hard is their structure, not their size alone, so the generator copies the structure:

- a graph of operators in program order: a forward chain with residual skips, each layer's
  weights feeding its first operator; for training also a backward chain that reads every
  forward activation again (the activation stays live until then, so live intervals nest
  like a tree) and an optimizer update per weight at the end;
- per operator a tensor of a few dims and its strategies: layouts that split tensor dims over
  the axes of a device mesh; memory use is the tensor's bytes over the layout's split factor;
  node costs are compute over that factor plus an all-reduce where a contracting dim is split;
- per edge a resharding matrix: the consumer's strategy requires a layout of its operand (a
  permutation of its own, as after a transpose) and the producer's layout is converted
  (all-gather for a dropped split, all-to-all for a moved one, slicing is free);
- some strategies and pairs forbidden (cost 10^18), never all of a node's or an edge's;
- a memory limit between the least possible peak and the peak of a cheap plan that ignores
  memory (node by node moves to the best strategy given the neighbours), so that memory binds.

`random_instance(seed, GeneratorOptions(...))` returns the JSON-able dict that
`read_iopddl`/`problem_from_iopddl` read, so generated instances also go through the
command line and the independent scorer of the tests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

FORBIDDEN_COST = 10**18  # the contest's mark of a forbidden choice
LATENCY = 2_000  # cost of starting one collective, in the same units as bytes moved


@dataclass(frozen=True, slots=True)
class GeneratorOptions:
    """Shape of a generated instance.

    Attributes:
        layers: blocks of `ops_per_layer` operators (and one weight each).
        ops_per_layer: operators per block.
        mesh: device mesh axis sizes (the strategies split tensor dims over these axes).
        training: forward + backward + optimizer update (nested live intervals), else forward only.
        tightness: memory limit from the least possible peak (0) to a cheap plan's peak (1).
        forbid: share of strategies and of edge pairs forbidden.
        max_strategies: at most this many strategies per operator.
        compute: mean compute cost of an operator per byte of its tensor (communication costs
            about one per byte moved): small values make memory and cost pull apart.
    """

    layers: int = 4
    ops_per_layer: int = 4
    mesh: tuple[int, ...] = (2, 4)
    training: bool = True
    tightness: float = 0.4
    forbid: float = 0.03
    max_strategies: int = 12
    compute: float = 0.3


@dataclass(frozen=True, slots=True)
class _Node:
    """One operator: its tensor, strategies (layouts) and costs."""

    rank: int
    nbytes: float
    layouts: tuple[tuple[int, ...], ...]  # per strategy, per mesh axis: the split dim or -1
    costs: np.ndarray
    usages: np.ndarray


def random_instance(seed: int, options: GeneratorOptions | None = None) -> dict:
    """A random problem with the contest's structure (see the module docstring), as the dict
    of the IOPDDL JSON format: {"problem": {"name", "nodes", "edges", "usage_limit"}}."""
    options = options or GeneratorOptions()
    rng = np.random.default_rng(seed)
    order, edges, intervals = _graph(options)
    nodes = [_node(rng, options, kind) for kind in order]
    matrices = [_resharding(rng, options, nodes[u], nodes[v]) for u, v in edges]
    node_costs = [n.costs.astype(np.int64) for n in nodes]
    _forbid(rng, options.forbid, node_costs, matrices)
    usages = [n.usages.astype(np.int64) for n in nodes]
    limit = _limit(options.tightness, node_costs, usages, intervals, edges, matrices)
    return {"problem": {
        "name": f"generated-{seed}",
        "nodes": {"intervals": [list(iv) for iv in intervals], "costs": [c.tolist() for c in node_costs],
                  "usages": [u.tolist() for u in usages]},
        "edges": {"nodes": [list(e) for e in edges], "costs": [m.astype(np.int64).ravel().tolist() for m in matrices]},
        "usage_limit": int(limit)}}


def _graph(options: GeneratorOptions) -> tuple[list[str], list[tuple[int, int]], list[tuple[int, int]]]:
    """Operators in program order (their kinds), producer -> consumer edges, live intervals."""
    kinds: list[str] = []
    edges: list[tuple[int, int]] = []
    uses: dict[int, list[int]] = {}

    def add(kind: str, *operands: int) -> int:
        kinds.append(kind)
        v = len(kinds) - 1
        for u in operands:
            edges.append((u, v))
            uses.setdefault(u, []).append(v)
        return v

    weights, forward = [], []
    x = add("input")
    for _ in range(options.layers):
        w = add("weight")
        weights.append(w)
        block_in = x
        for k in range(options.ops_per_layer):
            x = add("dot", x, w) if k == 0 else add("op", x)
            forward.append(x)
        x = add("op", x, block_in)  # the residual joins the block's input and output
        forward.append(x)
    if options.training:
        grad = add("op", x)
        for a in reversed(forward):  # the gradient of each operator reads its forward activation
            grad = add("op", grad, a)
        for w in weights:
            add("update", w, grad)
    end = len(kinds)
    intervals = []
    for v, kind in enumerate(kinds):
        last = max(uses.get(v, [v]))
        intervals.append((0, end) if kind == "weight" else (v, last + 1))
    return kinds, edges, intervals


def _layouts(rank: int, mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(range(-1, rank), repeat=len(mesh)))


def _split(layout: tuple[int, ...], mesh: tuple[int, ...]) -> int:
    return int(np.prod([n for n, d in zip(mesh, layout, strict=True) if d >= 0], dtype=np.int64))


def _node(rng: np.random.Generator, options: GeneratorOptions, kind: str) -> _Node:
    rank = 2 if kind == "weight" else int(rng.integers(2, 4))
    nbytes = float(np.exp(rng.uniform(np.log(2e5), np.log(5e7))))
    every = _layouts(rank, options.mesh)
    k = int(rng.integers(1, min(options.max_strategies, len(every)) + 1))
    layouts = tuple(every[i] for i in sorted(rng.choice(len(every), size=k, replace=False)))
    splits = np.array([_split(lay, options.mesh) for lay in layouts], dtype=np.float64)
    usages = np.ceil(nbytes / splits)
    flops = nbytes * options.compute * float(rng.exponential()) if kind in ("dot", "op", "update") else 0.0
    contracting = int(rng.integers(rank))
    costs = []
    for lay, split in zip(layouts, splits, strict=True):
        cost = flops / split
        reduced = [n for n, d in zip(options.mesh, lay, strict=True) if kind == "dot" and d == contracting]
        for n in reduced:  # a split contracting dim leaves partial sums: all-reduce the output shard
            cost += LATENCY + 2 * (n - 1) / n * nbytes / split
        costs.append(cost * float(rng.uniform(0.97, 1.03)))
    return _Node(rank, nbytes, layouts, np.round(np.array(costs)), usages)


def _resharding(rng: np.random.Generator, options: GeneratorOptions, u: _Node, v: _Node) -> np.ndarray:
    """Cost of turning u's layout i into the operand layout v's strategy j requires."""
    perm = rng.permutation(u.rank)
    need = [tuple(int(perm[d % u.rank]) if d >= 0 else -1 for d in lay) for lay in v.layouts]
    matrix = np.zeros((len(u.layouts), len(v.layouts)))
    for i, have in enumerate(u.layouts):
        for j, want in enumerate(need):
            matrix[i, j] = _convert(have, want, u.nbytes, options.mesh)
    return np.round(matrix * rng.uniform(0.97, 1.03, size=matrix.shape))


def _convert(have: tuple[int, ...], want: tuple[int, ...], nbytes: float, mesh: tuple[int, ...]) -> float:
    """Axis by axis: a dropped split is an all-gather, a moved one an all-to-all, a new one free."""
    cost, held = 0.0, nbytes / _split(have, mesh)
    for n, a, b in zip(mesh, have, want, strict=True):
        if a < 0 or a == b:
            continue
        if b < 0:
            held *= n
            cost += LATENCY + (n - 1) / n * held
        else:
            cost += LATENCY + (n - 1) / n * held
    return cost


def _forbid(rng: np.random.Generator, share: float, costs: list[np.ndarray], matrices: list[np.ndarray]) -> None:
    """Forbid a share of strategies (never a node's last) and of edge pairs (never a whole row
    or column, so that every strategy left keeps a partner)."""
    for c in costs:
        drop = rng.random(len(c)) < share
        drop[int(rng.integers(len(c)))] = False
        c[drop] = FORBIDDEN_COST
    for m in matrices:
        drop = rng.random(m.shape) < share
        drop[np.arange(m.shape[0]), rng.integers(m.shape[1], size=m.shape[0])] = False
        drop[rng.integers(m.shape[0], size=m.shape[1]), np.arange(m.shape[1])] = False
        m[drop] = FORBIDDEN_COST


def _limit(tightness: float, costs: list[np.ndarray], usages: list[np.ndarray], intervals: list[tuple[int, int]],
           edges: list[tuple[int, int]], matrices: list[np.ndarray]) -> float:
    """Between the least possible peak (every node on its smallest usage, which minimizes every
    time point at once) and the peak of a cheap plan found without memory."""
    leanest = _peak([int(np.argmin(u)) for u in usages], usages, intervals)
    cheap = _peak(_cheap_plan(costs, edges, matrices), usages, intervals)
    return leanest + tightness * max(cheap - leanest, 0.0)


def _cheap_plan(costs: list[np.ndarray], edges: list[tuple[int, int]], matrices: list[np.ndarray],
                sweeps: int = 4) -> list[int]:
    """Every node's cheapest strategy, then sweeps moving each node to its best given its
    neighbours (edge costs included; forbidden entries count as very expensive)."""
    choice = [int(np.argmin(c)) for c in costs]
    touching: list[list[tuple[int, np.ndarray]]] = [[] for _ in costs]
    for (u, v), m in zip(edges, matrices, strict=True):
        touching[u].append((v, m))
        touching[v].append((u, m.T))
    for _ in range(sweeps):
        for v in range(len(costs)):
            local = costs[v].astype(np.float64).copy()
            for w, m in touching[v]:
                local += m[:, choice[w]]
            choice[v] = int(np.argmin(local))
    return choice


def _peak(choice: list[int], usages: list[np.ndarray], intervals: list[tuple[int, int]]) -> float:
    end = max(hi for _, hi in intervals)
    delta = np.zeros(end + 1)
    for v, (lo, hi) in enumerate(intervals):
        delta[lo] += usages[v][choice[v]]
        delta[hi] -= usages[v][choice[v]]
    return float(np.cumsum(delta).max())
