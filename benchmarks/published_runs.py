"""Published, measured training runs with their full configurations (the validation set).

Every run is priced with the layout it was published with (`Run.layout`, the text
`meshplan simulate --layout` takes); the published iteration time is as the source states it
or derived from its stated throughput (the formula is given per source). docs/validation.md
holds the table these produce; tests/test_validation.py checks that it matches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cluster import Cluster, device_from_overrides, get_device
from meshplan.cost.kernels import DEFAULT_EFFICIENCY, KernelEfficiency
from meshplan.models.transformer import PRESETS, TransformerConfig
from meshplan.simulator import TrainingJob
from meshplan.simulator.analytic import LayoutPrediction, check_layout, price_layout
from meshplan.simulator.layout import parse_layout


@dataclass(frozen=True, slots=True)
class Run:
    """One published run.

    Attributes:
        name: short key.
        source: where the figures are published.
        model: the model as configured in the run.
        nodes, device: the cluster (8 GPUs per node for all runs here).
        global_batch, seq_len: sequences per iteration and tokens per sequence.
        layout: the published parallel layout, in `--layout` syntax.
        published_s: the published (or derived) seconds per iteration.
        microbatches: micro-batch sizes to choose from when the source does not state one.
        note: what the source leaves open and what is assumed.
    """

    name: str
    source: str
    model: TransformerConfig
    nodes: int
    device: str
    global_batch: int
    seq_len: int
    layout: str
    published_s: float
    microbatches: tuple[int, ...] = ()
    note: str = ""
    inter_bandwidth: float = 0.0

    @property
    def cluster(self) -> Cluster:
        device = get_device(self.device)
        if self.inter_bandwidth:
            device = device_from_overrides(device, name=f"{device.name}-custom", inter_bandwidth=self.inter_bandwidth)
        return Cluster(self.nodes, 8, device)

    @property
    def job(self) -> TrainingJob:
        return TrainingJob(self.model, self.global_batch, self.seq_len)

    @property
    def size(self) -> float:
        """Billions of parameters."""
        return self.model.num_params() / 1e9


def gpt(name: str, hidden: int, heads: int, layers: int, vocab: int = 51200, seq: int = 2048) -> TransformerConfig:
    """A GPT-3-style model as Megatron-LM configures it (LayerNorm, GELU MLP of 4h, learned
    positions, untied head)."""
    return TransformerConfig(name, "gpt", hidden, heads, layers, 4 * hidden, vocab, norm="layer", mlp="gelu",
                             rotary=False, learned_positions=True, max_seq_len=seq)


def narayanan_seconds(batch: int, layers: int, hidden: int, gpus: int, tflops: float, seq: int = 2048,
                      vocab: int = 51200) -> float:
    """Narayanan et al. 2021 Eq. 3 FLOPs (with recomputation) at the published TFLOP/s per GPU."""
    flops = 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (gpus * tflops * 1e12)


def nemo_seconds(batch: int, seq: int, gpus: int, tokens_per_gpu: float) -> float:
    """Iteration time from NeMo's published tokens per second per GPU."""
    return batch * seq / (gpus * tokens_per_gpu)


KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5"
NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473), Table 1"
NEMO = ("NVIDIA NeMo Framework 24.12 performance summary (DGX H100, FP8), "
        "docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html")
NEMO_TECHNIQUES = "recompute=none,zero=on,overlap=on,tpo=on,fp8=on,fp32grads=off"
NEMO_NOTE = ("the table gives degrees and batch sizes; sequence parallelism (with tp > 1), the distributed optimizer, "
             "overlapped gradient reduction and tensor-parallel communication, bf16 gradient reduction, fused "
             "attention and no recomputation are the NeMo performance recipes' settings")

_K_MODELS = {"22b": (gpt("gpt-22b", 6144, 64, 48), 1, 8, 1, 4, 1, (1.42, 1.10)),
             "175b": (gpt("gpt-175b", 12288, 96, 96), 8, 8, 8, 64, 3, (18.13, 13.75)),
             "530b": (gpt("gpt-530b", 20480, 128, 105), 35, 8, 35, 280, 1, (49.05, 37.83)),
             "1t": (gpt("gpt-1t", 25600, 160, 128), 64, 8, 64, 512, 1, (94.42, 71.49))}


def _korthikanti() -> list[Run]:
    runs = []
    for key, (model, nodes, tp, pp, batch, vp, (full, present)) in _K_MODELS.items():
        mb = 4 if key == "22b" else 1
        base = f"tp={tp},pp={pp},dp=1,vp={vp},mb={mb},flash=off"
        note = "interleaved schedule with 3 chunks" if vp > 1 else "plain 1F1B (the schedule is not stated)"
        runs.append(Run(f"korthikanti-{key}-full", f"{KORTHIKANTI}: full recomputation", model, nodes, "a100-80gb",
                        batch, 2048, f"{base},sp=off,recompute=full", full, note=note))
        runs.append(Run(f"korthikanti-{key}-sp-selective", f"{KORTHIKANTI}: sequence parallel + selective recompute",
                        model, nodes, "a100-80gb", batch, 2048, f"{base},sp=on,recompute=selective", present,
                        note=note))
    return runs


# params, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU (Narayanan et al. 2021, Table 1).
_N_ROWS = (("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
           ("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
           ("39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
           ("145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
           ("529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163))


def _narayanan() -> list[Run]:
    runs = []
    for key, heads, hidden, layers, tp, pp, gpus, batch, tflops in _N_ROWS:
        dp = gpus // (tp * pp)
        runs.append(Run(f"narayanan-{key}", f"{NARAYANAN}: {tflops} TFLOP/s per GPU", gpt(f"gpt-{key}", hidden, heads,
                                                                                          layers),
                        gpus // 8, "a100-80gb", batch, 2048, f"tp={tp},pp={pp},dp={dp},sp=off,recompute=full,flash=off",
                        narayanan_seconds(batch, layers, hidden, gpus, tflops), microbatches=(1, 2, 4, 8),
                        note="micro-batch size not published (the fastest of 1, 2, 4, 8 that fits); plain 1F1B"))
    return runs


def _nemo_gpt(name: str, hidden: int, heads: int, layers: int) -> TransformerConfig:
    return gpt(name, hidden, heads, layers, vocab=50304, seq=2048).replace(rotary=False)


def _nemo() -> list[Run]:
    llama2 = {k: PRESETS[k] for k in ("llama2-7b", "llama2-13b", "llama2-70b")}
    rows = (  # name, model, GPUs, batch, seq, tp, pp, cp, vp, mb, tokens/s/GPU
        ("gpt3-5b", _nemo_gpt("gpt3-5b", 4096, 32, 24), 64, 2048, 2048, 1, 1, 1, 1, 4, 23406),
        ("gpt3-20b", _nemo_gpt("gpt3-20b", 6144, 48, 44), 64, 256, 2048, 2, 1, 1, 1, 2, 5851),
        ("gpt3-175b-128", _nemo_gpt("gpt3-175b", 12288, 96, 96), 128, 256, 2048, 4, 8, 1, 6, 1, 716),
        ("gpt3-175b-512", _nemo_gpt("gpt3-175b", 12288, 96, 96), 512, 2048, 2048, 4, 8, 1, 6, 2, 825),
        ("llama2-7b", llama2["llama2-7b"], 8, 128, 4096, 1, 1, 1, 1, 1, 16934),
        ("llama2-13b", llama2["llama2-13b"], 16, 128, 4096, 1, 4, 1, 10, 1, 8715),
        ("llama2-70b", llama2["llama2-70b"], 64, 128, 4096, 4, 4, 1, 20, 1, 1728),
        ("llama3-8b", PRESETS["llama3.1-8b"], 8, 128, 8192, 1, 1, 2, 1, 1, 12273),
        ("llama3-70b", PRESETS["llama3.1-70b"], 64, 128, 8192, 4, 4, 2, 5, 1, 1524),
    )
    runs = []
    for name, model, gpus, batch, seq, tp, pp, cp, vp, mb, tokens in rows:
        dp = gpus // (tp * pp * cp)
        sp = "on" if tp > 1 else "off"
        layout = f"tp={tp},pp={pp},dp={dp},cp={cp},vp={vp},mb={mb},sp={sp},{NEMO_TECHNIQUES}"
        runs.append(Run(f"nemo-{name}", f"{NEMO}: {tokens} tokens/s per GPU", model, gpus // 8, "h100-80gb", batch,
                        seq, layout, nemo_seconds(batch, seq, gpus, tokens), note=NEMO_NOTE))
    return runs


BLOOM = Run("bloom-176b", "BigScience BLOOM tr11-176B-ml chronicles (2022-03-18): 105.22 s per iteration",
             gpt("bloom-176b", 14336, 112, 70, vocab=250880).replace(learned_positions=False), 48, "a100-80gb", 2048,
             2048, "tp=4,pp=12,dp=8,mb=2,sp=off,recompute=full,zero=on,flash=off", 105.22,
             note="Jean Zay nodes: 8 A100 80GB and 4 x 100 Gb/s Omni-Path, modelled as 50 Gb/s per GPU; "
                  "ZeRO-1 (the distributed optimizer), full recomputation, plain 1F1B",
             inter_bandwidth=4 * 100e9 / 8 / 8)

RUNS: tuple[Run, ...] = (*_korthikanti(), *_narayanan(), *_nemo(), BLOOM)


def price_run(run: Run, efficiency: KernelEfficiency = DEFAULT_EFFICIENCY) -> LayoutPrediction | None:
    """The run priced with its published layout; where the micro-batch size is not published,
    the fastest of `run.microbatches` that fits (None: none fits)."""
    layout = parse_layout(run.layout)
    candidates = [replace(layout, mb=b) for b in run.microbatches] or [layout]
    priced = [price_layout(run.job, run.cluster, c, efficiency) for c in candidates
              if not check_layout(run.job, run.cluster, c)]
    fitting = [p for p in priced if p.fits]
    return min(fitting, key=lambda p: p.iteration_time) if fitting else None


@dataclass(frozen=True, slots=True)
class MemoryRun:
    """A run with a published peak memory per GPU (torchtitan's tables)."""

    name: str
    model: TransformerConfig
    nodes: int
    seq_len: int
    layout: str
    published_gib: float
    tokens_per_gpu: float

    @property
    def cluster(self) -> Cluster:
        # Grand Teton hosts: H100 with 96 GB HBM2e at 2.4 TB/s, 400 Gb/s per GPU, 500 W.
        device = device_from_overrides(get_device("h100-80gb"), name="h100-96gb", memory_bytes=96 * 2**30,
                                       memory_bandwidth=2.4e12)
        return Cluster(self.nodes, 8, device)

    @property
    def job(self) -> TrainingJob:
        layout = parse_layout(self.layout)
        return TrainingJob(self.model.replace(max_seq_len=self.seq_len), layout.dp * layout.mb, self.seq_len)

    @property
    def published_s(self) -> float:
        return self.job.tokens / (self.tokens_per_gpu * self.cluster.num_devices)


TORCHTITAN = ("torchtitan docs/performance.md (Llama 3.1 on H100 96GB, torch.compile + Float8, "
              "full activation checkpointing)")
_TT = "recompute=full,fsdp=on,overlap=on,fp8=on"
MEMORY_RUNS: tuple[MemoryRun, ...] = (
    MemoryRun("torchtitan-8b-fsdp8", PRESETS["llama3.1-8b"], 1, 32768, f"tp=1,pp=1,dp=8,mb=1,{_TT}", 83.9, 3890),
    MemoryRun("torchtitan-8b-fsdp4-cp2", PRESETS["llama3.1-8b"], 1, 65536, f"tp=1,pp=1,dp=4,cp=2,mb=1,{_TT}", 84.2,
              2540),
    MemoryRun("torchtitan-8b-fsdp2-cp4", PRESETS["llama3.1-8b"], 1, 131072, f"tp=1,pp=1,dp=2,cp=4,mb=1,{_TT}", 84.0,
              1071),
    MemoryRun("torchtitan-8b-cp8", PRESETS["llama3.1-8b"], 1, 262144, f"tp=1,pp=1,dp=1,cp=8,mb=1,{_TT}", 84.5, 548),
    MemoryRun("torchtitan-70b-fsdp32-tp8", PRESETS["llama3.1-70b"], 32, 8192, f"tp=8,pp=1,dp=32,mb=16,sp=on,{_TT}",
              71.9, 829),
)


def price_memory_run(run: MemoryRun) -> LayoutPrediction:
    """The run priced with its layout (all of the device's memory counted as usable)."""
    return price_layout(run.job, run.cluster, parse_layout(run.layout), memory_fraction=1.0)
