"""What the simulator plans (a TrainingJob) and how (PlannerOptions)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cost.kernels import DEFAULT_EFFICIENCY, KernelEfficiency
from meshplan.errors import ModelSpecError, OptionsError
from meshplan.ir import DType
from meshplan.models.training import OPTIMIZERS, ModelConfig


@dataclass(frozen=True, slots=True)
class TrainingJob:
    """What to train: the model, the global batch (sequences or images per iteration), the
    sequence length (1 for image models: a sample is one image of the model's size)."""

    model: ModelConfig
    global_batch: int
    seq_len: int
    dtype: DType = DType.BF16
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise ModelSpecError(f"global batch ({self.global_batch}) and sequence length ({self.seq_len}) "
                                 "must be at least 1")
        if self.optimizer not in OPTIMIZERS:
            raise ModelSpecError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.model.sample_unit == "images" and self.seq_len != 1:
            raise ModelSpecError(f"{self.model.name} takes {self.model.image_size}x{self.model.image_size} images, "
                                 f"not sequences: its sequence length must be 1, got {self.seq_len}")

    def on(self, cluster: Cluster) -> Cluster:
        """`cluster` as this job's arithmetic sees it: fp32 jobs on devices without fp32 tensor
        cores (V100) run at the device's fp32 peak (DeviceSpec.for_itemsize)."""
        device = cluster.device.for_itemsize(self.dtype.itemsize)
        return cluster if device is cluster.device else replace(cluster, device=device)

    @property
    def tokens(self) -> int:
        """Samples per iteration: tokens, or images for an image model."""
        return self.global_batch * self.seq_len

    @property
    def model_flops(self) -> float:
        """Training FLOPs per iteration, the model's own count (`training_flops`): transformers by
        the usual 6 N T rule (T tokens; N the parameters a token multiplies by: for MoE the top-k
        routed and the shared experts, not every expert; not the embedding lookups, which
        multiply nothing); ResNets three times their forward convolutions and classifier. MFU
        counts these FLOPs."""
        return self.model.training_flops(self.global_batch, self.seq_len)


# PlannerOptions.mesh_axes: 2-D views, also all 3-D views, or 3-D views of the 2-D plan's stages.
MESH_AXES = (2, 3, "refine")


@dataclass(frozen=True, slots=True)
class PlannerOptions:
    """Knobs of the planner.

    Attributes:
        efficiency: fraction of the device's peak FLOP/s sustained by its kernels (with
            `gemm_curve`, by every kernel but the contractions).
        gemm_curve: contractions are priced from their local (m, n, k) with the efficiency
            curve of meshplan.cost.kernels (the one validated in docs/validation.md), so thin
            GEMMs (high tensor parallelism, small hidden sizes) run at less of the peak.
        memory_fraction: share of device memory plans may use (the rest: runtime, fragmentation).
        microbatch_sizes: sequences per micro-batch to try; empty = chosen from the batch.
        max_microbatch_sizes: how many to try when chosen automatically.
        workers: processes pricing candidates in parallel (1 = in this process).
        relative_bucket: t_max values of the DP closer than this ratio are merged (0: exact; the
            stage DP's branch and bound makes exact cheap).
        time_limit: seconds per ILP.
        reduce_scatter: contractions may reduce-scatter their partial sums (IntraOptions); the
            data-parallel and ZeRO-2 baselines never do (they all-reduce by definition). On by
            default: GPU collectives run it as such, and it predicts published runs better
            (docs/validation.md).
        chunks: model chunks per device the stage DP plans for (1: 1F1B; more: interleaved
            1F1B, InterOptions.chunks).
        node_local_sends: consecutive stages placed in one node hand off on its link
            (InterOptions.node_local_sends).
        kernels: the kernel and link efficiencies (meshplan.cost.kernels; the closed-form
            layouts are priced with the same set).
        fp32_grads: gradients accumulated, held and reduced in fp32 (Megatron's default, as the
            closed-form layouts price them unless `fp32grads=off`).
        overlap: gradient reductions overlapped with the last micro-batch's backward pass
            (InterOptions.overlap_tail).
        mesh_axes: 2 prices each sub-mesh on Alpa's 2-D views; 3 also on the 3-D views of
            sub-meshes of 8 or more devices (Cluster.logical_views), e.g. data x sequence x
            tensor, at the price of more views to plan; "refine" plans on 2-D views, then
            prices the 3-D views of the sub-mesh shapes the best plan's stages use (at its
            micro-batch size) and runs the stage DP again with them (never a slower plan).
    """

    efficiency: float = 0.5
    gemm_curve: bool = True
    memory_fraction: float = 0.9
    microbatch_sizes: tuple[int, ...] = ()
    max_microbatch_sizes: int = 3
    workers: int = 2
    relative_bucket: float = 0.0
    time_limit: float = 30.0
    reduce_scatter: bool = True
    chunks: tuple[int, ...] = (1, 2, 4)
    node_local_sends: bool = True
    kernels: KernelEfficiency = DEFAULT_EFFICIENCY
    fp32_grads: bool = True
    overlap: bool = True
    mesh_axes: int | str = 2

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1 or not 0 < self.memory_fraction <= 1:
            raise OptionsError("efficiency and memory_fraction must be in (0, 1]")
        if not self.chunks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.chunks):
            raise OptionsError(f"chunks {self.chunks!r}: give model chunks per device as positive integers, "
                               "e.g. --chunks 1,2,4 (1 alone: plain 1F1B)")
        if isinstance(self.mesh_axes, bool) or self.mesh_axes not in MESH_AXES:
            raise OptionsError(f"mesh_axes = {self.mesh_axes!r}: the planner prices 2-D views (2), also 3-D views "
                               "of stages of 8 or more devices (3), or 2-D views and then the 3-D views of the "
                               "best plan's stages (refine); write --mesh-axes 2, 3 or refine")

    @property
    def view_axes(self) -> int:
        """The most axes of the views priced with these options (Cluster.logical_views'
        max_axes): "refine" prices its first pass, and every baseline, on 2-D views."""
        return 3 if self.mesh_axes == 3 else 2
