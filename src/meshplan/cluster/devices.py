"""Device specs: a table of accelerators by name -> DeviceSpec (peak FLOP/s, memory, links).

Units: FLOP/s, bytes, bytes/s, seconds. Bandwidths are per direction and per device.

Memory is the marketed HBM size read as GiB (2**30 bytes): an "80 GB" A100 has 5 HBM2e stacks
of 16 GiB and `nvidia-smi` reports 81920 MiB. The driver and CUDA context take a few hundred
MiB of it; memory models should keep a reserve rather than this table shrinking capacities.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from meshplan.errors import MeshError

GiB = 2**30
GB_PER_S = 1e9  # bytes/s
GBIT_PER_S = 1e9 / 8  # bytes/s


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator and the links it uses.

    Attributes:
        name: lower-case table key, e.g. "a100-80gb".
        peak_flops: dense bf16/fp16 tensor-core FLOP/s (no sparsity).
        memory_bytes: device memory in bytes (inf: unlimited).
        intra_bandwidth: bytes/s per direction per device over the node's fabric (NVLink).
        intra_latency: seconds per collective step within a node.
        inter_bandwidth: bytes/s per direction per device across nodes (its share of the NICs).
        inter_latency: seconds per collective step across nodes.
        description: a short human-readable line for reports.
        memory_bandwidth: device memory (HBM) bytes/s, which bounds element-wise kernels
            (0: unknown; such kernels are then priced by FLOPs only).
        fp8_flops: dense fp8 tensor-core FLOP/s (0: the device has no fp8 tensor cores).
        flash_attention: fused attention kernels exist for the device (FlashAttention-2 needs
            Ampere or newer; AMD's CK kernels on MI300X), so attention keeps no seq x seq values.
        fp32_flops: dense fp32 FLOP/s where fp32 work cannot use the tensor cores (V100: no
            TF32); 0: fp32 work is priced at `peak_flops` (TF32 tensor cores on Ampere and newer,
            which XLA uses for fp32 contractions by default).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    description: str = ""
    memory_bandwidth: float = 0.0
    fp8_flops: float = 0.0
    flash_attention: bool = False
    fp32_flops: float = 0.0

    def __post_init__(self) -> None:
        for field in ("peak_flops", "intra_bandwidth", "inter_bandwidth"):
            _check_number(self.name, field, getattr(self, field), allow_zero=False)
        if self.memory_bytes != math.inf:  # inf: unlimited (devices whose memory is not modelled)
            _check_number(self.name, "memory_bytes", self.memory_bytes, allow_zero=False)
        for field in ("intra_latency", "inter_latency", "memory_bandwidth", "fp8_flops", "fp32_flops"):
            _check_number(self.name, field, getattr(self, field), allow_zero=True)

    def for_itemsize(self, itemsize: int) -> DeviceSpec:
        """The device as work of `itemsize`-byte floats sees it: fp32 work (4 bytes) at
        `fp32_flops` where the device has no fp32 tensor cores; otherwise unchanged."""
        if itemsize >= 4 and self.fp32_flops:
            return dataclasses.replace(self, peak_flops=self.fp32_flops)
        return self

    @property
    def intra_beta(self) -> float:
        """Seconds per byte within a node."""
        return 1.0 / self.intra_bandwidth

    @property
    def inter_beta(self) -> float:
        """Seconds per byte across nodes."""
        return 1.0 / self.inter_bandwidth


def _check_number(device: str, field: str, value: float, allow_zero: bool) -> None:
    ok = isinstance(value, numbers.Real) and math.isfinite(value) and (value > 0 or (allow_zero and value == 0))
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise MeshError(f"device {device!r}: {field} = {value!r} must be a finite number {bound}")


# Sources (dense, no sparsity; NVLink figures are the datasheets' bidirectional totals halved):
# - V100: NVIDIA Tesla V100 datasheet (SXM2: 125 TFLOPS tensor, 15.7 TFLOPS single precision,
#   900 GB/s HBM2, NVLink 300 GB/s total). It has no TF32: fp32 training (Alpa's Wide-ResNet
#   runs) multiplies on the CUDA cores at 15.7 TFLOP/s.
#   Inter-node: AWS p3dn.24xlarge (8x V100-32GB) has one 100 Gb/s ENA/EFA link per node;
#   we store its 1/8 share per GPU (12.5 Gb/s). Nodes with fewer GPUs per NIC are faster:
#   override inter_bandwidth.
# - A100: NVIDIA A100 Tensor Core GPU datasheet (SXM: 312 TFLOPS bf16, NVLink 600 GB/s
#   total); DGX A100 user guide (one 200 Gb/s HDR InfiniBand ConnectX-6 per GPU).
# - H100: NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS bf16 dense, 1,979 fp8 dense,
#   3.35 TB/s HBM3, NVLink 900 GB/s total); DGX H100 user guide (one 400 Gb/s NDR InfiniBand
#   ConnectX-7 per GPU).
# - H200: NVIDIA H200 Tensor Core GPU datasheet (SXM: same tensor cores as H100, 989 TFLOPS
#   bf16 and 1,979 fp8 dense; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s total); DGX H200: one
#   400 Gb/s ConnectX-7 per GPU.
# - B200: NVIDIA DGX B200 / HGX B200 datasheet (per GPU 2.25 PFLOPS bf16 and 4.5 PFLOPS fp8
#   dense, i.e. half the sparse figures; 8 TB/s HBM3e; NVLink 5 1.8 TB/s total); 192 GB is the
#   marketed size of one GPU (DGX B200 exposes 1,440 GB for 8, so read it as 180 GiB usable);
#   eight 400 Gb/s ConnectX-7 ports per 8-GPU system.
# - MI300X: AMD Instinct MI300X data sheet (1,307.4 TFLOPS bf16 dense, 2,614.9 fp8 dense, 192 GB
#   HBM3 at 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s bidirectional = 448 GB/s per
#   direction to its 7 peers); one 400 Gb/s NIC per GPU as in AMD's reference platforms.
# - A100 PCIe 40GB: NVIDIA A100 datasheet (PCIe: 312 TFLOPS bf16, 1,555 GB/s HBM2); without
#   NVLink bridges GPUs talk over PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction, ~25
#   effective); a 100 Gb/s Ethernet NIC shared by 8 GPUs.
# - HBM bandwidths: V100 900 GB/s, A100 40GB SXM 1,555 GB/s, A100 80GB SXM 2,039 GB/s
#   (the same datasheets).
# Latencies are typical orders of magnitude (NCCL step over NVLink ~ a few us, over IB ~10 us).
_INTRA_LATENCY = 5e-6
_INTER_LATENCY = 1e-5


def _spec(name: str, tflops: float, memory_gib: int, nvlink_gb_s: float, inter_gbit_s: float, desc: str,
          hbm_gb_s: float, fp8_tflops: float = 0.0, flash: bool = True, fp32_tflops: float = 0.0) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        peak_flops=tflops * 1e12,
        memory_bytes=memory_gib * GiB,
        intra_bandwidth=nvlink_gb_s * GB_PER_S,
        intra_latency=_INTRA_LATENCY,
        inter_bandwidth=inter_gbit_s * GBIT_PER_S,
        inter_latency=_INTER_LATENCY,
        description=desc,
        memory_bandwidth=hbm_gb_s * GB_PER_S,
        fp8_flops=fp8_tflops * 1e12,
        flash_attention=flash,
        fp32_flops=fp32_tflops * 1e12,
    )


_TABLE = (
    _spec("v100-16gb", 125, 16, 150, 100 / 8, "V100 SXM2 16GB, NVLink2, 100 Gb/s per 8-GPU node (AWS p3dn)",
          900, flash=False, fp32_tflops=15.7),
    _spec("v100-32gb", 125, 32, 150, 100 / 8, "V100 SXM2 32GB, NVLink2, 100 Gb/s per 8-GPU node (AWS p3dn)",
          900, flash=False, fp32_tflops=15.7),
    _spec("a100-40gb", 312, 40, 300, 200, "A100 SXM 40GB, NVLink3, 200 Gb/s HDR InfiniBand per GPU", 1555),
    _spec("a100-40gb-pcie", 312, 40, 32, 100 / 8, "A100 PCIe 40GB, PCIe Gen4 (no NVLink), 100 Gb/s per 8-GPU node",
          1555),
    _spec("a100-80gb", 312, 80, 300, 200, "A100 SXM 80GB, NVLink3, 200 Gb/s HDR InfiniBand per GPU", 2039),
    _spec("h100-80gb", 989, 80, 450, 400, "H100 SXM 80GB, NVLink4, 400 Gb/s NDR InfiniBand per GPU", 3350, 1979),
    _spec("h200-141gb", 989, 141, 450, 400, "H200 SXM 141GB HBM3e, NVLink4, 400 Gb/s NDR InfiniBand per GPU",
          4800, 1979),
    _spec("b200-192gb", 2250, 180, 900, 400, "B200 192GB (180 GiB usable), NVLink5, 400 Gb/s per GPU", 8000, 4500),
    _spec("mi300x-192gb", 1307.4, 192, 448, 400, "AMD MI300X 192GB HBM3, Infinity Fabric, 400 Gb/s per GPU",
          5300, 2614.9),
)

DEVICES: Mapping[str, DeviceSpec] = MappingProxyType({d.name: d for d in _TABLE})  # read-only


def get_device(name: str) -> DeviceSpec:
    """Look a device up by name (case-insensitive).

    Raises:
        MeshError: the name is unknown; the message lists known names and a close match.
    """
    key = name.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    close = difflib.get_close_matches(key, DEVICES, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise MeshError(
        f"unknown device {name!r}; {hint}known devices: {', '.join(sorted(DEVICES))}. "
        "For other hardware start from the closest one with device_from_overrides(get_device(...), ...)."
    )


def device_from_overrides(base: DeviceSpec, **fields: float | str) -> DeviceSpec:
    """A copy of `base` with some fields replaced, e.g. `memory_bytes=24 * GiB`.

    Unless `name` is given, the copy is named "<base>-custom" so reports never pass it off as
    the table device, and `description` records the overrides.

    Raises:
        MeshError: a field name is unknown or a value is invalid.
    """
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise MeshError(f"device override {unknown} is not a DeviceSpec field; use one of {sorted(known)}")
    changes = ", ".join(f"{k}={v!r}" for k, v in fields.items() if k not in ("name", "description"))
    fields.setdefault("name", f"{base.name}-custom")
    fields.setdefault("description", f"{base.description}; overrides: {changes}" if changes else base.description)
    return dataclasses.replace(base, **fields)
