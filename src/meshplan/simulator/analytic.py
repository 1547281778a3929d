"""Price a Megatron/NeMo-style layout in closed form: time, memory per device, error bars.

Input: a TrainingJob, a Cluster, a `Layout` and `KernelEfficiency`. Output: a `LayoutPrediction`.
Where the auto planner prices generic graphs with the intra-op ILP, this prices the layouts
people run (tensor, pipeline, data, context and expert parallelism with sequence parallelism,
selective or full recompute, flash attention, the distributed optimizer, overlap, fp8) from the
transformer's shapes:

- every GEMM of a layer is priced from its (m, n, k), dtype and device with the efficiency
  curve of meshplan.cost.kernels; fused attention at its own efficiency; element-wise kernels
  (norms, residuals, activations, softmax without flash) by the bytes they move over HBM;
- tensor-parallel collectives on the link the group spans; context-parallel ring exchanges
  overlapped with attention; MoE all-to-all over the expert-parallel group;
- pipeline sends on the link they cross (inside a node when consecutive stages share one);
- the data-parallel gradient reduction hierarchical: reduce-scatter inside the node, across
  nodes over every NIC of the node, all-gather inside the node; overlapped with the backward
  pass when the layout says so;
- memory per device as weights, gradients, optimizer state, activations of one micro-batch,
  the other in-flight micro-batches (1F1B or interleaved warm-up) and workspace, after
  Korthikanti et al. 2022 (activation bytes per layer, generalised to grouped-query
  attention, SwiGLU and MoE).

The iteration time is the schedule's latency (meshplan.inter.schedules) over the stages plus
the exposed data-parallel communication and the optimizer step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from meshplan.cluster.cluster import Cluster
from meshplan.cost.kernels import (
    DEFAULT_EFFICIENCY,
    WORKSPACE_BYTES,
    KernelEfficiency,
    fused_attention_seconds,
    gemm_seconds,
    memory_seconds,
    optimizer_step_bytes,
)
from meshplan.cost.links import CollectiveKind, Group, Links, collective_seconds, exposed_seconds, send_seconds
from meshplan.inter.schedules import megatron_inflight, pipeline_latency
from meshplan.ir import DType
from meshplan.simulator.job import TrainingJob
from meshplan.simulator.layout import Layout

# Relative spread of the true iteration time around a prediction: the 10th and 90th percentile
# of (published / predicted - 1) over the validated runs (docs/validation.md,
# benchmarks/results/validation.json); a prediction t is shown as t (t * (1 + LOW) - t * (1 + HIGH)).
UNCERTAINTY = (-0.040, 0.161)
# The parts of an iteration's time every pricer reports (LayoutPrediction.breakdown, the
# `time.*` metrics of a simulated plan), so plans and recipes compare part by part.
TIME_PARTS = ("compute", "tensor/expert-parallel communication", "recomputation", "hand-offs", "pipeline bubble",
              "exposed data-parallel communication", "optimizer step")
FORMULA = "formula/2"  # this closed form's name and version (Prediction.cost_model)


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Peak bytes per device of the most loaded stage, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    inflight: float
    workspace: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.inflight + self.workspace

    def items(self) -> tuple[tuple[str, float], ...]:
        return (("weights", self.weights), ("gradients", self.gradients), ("optimizer", self.optimizer),
                ("activations", self.activations), ("in-flight micro-batches", self.inflight),
                ("workspace", self.workspace))


@dataclass(frozen=True, slots=True)
class LayoutPrediction:
    """What a layout costs.

    Attributes:
        iteration_time: seconds per iteration.
        pipeline_time: the pipeline schedule's latency (all micro-batches through all stages).
        sync_time: exposed data-parallel communication and the optimizer step.
        stage_times: seconds per micro-batch (forward + backward) of each stage.
        num_microbatches: micro-batches each data-parallel replica runs.
        memory: the peak stage's bytes per device, by component.
        capacity: bytes per device plans may use.
        idle_devices: devices of the cluster the layout leaves unused.
        model_flops: 6 N T FLOPs of the iteration (N: parameters a token multiplies by).
        peak_flops: the compute dtype's peak per device (fp8 when the layout uses fp8 GEMMs).
        breakdown: seconds per iteration by component on the critical stage.
        cost_model: the pricer that made it and its version (FORMULA, or the graph pricer's).
    """

    layout: Layout
    iteration_time: float
    pipeline_time: float
    sync_time: float
    stage_times: tuple[float, ...]
    num_microbatches: int
    memory: MemoryBreakdown
    capacity: float
    idle_devices: int
    devices: int
    model_flops: float
    peak_flops: float
    breakdown: tuple[tuple[str, float], ...]
    cost_model: str = ""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the peak of every device of the cluster."""
        return self.model_flops / self.iteration_time / (self.devices * self.peak_flops)

    @property
    def time_range(self) -> tuple[float, float]:
        low, high = UNCERTAINTY
        return self.iteration_time * (1 + low), self.iteration_time * (1 + high)


@dataclass(frozen=True, slots=True)
class _LayerTimes:
    """Seconds per micro-batch of one block on one device."""

    forward: float
    backward: float
    recompute: float
    attention_core: float
    tp_comm: float
    moe_comm: float


def model_flops(job: TrainingJob) -> float:
    """6 N T training FLOPs of one iteration (TrainingJob.model_flops)."""
    return job.model_flops


def check_layout(job: TrainingJob, cluster: Cluster, layout: Layout) -> str:
    """Why the layout cannot run on the cluster ("" when it can)."""
    model = job.model
    if layout.devices > cluster.num_devices:
        return (f"layout {layout.text()} needs {layout.devices} devices (tp x pp x dp x cp), the cluster has "
                f"{cluster.num_devices}")
    if layout.pp * layout.vp > model.layers:
        return f"layout {layout.text()}: pp x vp = {layout.pp * layout.vp} exceeds the model's {model.layers} layers"
    if model.heads % layout.tp:  # key/value heads fewer than tp are replicated, as Megatron does
        return f"layout {layout.text()}: tp={layout.tp} does not divide the {model.heads} attention heads"
    if job.seq_len % (2 * layout.cp) and layout.cp > 1:
        return f"layout {layout.text()}: cp={layout.cp} needs a sequence length divisible by {2 * layout.cp}"
    if model.experts and model.experts % layout.ep:
        return f"layout {layout.text()}: ep={layout.ep} does not divide the {model.experts} experts"
    if layout.fp8 and not cluster.device.fp8_flops:
        return f"layout {layout.text()}: fp8=on but {cluster.device.name} has no fp8 tensor cores"
    return ""


def price_layout(job: TrainingJob, cluster: Cluster, layout: Layout,
                 efficiency: KernelEfficiency = DEFAULT_EFFICIENCY, memory_fraction: float = 0.9) -> LayoutPrediction:
    """Time and memory of `layout` training `job` on `cluster` (check_layout first: this
    assumes the layout can run)."""
    return LayoutPricer(job, cluster, layout, efficiency).predict(memory_fraction)


class LayoutPricer:
    """The layout's per-device work, priced piece by piece in closed form; the glue (stages,
    pipeline, exposed data-parallel communication, memory parts) is shared with the graph pricer
    (meshplan.simulator.graph_pricing), which overrides the per-layer, per-stage costs."""

    cost_model = FORMULA

    def __init__(self, job: TrainingJob, cluster: Cluster, layout: Layout, eff: KernelEfficiency) -> None:
        self.job, self.cluster, self.layout, self.eff = job, cluster, layout, eff
        self.model, self.device = job.model, cluster.device
        self.links = Links.of(cluster.device, eff.link)
        self.flash = self.device.flash_attention if layout.flash is None else layout.flash
        self.bytes = job.dtype.itemsize
        self.tokens = layout.mb * job.seq_len // layout.cp  # per device per micro-batch
        self.sequences = math.ceil(job.global_batch / layout.dp)  # the fullest replica's share
        self.num_microbatches = math.ceil(self.sequences / layout.mb)
        # Megatron accumulates and reduces gradients in fp32 (main_grad) unless told otherwise.
        self._grad_bytes = 4 if layout.fp32_grads or job.dtype is DType.F32 else self.bytes
        # Per layer kind (dense or MoE): the search prices tens of thousands of layouts of
        # models with over a hundred layers, and these depend only on the kind.
        self._moe = job.model.moe_layers()
        self._any_moe = any(self._moe)
        self._layer_params: dict[bool, tuple[float, float]] = {}
        self._reductions: dict[tuple[CollectiveKind, float, int], float] = {}
        self._activations: dict[bool, tuple[float, float]] = {}
        self._peak: MemoryBreakdown | None = None
        self._sends: dict[bool, float] = {}

    # -- links -----------------------------------------------------------------------------

    def _collective(self, kind: CollectiveKind, nbytes: float, size: int, stride: int) -> float:
        """One collective over `size` ranks `stride` apart in Megatron's rank order."""
        group = Group.strided(size, stride, self.cluster.devices_per_node)
        return collective_seconds(kind, nbytes, group, self.links)

    # -- compute ---------------------------------------------------------------------------

    def _gemm(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        return gemm_seconds(self.device, self.eff, m, n, k, count, self.layout.fp8)

    def _hbm(self, nbytes: float) -> float:
        return memory_seconds(self.device, self.eff, nbytes)

    def _layer(self, moe: bool) -> _LayerTimes:
        model, lay, t = self.model, self.layout, self.tokens
        h, d, tp = model.hidden, model.head_dim, lay.tp
        heads, kv = model.heads / tp, max(1.0, model.num_kv_heads / tp)
        seq_all = self.job.seq_len
        gemms = self._gemm(t, (heads + 2 * kv) * d, h) + self._gemm(t, h, heads * d)
        gemms += self._mlp_gemms(moe)
        # Attention core: QK^T and PV; causal flash kernels skip the masked half.
        core_flops = 4 * lay.mb * heads * (seq_all / lay.cp) * seq_all * d
        scores = lay.mb * heads * (seq_all / lay.cp) * seq_all  # per device
        dropout = 1 if model.dropout else 0
        if self.flash:
            attention = fused_attention_seconds(self.device, self.eff, core_flops, model.causal)
            softmax = 0.0
        else:
            attention = (self._gemm(seq_all / lay.cp, seq_all, d, lay.mb * heads)
                         + self._gemm(seq_all / lay.cp, d, seq_all, lay.mb * heads))
            # Fused scale-mask-softmax reads the scores and writes the probabilities; dropout reads
            # them and writes its output and a one-byte mask.
            softmax = self._hbm(scores * (2 * self.bytes + dropout * (2 * self.bytes + 1)))
        split = tp if lay.sp else 1
        width = self._mlp_width(moe)
        # Norms read and write a row (2 each), residual adds read two and write one (3 each), the
        # MLP activation reads its inputs and writes its output, fused rotary embedding reads q
        # and k and writes them back: the bytes the fused kernels of meshplan.cost.fusion move.
        mats = 3 if model.mlp == "swiglu" else 2  # SwiGLU reads two inputs, GELU one; both write one
        masks = 2 * t * h / split if model.dropout else 0.0  # the two one-byte dropout masks written
        if moe:  # token permutation: gather the slots' rows, read the experts' outputs, write the sum
            masks += self.bytes * (3 * model.routed_slots(seq_all) + 1) * t * h
        elementwise = self._hbm(self.bytes * (10 * t * h / split + mats * t * width / tp
                                              + (2 * t * (heads + kv) * d if model.rotary else 0)) + masks)
        forward_compute = gemms + attention + softmax + elementwise
        # The softmax backward reads the probabilities and their gradient and writes the scores'
        # gradient; with dropout it reads the mask too.
        softmax_back = 0.0 if self.flash else self._hbm(scores * (3 * self.bytes + dropout))
        core_backward = (fused_attention_seconds(self.device, self.eff, 2 * core_flops, model.causal, backward=True)
                         if self.flash else 2 * attention + softmax_back)
        backward_compute = 2 * gemms + core_backward + 2 * elementwise
        tp_comm = self._tp_comm() + self._cp_comm(attention)
        moe_comm = self._moe_comm() if moe else 0.0
        gather, scatter = self._fsdp_comm(moe)
        forward = forward_compute + tp_comm + moe_comm + max(0.0, gather - forward_compute)
        backward = (backward_compute + tp_comm + moe_comm + max(0.0, gather + scatter - backward_compute)
                    + self.eff.per_layer_overhead_s)
        recompute = {"none": 0.0, "full": forward,
                     "selective": 0.0 if self.flash else attention + softmax}[lay.recompute]
        return _LayerTimes(forward, backward, recompute, attention + softmax, 2 * tp_comm, 2 * moe_comm)

    def _fsdp_comm(self, moe: bool) -> tuple[float, float]:
        """(all-gather of one layer's weights, reduce-scatter of its gradients) under fully
        sharded data parallelism; prefetched, so only what the layer's compute does not cover
        is exposed."""
        lay = self.layout
        group = lay.dp * lay.cp
        if not lay.fsdp or group == 1:
            return 0.0, 0.0
        params = self.model.block_params(moe) / lay.tp
        weights = self._data_parallel_collective(CollectiveKind.ALL_GATHER, params * self.bytes, group)
        grads = self._data_parallel_collective(CollectiveKind.REDUCE_SCATTER, params * self._grad_bytes, group)
        return weights, grads

    def _mlp_width(self, moe: bool) -> float:
        model = self.model
        if not moe:
            return model.ffn
        return (model.routed_slots(self.job.seq_len) + model.shared_experts) * model.expert_width

    def _mlp_gemms(self, moe: bool) -> float:
        model, t, tp = self.model, self.tokens, self.layout.tp
        h, mats = model.hidden, 3 if model.mlp == "swiglu" else 2
        if not moe:
            return self._gemm(t, (mats - 1) * model.ffn / tp, h) + self._gemm(t, h, model.ffn / tp)
        w = model.expert_width
        local_experts = model.experts / self.layout.ep
        # Token slots each local expert runs: its capacity (GShard's, about top_k x capacity_factor
        # per token) of every sequence the expert-parallel group holds.
        per_expert = t * model.routed_slots(self.job.seq_len) * self.layout.ep / model.experts
        routed = (self._gemm(per_expert, (mats - 1) * w / tp, h, local_experts)
                  + self._gemm(per_expert, h, w / tp, local_experts))
        shared = w * model.shared_experts
        dense = (self._gemm(t, (mats - 1) * shared / tp, h) + self._gemm(t, h, shared / tp)) if shared else 0.0
        return routed + dense + self._gemm(t, model.experts, h)

    def _tp_comm(self) -> float:
        """Forward tensor-parallel collectives of one layer: two all-reduces of the activations
        (with sequence parallelism an all-gather and a reduce-scatter each: the same bytes)."""
        lay = self.layout
        if lay.tp == 1:
            return 0.0
        nbytes = self.tokens * self.model.hidden * self.bytes
        seconds = 2 * self._collective(CollectiveKind.ALL_REDUCE, nbytes, lay.tp, 1)
        return seconds * (1 - self.eff.tp_overlap_hidden if lay.tp_overlap else 1.0)

    def _cp_comm(self, attention: float) -> float:
        """Ring attention passes key/value blocks around the context-parallel group while it
        computes (the bytes of an all-gather of every rank's block); only what the attention does
        not hide is exposed."""
        lay = self.layout
        if lay.cp == 1:
            return 0.0
        kv = max(1.0, self.model.num_kv_heads / lay.tp)
        block = 2 * self.tokens * kv * self.model.head_dim * self.bytes
        exchange = self._collective(CollectiveKind.ALL_GATHER, lay.cp * block, lay.cp, lay.tp)
        return max(0.0, exchange - attention)

    def _moe_comm(self) -> float:
        """Dispatch and combine all-to-alls of the routed tokens over the expert-parallel group."""
        lay, model = self.layout, self.model
        if lay.ep == 1:
            return 0.0
        nbytes = self.tokens * model.routed_slots(self.job.seq_len) * model.hidden * self.bytes
        return 2 * self._collective(CollectiveKind.ALL_TO_ALL, nbytes, lay.ep, lay.tp * lay.cp)

    # -- stages ----------------------------------------------------------------------------

    def _stage_layers(self) -> tuple[range, ...]:
        """Layer indices per stage: Megatron's equal split (the first stages take the remainder)."""
        return _pipeline_split(self._moe, self.layout.pp)[0]

    def _class_leaders(self) -> tuple[int, ...]:
        """The first stage of each class of stages that hold and sync the same (_pipeline_split)."""
        return _pipeline_split(self._moe, self.layout.pp)[1]

    def _send(self, stage: int) -> float:
        """Forward send and backward receive of one micro-batch across the boundary after `stage`,
        on the link it crosses (each tensor-parallel rank sends its 1/tp share)."""
        lay = self.layout
        if stage >= lay.pp - 1:
            return 0.0
        per_node, size = self.cluster.devices_per_node, lay.stage_devices
        crosses = size >= per_node or ((stage + 1) * size) % per_node == 0
        if crosses not in self._sends:  # two values per layout: inside a node or across
            nbytes = self.tokens * self.model.hidden * self.bytes / lay.tp
            self._sends[crosses] = 2 * lay.vp * send_seconds(nbytes, crosses, self.links)
        return self._sends[crosses]

    def _head(self) -> float:
        """LM head GEMM and cross-entropy of one micro-batch (forward + backward) on the last stage;
        with tensor parallelism its input is gathered (or its input gradient all-reduced) and the
        vocabulary-parallel loss all-reduces three fp32 values per token (maximum, sum, target)."""
        model, t, tp = self.model, self.tokens, self.layout.tp
        gemm = self._gemm(t, model.vocab / tp, model.hidden)
        loss = self._hbm(4 * t * model.vocab / tp * 4)  # fp32 logits: softmax and its gradient
        comm = (self._collective(CollectiveKind.ALL_REDUCE, t * model.hidden * self.bytes, tp, 1)
                + 3 * self._collective(CollectiveKind.ALL_REDUCE, t * 4, tp, 1))
        return 3 * gemm + loss + comm

    def _embedding(self) -> float:
        """The embedding gather (forward and backward) of one micro-batch on the first stage, and
        the vocabulary-parallel lookup's all-reduce (reduce-scatter, then an all-gather of its
        gradient, with sequence parallelism)."""
        nbytes = self.tokens * self.model.hidden * self.bytes
        return self._hbm(3 * nbytes) + self._collective(CollectiveKind.ALL_REDUCE, nbytes, self.layout.tp, 1)

    def memory(self) -> MemoryBreakdown:
        """Peak memory per device of the most loaded stage."""
        if self._peak is None:
            self._peak = self._memory(self._stage_layers())
        return self._peak

    def predict(self, memory_fraction: float) -> LayoutPrediction:
        lay = self.layout
        kinds = {moe: self._layer(moe) for moe in set(self._moe)}
        stages = self._stage_layers()
        times, compute_s, tp_s, recompute_s = [], [], [], []
        summed: dict[tuple[bool, ...], tuple[float, float, float]] = {}  # stages with the same layer kinds
        for j, layers in enumerate(stages):
            pattern = self._moe[layers.start:layers.stop]
            if pattern not in summed:
                per = [kinds[moe] for moe in pattern]
                summed[pattern] = (sum(p.forward + p.backward + p.recompute for p in per),
                                   sum(p.tp_comm + p.moe_comm for p in per), sum(p.recompute for p in per))
            work, tp_comm, again = summed[pattern]
            seconds = work + self._send(j)
            if j == lay.pp - 1:
                seconds += self._head()
            if j == 0:
                seconds += self._embedding()
            times.append(seconds)
            tp_s.append(tp_comm)
            recompute_s.append(again)
            compute_s.append(seconds)
        pipeline = pipeline_latency(times, self.num_microbatches, lay.vp)
        critical = max(range(lay.pp), key=lambda j: times[j])
        backward_window = sum(kinds[self._moe[i]].backward for i in stages[critical])
        sync, optimizer = self._data_parallel(stages, backward_window)
        memory = self.memory()
        m = self.num_microbatches
        send = self._send(critical)
        parts = (m * (compute_s[critical] - tp_s[critical] - recompute_s[critical] - send), m * tp_s[critical],
                 m * recompute_s[critical], m * send, pipeline - m * times[critical], sync, optimizer)
        breakdown = tuple(zip(TIME_PARTS, parts, strict=True))
        peak = self.device.fp8_flops if lay.fp8 else self.device.peak_flops
        return LayoutPrediction(lay, pipeline + sync + optimizer, pipeline, sync + optimizer, tuple(times), m, memory,
                                self.device.memory_bytes * memory_fraction, self.cluster.num_devices - lay.devices,
                                self.cluster.num_devices, model_flops(self.job), peak, breakdown, self.cost_model)

    # -- data parallel ---------------------------------------------------------------------

    def _stage_params(self, layers: range, first: bool, last: bool) -> tuple[float, float]:
        """(dense, expert) parameters per device of a stage."""
        model, lay = self.model, self.layout
        dense = expert = 0.0
        for moe, count in self._kind_counts(layers):  # parameters depend only on the layers' kinds
            layer_dense, layer_expert = self._one_layer_params(moe)
            dense += count * layer_dense
            expert += count * layer_expert
        table = model.vocab * model.hidden / lay.tp
        if first:
            dense += table + (model.max_seq_len * model.hidden if model.learned_positions else 0)
        if last:
            dense += table
        return dense, expert

    def _kind_counts(self, layers: range) -> list[tuple[bool, int]]:
        """(is MoE, how many) of the kinds present among `layers`."""
        routed = sum(self._moe[layers.start:layers.stop]) if self._any_moe else 0
        return [(moe, n) for moe, n in ((False, len(layers) - routed), (True, routed)) if n]

    def _one_layer_params(self, moe: bool) -> tuple[float, float]:
        """(dense, expert) parameters per device of one layer of the kind."""
        if moe not in self._layer_params:
            model, lay = self.model, self.layout
            block = model.block_params(moe)
            routed = model.experts * (3 if model.mlp == "swiglu" else 2) * model.hidden * model.expert_width \
                if moe else 0
            self._layer_params[moe] = ((block - routed) / lay.tp, routed / (lay.tp * lay.ep))
        return self._layer_params[moe]

    def _data_parallel(self, stages: tuple[range, ...], backward_window: float) -> tuple[float, float]:
        """(exposed gradient communication, optimizer step) of the slowest stage, per iteration.

        The data-parallel group of a rank spans dp x cp ranks `tp` apart; `local` of them share
        a node. Hierarchical reduction: reduce-scatter among the local ranks over NVLink, then
        a ring across nodes of 1/local of the bytes, every local rank on its own NIC share, then
        all-gather over NVLink."""
        lay = self.layout
        worst_sync = worst_opt = 0.0
        for j in self._class_leaders():  # the others' sync and step are their leader's
            comm, optimizer = self._stage_sync(j, stages[j])
            exposed = exposed_seconds(comm, backward_window, self.eff.dp_overlap_tail) if lay.overlap else comm
            worst_sync, worst_opt = max(worst_sync, exposed), max(worst_opt, optimizer)
        return worst_sync, worst_opt

    def _stage_sync(self, j: int, layers: range) -> tuple[float, float]:
        """(gradient communication once per iteration, optimizer step) of stage j."""
        lay = self.layout
        group = lay.dp * lay.cp
        grad_bytes = self._grad_bytes
        dense, expert = self._stage_params(layers, j == 0, j == lay.pp - 1)
        reduction = CollectiveKind.REDUCE_SCATTER if lay.distributed_optimizer else CollectiveKind.ALL_REDUCE
        comm = (self._data_parallel_collective(reduction, dense * grad_bytes, group)
                + self._data_parallel_collective(reduction, expert * grad_bytes, group // lay.ep))
        if lay.fsdp:  # blocks reduce-scatter layer by layer under the backward; the last is exposed
            comm = self._fsdp_comm(self._moe[layers[-1]])[1] if layers else 0.0
        elif lay.distributed_optimizer:  # the new weights are all-gathered
            comm += self._data_parallel_collective(CollectiveKind.ALL_GATHER, dense * self.bytes, group)
        shard = group if lay.distributed_optimizer or lay.fsdp else 1
        state = (dense / shard + expert / (max(1, group // lay.ep) if lay.distributed_optimizer else 1))
        return comm, self._hbm(state * optimizer_step_bytes(self.bytes, grad_bytes))

    def _data_parallel_collective(self, kind: CollectiveKind, nbytes: float, group: int) -> float:
        """A collective over the `group` data-parallel (and context-parallel) ranks of a stage,
        `tp` apart: node-aware, hierarchical when they span nodes (meshplan.cost.links)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        key = (kind, nbytes, group)
        if key not in self._reductions:  # stages of equal size reduce equal bytes
            self._reductions[key] = self._collective(kind, nbytes, group, self.layout.tp)
        return self._reductions[key]

    # -- memory ----------------------------------------------------------------------------

    def _activation_bytes(self, moe: bool) -> tuple[float, float]:
        """(kept for backward, kept under full recompute) bytes of one layer and micro-batch
        per device, after Korthikanti et al. 2022 Eq. 1-5: sbh(34 + 5as/h) for GPT without
        parallelism, generalised to grouped-query attention, SwiGLU and MoE widths."""
        if moe not in self._activations:
            self._activations[moe] = self._layer_activation_bytes(moe)
        return self._activations[moe]

    def _layer_activation_bytes(self, moe: bool) -> tuple[float, float]:
        model, lay, t = self.model, self.layout, self.tokens
        h, d, tp = model.hidden, model.head_dim, lay.tp
        split = tp if lay.sp else 1
        b = self.bytes
        dropout = 1 if model.dropout else 0  # one-byte masks
        heads, kv = model.heads / tp, max(1.0, model.num_kv_heads / tp)
        # GEMM inputs are saved in fp8 when the GEMMs run in fp8 (Transformer Engine keeps the
        # casted copy for the backward pass).
        g = 1 if lay.fp8 else b
        # Two norm inputs, the attention and MLP inputs (norm outputs), two dropout masks.
        replicated = t * (2 * b * h + 2 * g * h + 2 * dropout * h) / split
        attention = t * (b * heads * d + 2 * b * kv * d + g * heads * d)  # q, k, v, context
        seq_all = self.job.seq_len
        scores = lay.mb * heads * (seq_all / lay.cp) * seq_all
        if self.flash:
            core = lay.mb * heads * (seq_all / lay.cp) * 4  # softmax statistics
        elif lay.recompute == "selective":
            core = 0.0
        else:
            core = scores * b + dropout * scores * (1 + b)  # softmax output; dropout mask and output
        width = self._mlp_width(moe) / tp
        mlp = t * width * (b * (2 if model.mlp == "swiglu" else 1) + g)  # activation inputs; down-projection input
        if moe:  # the experts' inputs (the dispatched tokens) and their outputs (for the gate's gradient)
            mlp += t * model.routed_slots(seq_all) * h * (g + b)
        kept = replicated + attention + core + mlp
        return kept, t * h * b / split

    def _held(self, stage: int) -> float:
        """Micro-batches of activations stage `stage` holds at its peak (Megatron's warm-up)."""
        lay = self.layout
        return max(1.0, min(megatron_inflight(lay.pp, stage, lay.vp), self.num_microbatches))

    def _memory(self, stages: tuple[range, ...]) -> MemoryBreakdown:
        """The first most loaded stage's memory. Only class leaders are priced: a stage holds
        what its class leader holds but for the micro-batches in flight, which never grow down
        the pipeline (megatron_inflight), and the total never falls as they grow; so a leader
        is the most loaded of its class, and the first stage reaching the peak is a leader."""
        worst = None
        for j in self._class_leaders():
            breakdown = self._stage_memory(j, stages[j])
            if worst is None or breakdown.total > worst.total:
                worst = breakdown
        return worst

    def _stage_memory(self, j: int, layers: range) -> MemoryBreakdown:
        """Peak memory per device of stage j, by part."""
        lay, model = self.layout, self.model
        first, last = j == 0, j == lay.pp - 1
        dense, expert = self._stage_params(layers, first, last)
        kinds = self._kind_counts(layers)
        params = dense + expert
        group = lay.dp * lay.cp
        weights = params * self.bytes
        gradients = params * self._grad_bytes
        gathered = 0.0
        if lay.fsdp:  # sharded fp32 master copy in the optimizer state; two layers gathered at a time
            weights, gradients = 0.0, gradients / group
            gathered = 2 * max(model.block_params(moe) for moe, _ in kinds) / lay.tp * self.bytes
        per_param_state = {"adam": 12, "sgd": 4}.get(self.job.optimizer, 12)
        if self.job.dtype is DType.F32:
            per_param_state -= 4  # no separate fp32 master copy
        shard_dense = group if lay.distributed_optimizer or lay.fsdp else 1
        shard_expert = max(1, group // lay.ep) if lay.distributed_optimizer or lay.fsdp else 1
        optimizer = per_param_state * (dense / shard_dense + expert / shard_expert)
        kept = [(n, self._activation_bytes(moe)) for moe, n in kinds]
        held = self._held(j)
        if lay.recompute == "full":
            one = sum(n * k[1] for n, k in kept)
            working = max(k[0] for _, k in kept)
        else:
            one = sum(n * k[0] for n, k in kept)
            working = 0.0
        logits = 2 * 4 * self.tokens * model.vocab / lay.tp if last else 0.0
        workspace = WORKSPACE_BYTES + max(working, logits) + gathered
        return MemoryBreakdown(weights, gradients, optimizer, one, (held - 1) * one, workspace)


@functools.lru_cache(maxsize=512)
def _pipeline_split(moe: tuple[bool, ...], pp: int) -> tuple[tuple[range, ...], tuple[int, ...]]:
    """Megatron's equal split of the layers (of kinds `moe`) into pp stages, and the first stage
    of each class of stages that hold and sync the same: equally many layers of each kind, the
    same last layer kind (FSDP's exposed reduction), both or neither first and last (the
    embedding and the head). A 126-stage pipeline of equal blocks has at most four classes;
    the search prices tens of thousands of layouts, a few hundred splits."""
    layers = len(moe)
    bounds = [round(j * layers / pp) for j in range(pp + 1)]
    stages = tuple(range(bounds[j], bounds[j + 1]) for j in range(pp))
    leaders: dict[tuple, int] = {}
    for j, span in enumerate(stages):
        routed = sum(moe[span.start:span.stop])
        leaders.setdefault((j == 0, j == pp - 1, len(span) - routed, routed, moe[span.stop - 1]), j)
    return stages, tuple(sorted(leaders.values()))


@dataclass(frozen=True, slots=True)
class LayoutSearch:
    """The fastest layout that fits, and the one that needs the least memory per device (to say
    how much memory would be needed when nothing fits)."""

    best: LayoutPrediction | None
    leanest: LayoutPrediction | None
    candidates: int


def candidate_layouts(job: TrainingJob, cluster: Cluster, fp8: bool = False) -> list[Layout]:
    """Megatron-style layouts worth pricing: tensor parallelism inside a node over divisors of
    the heads, context parallelism for long sequences, any pipeline depth, the most
    data-parallel replicas the devices and the global batch allow (leaving the rest idle),
    micro-batches of 1-8 sequences, and every memory technique."""
    model, per_node = job.model, cluster.devices_per_node
    layouts = []
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0 and model.heads % t == 0):
        for cp in (c for c in (1, 2, 4, 8) if tp * c <= cluster.num_devices and (c == 1 or job.seq_len >= 8192)):
            for pp in range(1, min(model.layers, cluster.num_devices // (tp * cp)) + 1):
                dp = min(cluster.num_devices // (tp * cp * pp), job.global_batch)
                layouts.extend(_variants(job, tp, cp, pp, dp, fp8))
    return layouts


def _variants(job: TrainingJob, tp: int, cp: int, pp: int, dp: int, fp8: bool) -> list[Layout]:
    model = job.model
    per_replica = math.ceil(job.global_batch / dp)
    eps = [e for e in range(1, dp * cp + 1) if model.experts and model.experts % e == 0 and (dp * cp) % e == 0] or [1]
    chunks = [v for v in (1, 2, 4) if v == 1 or (pp > 1 and model.layers % (pp * v) == 0)]
    out = []
    for mb in (b for b in (1, 2, 4, 8) if b <= per_replica):
        for recompute in ("none", "selective", "full"):
            for zero in (False, True):
                for vp in chunks:
                    for ep in eps:
                        out.append(Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vp=vp, mb=mb, sp=tp > 1,
                                          recompute=recompute, distributed_optimizer=zero, overlap=True, fp8=fp8))
    return out


def search_layouts(job: TrainingJob, cluster: Cluster, efficiency: KernelEfficiency = DEFAULT_EFFICIENCY,
                   memory_fraction: float = 0.9, fp8: bool = False) -> LayoutSearch:
    """Price every candidate layout; the fastest that fits and the leanest overall."""
    best = leanest = None
    count = 0
    capacity = cluster.device.memory_bytes * memory_fraction
    for layout in candidate_layouts(job, cluster, fp8):
        if check_layout(job, cluster, layout):
            continue
        count += 1
        pricer = LayoutPricer(job, cluster, layout, efficiency)
        needed = pricer.memory().total
        if needed > capacity and leanest is not None and needed >= leanest.memory.total:
            continue  # neither a candidate nor the leanest: its time is not needed
        found = pricer.predict(memory_fraction)
        if leanest is None or found.memory.total < leanest.memory.total:
            leanest = found
        if found.fits and (best is None or found.iteration_time < best.iteration_time):
            best = found
    return LayoutSearch(best, leanest, count)
