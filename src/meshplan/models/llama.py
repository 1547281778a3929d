"""LLaMA graph builders (RMSNorm, multi-head attention with softmax, residuals, SwiGLU)."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import ModelSpecError
from meshplan.ir import DType, Graph, GraphBuilder


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Sizes of a LLaMA model."""

    hidden: int
    heads: int
    layers: int
    ffn: int
    vocab: int = 32000
    kv_heads: int | None = None

    def check(self) -> None:
        for name in ("hidden", "heads", "layers", "ffn"):
            if getattr(self, name) < 1:
                raise ModelSpecError(f"LLaMA {name} must be at least 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ModelSpecError(f"LLaMA hidden size {self.hidden} is not divisible by {self.heads} heads")


LLAMA_PRESETS = {
    "llama2-7b": LlamaConfig(hidden=4096, heads=32, layers=32, ffn=11008),
    "llama2-13b": LlamaConfig(hidden=5120, heads=40, layers=40, ffn=13824),
    "llama2-70b": LlamaConfig(hidden=8192, heads=64, layers=80, ffn=28672, kv_heads=8),
}


def llama_forward(batch: int = 200, seq_len: int = 4096, hidden: int = 5120, heads: int = 40,
                  layers: int = 40, ffn: int = 13824, force_replicated_output: bool = False,
                  dtype: DType | str = DType.F16, name: str = "llama_forward") -> Graph:
    """The forward pass of `layers` LLaMA decoder blocks on activations [batch, seq_len, hidden].

    Each block: RMSNorm, q/k/v projections per head, softmax(q k^T / sqrt(d)) v, output
    projection, residual; RMSNorm, SwiGLU FFN (w2(silu(x w1) * x w3)), residual. Nodes carry
    their layer index so repeated blocks can share one sharding choice.
    """
    LlamaConfig(hidden, heads, layers, ffn).check()
    if batch < 1 or seq_len < 1:
        raise ModelSpecError(f"batch ({batch}) and seq_len ({seq_len}) must be at least 1")
    b = GraphBuilder(name)
    x = b.parameter((batch, seq_len, hidden), dtype, name="x")
    for layer in range(layers):
        with b.layer(layer, f"layer{layer}"):
            x = _decoder_block(b, x, layer, batch, seq_len, hidden, heads, ffn, dtype)
    b.outputs(x, force_replicated=force_replicated_output)
    return b.build()


def _rms_norm(b: GraphBuilder, x: int, prefix: str, dtype) -> int:
    batch, seq, hidden = b.shape(x)
    mean_sq = b.reduce(b.mul(x, x), (2,))
    mean_sq = b.mul(mean_sq, b.broadcast(b.constant(value=1 / hidden, dtype=dtype), (batch, seq), ()))
    inv = b.rsqrt(b.add(mean_sq, b.broadcast(b.constant(value=1e-5, dtype=dtype), (batch, seq), ())))
    normed = b.mul(x, b.broadcast(inv, (batch, seq, hidden), (0, 1)))
    gain = b.parameter((hidden,), dtype, name=f"{prefix}.gain")
    return b.mul(normed, b.broadcast(gain, (batch, seq, hidden), (2,)))


def _decoder_block(b: GraphBuilder, x: int, layer: int, batch: int, seq: int, hidden: int, heads: int,
                   ffn: int, dtype) -> int:
    p = f"layer{layer}"
    d = hidden // heads
    h = _rms_norm(b, x, f"{p}.attn_norm", dtype)
    q, k, v = (b.dot(h, b.parameter((hidden, heads, d), dtype, name=f"{p}.w{n}"), (2,), (0,), name=f"{p}.{n}")
               for n in "qkv")  # [batch, seq, heads, d]
    scores = b.dot(q, k, (3,), (3,), (0, 2), (0, 2), name=f"{p}.scores")  # [batch, heads, seq_q, seq_k]
    shape = (batch, heads, seq, seq)
    scores = b.mul(scores, b.broadcast(b.constant(value=d ** -0.5, dtype=dtype), shape, ()))
    peak = b.broadcast(b.reduce(scores, (3,), "max"), shape, (0, 1, 2))
    e = b.exp(b.sub(scores, peak))
    probs = b.div(e, b.broadcast(b.reduce(e, (3,)), shape, (0, 1, 2)), name=f"{p}.probs")
    ctx = b.dot(probs, v, (3,), (1,), (0, 1), (0, 2), name=f"{p}.context")  # [batch, heads, seq, d]
    wo = b.parameter((heads, d, hidden), dtype, name=f"{p}.wo")
    attn = b.dot(ctx, wo, (1, 3), (0, 1), name=f"{p}.attn_out")  # [batch, seq, hidden]
    x = b.add(x, attn, name=f"{p}.attn_residual")
    h = _rms_norm(b, x, f"{p}.ffn_norm", dtype)
    gate = b.dot(h, b.parameter((hidden, ffn), dtype, name=f"{p}.w1"), (2,), (0,), name=f"{p}.gate")
    up = b.dot(h, b.parameter((hidden, ffn), dtype, name=f"{p}.w3"), (2,), (0,), name=f"{p}.up")
    act = b.mul(b.mul(gate, b.logistic(gate)), up)
    down = b.dot(act, b.parameter((ffn, hidden), dtype, name=f"{p}.w2"), (2,), (0,), name=f"{p}.down")
    return b.add(x, down, name=f"{p}.ffn_residual")
