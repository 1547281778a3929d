"""The graphs CFP plans: a stack of transformer blocks of a model preset (model spec -> Graph).

CFP plans the repeated part of a model, the transformer blocks, on activations [batch, seq,
hidden]: the forward step, or a training step (forward and backward: the gradients of the input
and of every weight, as a pipeline stage computes them; the optimizer update is not included).
The embedding and LM head stay outside its graph, so the vocabulary size does not matter here.
On CPU devices the presets are too large to profile every strategy combination in minutes, so
`reduced_config` shrinks the sizes (keeping the block structure: norms, attention, MLP or MoE,
and the layer count) and says what it changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import ModelSpecError
from meshplan.ir import DType, Graph, GraphBuilder, OpKind, as_dtype
from meshplan.ir.autodiff import append_backward
from meshplan.models.blocks import block
from meshplan.models.transformer import TransformerConfig, model_config

# Caps of the reduced sizes: one block's forward is then tens of MFLOP (milliseconds on a CPU).
REDUCED = {"hidden": 128, "heads": 4, "experts": 8, "seq_len": 128}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What to build: a transformer config, how many of its blocks, on what activations.

    Attributes:
        config: sizes and block flavour (GPT, LLaMA, MoE, ...).
        layers: blocks in the stack.
        batch, seq_len: activation shape [batch, seq_len, hidden].
        dtype: element type of weights and activations.
        changes: what `reduced_config` changed, e.g. ("hidden 768 -> 128",), for reports.
        train: build the training step (forward and backward), not the forward alone.
    """

    config: TransformerConfig
    layers: int
    batch: int
    seq_len: int
    dtype: DType = DType.F32
    changes: tuple[str, ...] = ()
    train: bool = False

    @property
    def name(self) -> str:
        return f"{self.config.name}.{self.layers}l" + (".train" if self.train else "")

    def describe(self) -> str:
        c = self.config
        text = (f"{c.name}: {self.layers} layers, hidden {c.hidden}, heads {c.heads}, ffn {c.ffn}"
                + (f", {c.experts} experts" if c.experts else "")
                + f", batch {self.batch}, seq {self.seq_len}, {self.dtype}, "
                + ("training step (forward and backward)" if self.train else "forward step"))
        return text + (f" (reduced for CPU devices: {', '.join(self.changes)})" if self.changes else "")


def model_spec(model: str, layers: int, batch: int, seq_len: int = 0, reduced: bool = True,
               dtype: DType | str = DType.F32, train: bool = False, **overrides: int) -> ModelSpec:
    """A ModelSpec from a preset name or a Hugging Face config.json path.

    Args:
        model: e.g. "gpt3-125m", "llama2-7b", "moe-1.3b", or a path to a config.json.
        layers: blocks in the stack (0 builds a graph without contractions, which CFP refuses).
        batch: sequences per step.
        seq_len: tokens per sequence; 0 takes the model's context length.
        reduced: shrink sizes to REDUCED's caps (for CPU devices).
        dtype: element type.
        train: the training step instead of the forward step.
        **overrides: sizes set explicitly (hidden, heads, ffn, experts), applied before reducing.

    Raises:
        ModelSpecError: unknown model, or sizes out of range.
    """
    if layers < 0 or batch < 1 or seq_len < 0:
        raise ModelSpecError(f"layers ({layers}) must be >= 0, batch ({batch}) >= 1 and seq_len ({seq_len}) >= 0")
    config = model_config(model)
    given = {k: v for k, v in overrides.items() if v}
    if given.get("hidden") and not given.get("heads"):  # the preset's heads may not divide the new size
        given["heads"] = _divisor_at_most(given["hidden"], config.heads)
    if given:
        kv = _divisor_at_most(given.get("heads", config.heads), config.num_kv_heads) if config.kv_heads else None
        config = config.replace(**given, kv_heads=kv, ffn=given.get("ffn") or _scaled_ffn(config, given.get("hidden")))
    seq_len = seq_len or config.max_seq_len
    changes: tuple[str, ...] = ()
    if reduced:
        config, seq_len, changes = reduced_config(config, seq_len)
    return ModelSpec(config, layers, batch, seq_len, as_dtype(dtype), changes, train)


def reduced_config(config: TransformerConfig, seq_len: int) -> tuple[TransformerConfig, int, tuple[str, ...]]:
    """Sizes capped at REDUCED (heads and key/value heads divide the hidden size; the MLP keeps
    its ratio to the hidden size); returns the config, the sequence length and what changed."""
    hidden = min(config.hidden, REDUCED["hidden"])
    heads = _divisor_at_most(hidden, min(config.heads, REDUCED["heads"]))
    kv_heads = _divisor_at_most(heads, config.num_kv_heads) if config.kv_heads else None
    experts = min(config.experts, REDUCED["experts"])
    new = config.replace(hidden=hidden, heads=heads, kv_heads=kv_heads, experts=experts,
                         ffn=_scaled_ffn(config, hidden))
    new_seq = min(seq_len, REDUCED["seq_len"])
    changes = tuple(f"{name} {old} -> {value}" for name, old, value in (
        ("hidden", config.hidden, new.hidden), ("heads", config.heads, new.heads), ("ffn", config.ffn, new.ffn),
        ("experts", config.experts, new.experts), ("seq", seq_len, new_seq)) if old != value)
    return new, new_seq, changes


def model_graph(spec: ModelSpec) -> Graph:
    """The graph of `spec.layers` blocks on activations x [batch, seq, hidden]; nodes carry their
    block's layer index (for reports only: CFP finds repeats by structure).

    Forward: the output activations. Training: the cotangent of the output is an input and the
    loss sum(out * cotangent) is differentiated, which is exactly the backward pass a pipeline
    stage runs; the outputs are the gradients of x and of every weight."""
    c = spec.config
    b = GraphBuilder(spec.name)
    x = b.parameter((spec.batch, spec.seq_len, c.hidden), spec.dtype, name="x")
    first_weight = len(b)
    out = x
    for index in range(spec.layers):
        with b.layer(index):
            out = block(b, out, c, index)
    if not spec.train or out == x:
        b.outputs(out)
        return b.build()
    weights = [n for n in range(first_weight, len(b)) if b.node(n).kind is OpKind.PARAMETER]
    cotangent = b.parameter(b.shape(out), spec.dtype, name="cotangent")
    loss = b.reduce(b.mul(out, cotangent), tuple(range(3)), name="loss")
    grads = append_backward(b, loss, [x, *weights])
    b.outputs(*dict.fromkeys(grads[v] for v in (x, *weights)))
    return b.build()


def _scaled_ffn(config: TransformerConfig, hidden: int | None) -> int:
    """The MLP width at `hidden`, in the preset's ratio, rounded to a multiple of 8."""
    if not hidden or hidden == config.hidden:
        return config.ffn
    return max(8, round(config.ffn * hidden / config.hidden / 8) * 8)


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, limit) + 1) if n % d == 0)
