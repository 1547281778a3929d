"""Kernel efficiency: how close GEMMs, attention, element-wise kernels and links get to peak.

One fixed set of constants prices every run (docs/validation.md states them; nothing is fitted
per run). A measured set can replace it: `KernelEfficiency.from_file` reads the same fields
from JSON, or the GEMM curve `meshplan profile-cluster` fits to the cluster's own GEMMs.

GEMM efficiency follows the shape of NVIDIA's "Matrix Multiplication Background User's Guide"
(GEMM throughput against M, N, K): throughput rises with each dimension and saturates, small
dimensions leave SMs idle (tile and wave quantization). Each dimension x contributes a factor
x / (x + half), so a GEMM reaches `gemm_max` of peak only when all three dimensions are large,
and a thin GEMM (a small hidden size, a high tensor-parallel degree, one short sequence) runs
visibly slower. That is what a single constant cannot express: published runs show GEMM
efficiency rising with hidden size and falling with the tensor-parallel degree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from meshplan.cluster.devices import DeviceSpec
from meshplan.errors import OptionsError

# The backward of fused (flash) attention recomputes the score product before its own two
# products per forward one: 2.5 forward products in all, 1.25 per backward product.
FLASH_BACKWARD_RECOMPUTE = 1.25
# Mixed-precision Adam keeps an fp32 master copy and two fp32 moments per parameter.
ADAM_STATE_BYTES = 12
# Device memory a training step holds beyond its tensors: cuBLAS workspaces, NCCL buffers,
# allocator slack.
WORKSPACE_BYTES = 1.0 * 2**30


@dataclass(frozen=True, slots=True)
class KernelEfficiency:
    """Fractions of peak that kernels sustain.

    Attributes:
        gemm_max: the best fraction of the dtype's peak FLOP/s a large GEMM reaches.
        gemm_half: the GEMM dimension at which its factor x / (x + half) is one half.
        fp8_max: as gemm_max for fp8 GEMMs (scaling and casting kernels around them cost more).
        attention: fraction of bf16 peak of fused (flash) attention, forward and backward.
        memory: fraction of HBM bandwidth element-wise kernels sustain.
        link: fraction of a link's nominal bandwidth collectives sustain (NCCL bus bandwidth).
        tp_overlap_hidden: share of tensor-parallel communication hidden behind GEMMs when a
            layout overlaps them (Transformer Engine userbuffers, `tpo=on`).
        dp_overlap_tail: share of data-parallel gradient communication still exposed when it is
            overlapped with the backward pass (the last bucket waits for the last gradient).
        per_layer_overhead_s: launch and framework time per layer and micro-batch (forward and
            backward together), independent of sizes.
    """

    gemm_max: float = 0.80
    gemm_half: float = 96.0
    fp8_max: float = 0.62
    attention: float = 0.50
    memory: float = 0.70
    link: float = 0.75
    tp_overlap_hidden: float = 0.6
    dp_overlap_tail: float = 0.1
    per_layer_overhead_s: float = 2e-4

    def __post_init__(self) -> None:
        for name in ("gemm_max", "fp8_max", "attention", "memory", "link"):
            if not 0 < getattr(self, name) <= 1:
                raise OptionsError(f"kernel efficiency {name} = {getattr(self, name)!r} must be in (0, 1]")
        for name in ("tp_overlap_hidden", "dp_overlap_tail"):
            if not 0 <= getattr(self, name) <= 1:
                raise OptionsError(f"kernel efficiency {name} = {getattr(self, name)!r} must be in [0, 1]")
        if self.gemm_half < 0 or self.per_layer_overhead_s < 0:
            raise OptionsError("kernel efficiency gemm_half and per_layer_overhead_s must be >= 0")

    def gemm(self, m: float, n: float, k: float, fp8: bool = False) -> float:
        """Fraction of the dtype's peak an (m x k) @ (k x n) GEMM sustains."""
        shape = 1.0
        for x in (m, n, k):
            shape *= x / (x + self.gemm_half)
        return (self.fp8_max if fp8 else self.gemm_max) * shape

    @classmethod
    def from_file(cls, path: str | Path) -> KernelEfficiency:
        """Efficiencies from a JSON object of some of this class's fields (others keep defaults),
        or from a cluster file of `meshplan profile-cluster` (its measured "kernel_efficiency").

        Raises:
            OptionsError: the file is missing, not JSON, or names an unknown field.
        """
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise OptionsError(f"efficiency file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as exc:
            raise OptionsError(f"efficiency file {str(path)!r} is not valid JSON: {exc}") from None
        known = {f.name for f in fields(cls)}
        if isinstance(raw, dict) and isinstance(raw.get("kernel_efficiency"), dict):
            raw = raw["kernel_efficiency"]
        if not isinstance(raw, dict) or set(raw) - known:
            unknown = sorted(set(raw) - known) if isinstance(raw, dict) else raw
            raise OptionsError(f"efficiency file {str(path)!r}: unknown fields {unknown}; use {sorted(known)}")
        return replace(cls(), **{k: float(v) for k, v in raw.items()})


DEFAULT_EFFICIENCY = KernelEfficiency()


def gemm_seconds(device: DeviceSpec, efficiency: KernelEfficiency, m: float, n: float, k: float,
                 batch: float = 1.0, fp8: bool = False) -> float:
    """`batch` (m x k) @ (k x n) GEMMs at the dtype's peak times the GEMM efficiency curve."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    peak = device.fp8_flops if fp8 else device.peak_flops
    return batch * 2 * m * n * k / (peak * efficiency.gemm(m, n, k, fp8))


def fused_attention_seconds(device: DeviceSpec, efficiency: KernelEfficiency, flops: float, causal: bool,
                            backward: bool = False) -> float:
    """Fused (flash) attention over the FLOPs of its score and context products: causal kernels
    skip the masked half; the backward recomputes the scores (FLASH_BACKWARD_RECOMPUTE)."""
    share = (0.5 if causal else 1.0) * (FLASH_BACKWARD_RECOMPUTE if backward else 1.0)
    return flops * share / (device.peak_flops * efficiency.attention)


def memory_seconds(device: DeviceSpec, efficiency: KernelEfficiency, nbytes: float) -> float:
    """A memory-bound kernel moving `nbytes` through HBM (read and written together)."""
    bandwidth = device.memory_bandwidth or device.peak_flops / 100.0  # unknown HBM: a typical ratio
    return nbytes / (bandwidth * efficiency.memory)


@dataclass(frozen=True, slots=True)
class KernelCosts:
    """The kernel models of one device, as the op-level cost model calls them.

    Attributes:
        device: the device (peak FLOP/s, fp8 FLOP/s, HBM bandwidth).
        efficiency: the fractions of peak (one fixed set: DEFAULT_EFFICIENCY).
        flash: attention cores run as fused (flash) attention kernels.
        fp8: GEMMs run in fp8 (attention and element-wise kernels stay in the training dtype).
    """

    device: DeviceSpec
    efficiency: KernelEfficiency = DEFAULT_EFFICIENCY
    flash: bool = False
    fp8: bool = False

    def gemm(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        return gemm_seconds(self.device, self.efficiency, m, n, k, batch, self.fp8)

    def attention(self, flops: float, causal: bool, backward: bool) -> float:
        return fused_attention_seconds(self.device, self.efficiency, flops, causal, backward)

    def memory(self, nbytes: float) -> float:
        return memory_seconds(self.device, self.efficiency, nbytes)


def optimizer_step_bytes(weight_bytes: float, gradient_bytes: float, state_bytes: float = ADAM_STATE_BYTES) -> float:
    """HBM bytes one parameter's optimizer step moves: it reads the gradient and the state (master
    copy and moments) and writes the state and the new weight."""
    return gradient_bytes + 2 * state_bytes + weight_bytes
