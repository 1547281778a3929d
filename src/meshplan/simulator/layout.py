"""A Megatron/NeMo-style layout as data: parallel degrees and the techniques a run turns on.

`parse_layout("tp=8,pp=8,dp=16,vp=3,mb=1,sp=on,recompute=selective")` gives the `Layout` that
`meshplan simulate --layout` prices (meshplan.simulator.analytic), so a recipe can be checked
before it runs. Ranks are ordered as Megatron orders them: tensor-parallel fastest, then
context-parallel, then data-parallel, then pipeline stages; devices left over are idle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from meshplan.errors import OptionsError

RECOMPUTE = ("none", "selective", "full")
_ON = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}
# Short names on the command line -> Layout fields.
_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "vp": "vp", "mb": "mb", "sp": "sp",
         "recompute": "recompute", "zero": "distributed_optimizer", "distopt": "distributed_optimizer",
         "overlap": "overlap", "tpo": "tp_overlap", "flash": "flash", "fp8": "fp8", "fp32grads": "fp32_grads",
         "fsdp": "fsdp"}


@dataclass(frozen=True, slots=True)
class Layout:
    """One parallel configuration.

    Attributes:
        tp, pp, dp, cp, ep: tensor-, pipeline-, data-, context- and expert-parallel degrees
            (ep splits the experts over data-parallel ranks; it must divide dp * cp).
        vp: model chunks per device (interleaved 1F1B when > 1).
        mb: sequences per micro-batch per data-parallel replica.
        sp: Megatron sequence parallelism (norms, dropout and residuals split over tp).
        recompute: "none", "selective" (the attention core only) or "full" (whole layers).
        distributed_optimizer: optimizer state sharded over data parallel (ZeRO-1); gradients
            reduce-scattered and weights all-gathered instead of all-reduced.
        overlap: data-parallel gradient communication overlapped with the backward pass.
        tp_overlap: tensor-parallel communication overlapped with GEMMs.
        flash: fused attention (no seq x seq values); None = when the device has the kernels.
        fp8: GEMMs in fp8 (Transformer Engine), attention and communication in bf16.
        fp32_grads: gradients accumulated and reduced in fp32 (Megatron's default for bf16
            training); off keeps them in the training dtype (NeMo's performance recipes).
        fsdp: fully sharded data parallel (ZeRO-3, PyTorch FSDP2): weights, gradients and
            optimizer state sharded over dp x cp; each layer's weights all-gathered for its
            forward and backward and its gradients reduce-scattered, under the compute.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vp: int = 1
    mb: int = 1
    sp: bool = False
    recompute: str = "none"
    distributed_optimizer: bool = False
    overlap: bool = False
    tp_overlap: bool = False
    flash: bool | None = None
    fp8: bool = False
    fp32_grads: bool = True
    fsdp: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "vp", "mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionsError(f"layout {name}={value!r} must be a positive integer")
        if self.recompute not in RECOMPUTE:
            raise OptionsError(f"layout recompute={self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        if (self.dp * self.cp) % self.ep:
            raise OptionsError(f"layout ep={self.ep} must divide dp * cp = {self.dp * self.cp} (experts are "
                               "split over data-parallel ranks)")
        if self.sp and self.tp == 1:
            raise OptionsError("layout sp=on needs tp > 1: sequence parallelism splits over the tensor-parallel "
                               "group")

    @property
    def devices(self) -> int:
        """Devices the layout occupies."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def stage_devices(self) -> int:
        return self.tp * self.cp * self.dp

    def text(self) -> str:
        """The layout as `parse_layout` reads it."""
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "ep", "vp") if getattr(self, k) != 1]
        parts += [f"mb={self.mb}", f"sp={'on' if self.sp else 'off'}", f"recompute={self.recompute}"]
        flags = (("zero", self.distributed_optimizer), ("fsdp", self.fsdp), ("overlap", self.overlap),
                 ("tpo", self.tp_overlap), ("fp8", self.fp8))
        parts += [f"{k}=on" for k, v in flags if v]
        if not self.fp32_grads:
            parts.append("fp32grads=off")
        if self.flash is not None:
            parts.append(f"flash={'on' if self.flash else 'off'}")
        return ",".join(parts)


def parse_layout(text: str) -> Layout:
    """Read `key=value` pairs separated by commas, e.g. "tp=8,pp=8,dp=16,vp=3,mb=1,sp=on".

    Keys: tp, pp, dp, cp, ep, vp, mb (integers); sp, zero (distributed optimizer), fsdp, overlap,
    tpo (tensor-parallel overlap), flash, fp8, fp32grads (on/off); recompute (none/selective/full).

    Raises:
        OptionsError: an unknown key, a malformed pair or an invalid value (one message naming it).
    """
    values: dict[str, object] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or key not in _KEYS:
            raise OptionsError(f"--layout {text!r}: {part!r} is not KEY=VALUE with KEY one of "
                               f"{', '.join(_KEYS)}; write e.g. tp=8,pp=8,dp=16,vp=3,mb=1,sp=on,recompute=selective")
        field = _KEYS[key]
        values[field] = _value(text, key, field, value)
    return Layout(**values)


def _value(text: str, key: str, field: str, value: str) -> object:
    kind = next(f.type for f in fields(Layout) if f.name == field)
    if field == "recompute":
        return value
    if "bool" in str(kind):
        if value not in _ON:
            raise OptionsError(f"--layout {text!r}: {key}={value!r} must be on or off")
        return _ON[value]
    try:
        return int(value)
    except ValueError:
        raise OptionsError(f"--layout {text!r}: {key}={value!r} must be an integer") from None
