"""Forward graphs of transformer pieces: a decoder/encoder block, the embedding, the LM head.

Each builder appends to a GraphBuilder and returns the output node; activations are
[batch, seq, hidden]. Attention is written with grouped heads: q is [b, s, kv_heads, group, d]
so one code path covers multi-head (group = 1) and grouped-query attention.
"""

from __future__ import annotations

import math

from meshplan.ir import DType, GraphBuilder
from meshplan.models.transformer import TransformerConfig

# Dim names of inputs and weights (attribute "dims"); meshplan.ir.dimnames follows them through
# the graph, so a layout can say which dims it splits (meshplan.simulator.graph_pricing).
ACTIVATION_DIMS = ("batch", "seq", "hidden")
_EXPERT_IN = ("experts", "hidden", "expert_ffn")
DROPOUT = 0.1  # GPT-3's and BERT's dropout rate (the kept values' scale; it moves no cost)


def weight(b: GraphBuilder, shape: tuple[int, ...], dtype: DType, name: str, dims: tuple[str, ...]) -> int:
    """A parameter (a weight or an input) whose dims carry `dims`."""
    node = b.parameter(shape, dtype, name=name)
    b.tag(node, dims=dims)
    return node


def norm(b: GraphBuilder, x: int, cfg: TransformerConfig, prefix: str) -> int:
    """RMSNorm or LayerNorm over the last dim, with a learned gain (and bias for LayerNorm)."""
    batch, seq, hidden = b.shape(x)
    dtype = b.node(x).dtype
    if cfg.norm == "layer":
        mean = b.mul(b.reduce(x, (2,)), b.full((batch, seq), 1 / hidden, dtype))
        x = b.sub(x, b.broadcast(mean, (batch, seq, hidden), (0, 1)))
    mean_sq = b.mul(b.reduce(b.mul(x, x), (2,)), b.full((batch, seq), 1 / hidden, dtype))
    inv = b.rsqrt(b.add(mean_sq, b.full((batch, seq), 1e-5, dtype)))
    out = b.mul(x, b.broadcast(inv, (batch, seq, hidden), (0, 1)))
    gain = weight(b, (hidden,), dtype, f"{prefix}.gain", ("hidden",))
    out = b.mul(out, b.broadcast(gain, (batch, seq, hidden), (2,)))
    if cfg.norm == "layer":
        bias = weight(b, (hidden,), dtype, f"{prefix}.bias", ("hidden",))
        out = b.add(out, b.broadcast(bias, (batch, seq, hidden), (2,)))
    return out


def _bias(b: GraphBuilder, x: int, name: str) -> int:
    shape = b.shape(x)
    bias = b.parameter((shape[-1],), b.node(x).dtype, name=name)  # its dim is named through the add
    return b.add(x, b.broadcast(bias, shape, (len(shape) - 1,)))


def _dropout(b: GraphBuilder, x: int) -> int:
    """Dropout as Megatron's fused kernels run it: a one-byte keep mask made in the kernel and
    written for the backward pass, the kept values scaled by 1 / (1 - p). Costs need the mask's
    bytes, not its randomness: it is made from x itself (x == x keeps all; every backend lowers
    it, and it is laid out as x is, as a random mask drawn per shard would be)."""
    shape, dtype = b.shape(x), b.node(x).dtype
    keep = b.compare(x, x, "eq")
    b.tag(keep, saved=True)
    return b.select(keep, b.mul(x, b.full(shape, 1 / (1 - DROPOUT), dtype)), b.zeros(shape, dtype))


def _shift(b: GraphBuilder, x: int, dim: int) -> int:
    """The row maximum a stable softmax subtracts, rounded down: a constant shift whose gradient
    cancels, which the floor keeps out of the backward pass (as frameworks stop its gradient)."""
    return b.unary("floor", b.reduce(x, (dim,), "max"))


def _softmax(b: GraphBuilder, x: int) -> int:
    shape = b.shape(x)
    last = len(shape) - 1
    keep = tuple(range(last))
    peak = b.broadcast(_shift(b, x, last), shape, keep)
    e = b.exp(b.sub(x, peak))
    return b.div(e, b.broadcast(b.reduce(e, (last,)), shape, keep))


def _gelu(b: GraphBuilder, x: int) -> int:
    """tanh-approximated GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    shape, dtype = b.shape(x), b.node(x).dtype
    cube = b.mul(b.mul(x, x), x)
    inner = b.mul(b.add(x, b.mul(cube, b.full(shape, 0.044715, dtype))), b.full(shape, math.sqrt(2 / math.pi), dtype))
    return b.mul(b.mul(x, b.full(shape, 0.5, dtype)), b.add(b.tanh(inner), b.full(shape, 1.0, dtype)))


def attention(b: GraphBuilder, x: int, cfg: TransformerConfig, prefix: str) -> int:
    batch, seq, hidden = b.shape(x)
    dtype = b.node(x).dtype
    kvh, d = cfg.num_kv_heads, cfg.head_dim
    group = cfg.heads // kvh
    # One fused QKV projection (Megatron's): q, k and v are slices of its [b, s, kvh, group + 2, d]
    # output, so the tensor-parallel backward sums one input gradient, not three.
    wqkv = weight(b, (hidden, kvh, group + 2, d), dtype, f"{prefix}.wqkv", ("hidden", "kv_heads", "qkv", "head_dim"))
    qkv = b.dot(x, wqkv, (2,), (0,), name=f"{prefix}.qkv")
    start = lambda s: (0, 0, 0, s, 0)  # noqa: E731
    limit = lambda s: (batch, seq, kvh, s, d)  # noqa: E731
    q = b.slice(qkv, start(0), limit(group), name=f"{prefix}.q")  # [b, s, kvh, group, d]
    k = b.reshape(b.slice(qkv, start(group), limit(group + 1)), (batch, seq, kvh, d), name=f"{prefix}.k")
    v = b.reshape(b.slice(qkv, start(group + 1), limit(group + 2)), (batch, seq, kvh, d), name=f"{prefix}.v")
    if cfg.rotary:  # x * cos + rotate(x) * sin: two products and a sum per element
        q = b.add(b.mul(q, b.full(b.shape(q), 1.0, dtype)), b.mul(q, b.full(b.shape(q), 0.0, dtype)))
        k = b.add(b.mul(k, b.full(b.shape(k), 1.0, dtype)), b.mul(k, b.full(b.shape(k), 0.0, dtype)))
    # The attention core: one fused kernel with flash attention (meshplan.cost.fusion).
    with b.kernel("causal_attention" if cfg.causal else "attention"):
        scores = b.dot(q, k, (4,), (3,), (0, 2), (0, 2), name=f"{prefix}.scores")  # [b, kvh, s, group, s]
        shape = b.shape(scores)
        scores = b.mul(scores, b.full(shape, d ** -0.5, dtype))
        if cfg.causal:
            scores = b.add(scores, b.full(shape, 0.0, dtype))  # the mask: one add per score
        probs = _softmax(b, scores)
        if cfg.dropout:  # without flash attention the fused softmax writes the probabilities
            b.tag(probs, stored=True)
            probs = _dropout(b, probs)
        ctx = b.dot(probs, v, (4,), (1,), (0, 1), (0, 2), name=f"{prefix}.context")  # [b, kvh, s, group, d]
    wo = weight(b, (kvh, group, d, hidden), dtype, f"{prefix}.wo", ("kv_heads", "group", "head_dim", "hidden"))
    out = b.dot(ctx, wo, (1, 3, 4), (0, 1, 2), name=f"{prefix}.out")  # [b, s, hidden]
    return _bias(b, out, f"{prefix}.out_bias") if cfg.mlp == "gelu" else out


def mlp(b: GraphBuilder, x: int, cfg: TransformerConfig, prefix: str, width: int | None = None) -> int:
    """The dense MLP (SwiGLU or GELU with biases) of `width` (default: cfg.ffn)."""
    hidden, dtype = b.shape(x)[2], b.node(x).dtype
    width = width or cfg.ffn
    up = b.dot(x, weight(b, (hidden, width), dtype, f"{prefix}.w1", ("hidden", "ffn")), (2,), (0,), name=f"{prefix}.up")
    if cfg.mlp == "swiglu":
        gate = b.dot(x, weight(b, (hidden, width), dtype, f"{prefix}.w3", ("hidden", "ffn")), (2,), (0,),
                     name=f"{prefix}.gate")
        act = b.mul(b.mul(gate, b.logistic(gate)), up)
    else:
        act = _gelu(b, _bias(b, up, f"{prefix}.b1"))
    down = b.dot(act, weight(b, (width, hidden), dtype, f"{prefix}.w2", ("ffn", "hidden")), (2,), (0,),
                 name=f"{prefix}.down")
    return down if cfg.mlp == "swiglu" else _bias(b, down, f"{prefix}.b2")


def moe_mlp(b: GraphBuilder, x: int, cfg: TransformerConfig, prefix: str) -> int:
    """Mixture of experts by token permutation (Megatron-LM's, GShard's capacity): a softmax
    router; each expert takes its capacity of token slots (`top_k x capacity_factor` slots per
    token on average), gathers those tokens, runs its FFN (SwiGLU or
    GELU, as the dense MLP; the experts batched over the expert dim, tagged kernel "experts"),
    and the results are scattered back, weighted by their gates; plus the shared experts every
    token runs through (DeepSeek-MoE) as one dense MLP of their summed width. Sharding the
    expert dim makes the gather and the scatter all-to-alls (dispatch and combine)."""
    batch, seq, hidden = b.shape(x)
    dtype = b.node(x).dtype
    experts, width = cfg.experts, cfg.expert_width
    capacity = cfg.expert_capacity(seq)
    router = weight(b, (hidden, experts), dtype, f"{prefix}.gate", ("hidden", "experts"))
    gates = _softmax(b, b.dot(x, router, (2,), (0,), name=f"{prefix}.router"))  # [b, s, E]
    scores = b.transpose(gates, (0, 2, 1))  # [b, E, s]
    # The tokens each expert takes, [b, E, C]: costs need which rows move, not how well they are
    # chosen, so they come from the gates element-wise (a top-k would make XLA gather the scores
    # onto every device before its sort; Megatron's routing runs on each rank's own tokens).
    picked = b.slice(scores, (0, 0, 0), (batch, experts, capacity))
    slot = b.convert(b.mul(picked, b.full(b.shape(picked), seq - 1, dtype)), DType.I32, name=f"{prefix}.slots")
    slot_gate = b.gather(scores, slot, axis=2, batch_dims=2)  # [b, E, C]
    with b.kernel("experts"):  # from the dispatch to the combine: the experts' side
        expert_in = b.gather(x, slot, axis=1, batch_dims=1, name=f"{prefix}.dispatch")  # [b, E, C, h]
        w1 = weight(b, (experts, hidden, width), dtype, f"{prefix}.experts.w1", _EXPERT_IN)
        h1 = b.dot(expert_in, w1, (3,), (1,), (1,), (0,), name=f"{prefix}.experts.up")  # [E, b, C, f]
        if cfg.mlp == "swiglu":
            w3 = weight(b, (experts, hidden, width), dtype, f"{prefix}.experts.w3", _EXPERT_IN)
            gate = b.dot(expert_in, w3, (3,), (1,), (1,), (0,), name=f"{prefix}.experts.gate")
            h1 = b.mul(b.mul(gate, b.logistic(gate)), h1)
        else:
            h1 = _gelu(b, h1)
        w2 = weight(b, (experts, width, hidden), dtype, f"{prefix}.experts.w2", ("experts", "expert_ffn", "hidden"))
        h2 = b.dot(h1, w2, (3,), (1,), (0,), (0,), name=f"{prefix}.experts.down")  # [E, b, C, h]
        # Weighted by the gates where the experts run: only the small gates cross to them.
        gate_of_slot = b.broadcast(b.transpose(slot_gate, (1, 0, 2)), b.shape(h2), (0, 1, 2))
        weighted = b.transpose(b.mul(h2, gate_of_slot), (1, 0, 2, 3))  # [b, E, C, h]
        out = b.scatter_add((batch, seq, hidden), slot, weighted, axis=1, batch_dims=1, name=f"{prefix}.combine")
    if cfg.shared_experts:
        out = b.add(out, mlp(b, x, cfg, f"{prefix}.shared", cfg.shared_experts * width))
    return out


def block(b: GraphBuilder, x: int, cfg: TransformerConfig, index: int) -> int:
    """One pre-norm transformer block (post-norm for BERT is priced the same)."""
    prefix = f"layer{index}"
    dropout = _dropout if cfg.dropout else (lambda _, y: y)
    x = b.add(x, dropout(b, attention(b, norm(b, x, cfg, f"{prefix}.attn_norm"), cfg, f"{prefix}.attn")),
              name=f"{prefix}.attn_residual")
    b.tag(x, stored=True)  # the residual stream is written between the fused kernels
    ffn = moe_mlp if cfg.is_moe_layer(index) else mlp
    out = b.add(x, dropout(b, ffn(b, norm(b, x, cfg, f"{prefix}.ffn_norm"), cfg, f"{prefix}.mlp")),
                name=f"{prefix}.ffn_residual")
    b.tag(out, stored=True)
    return out


def embedding(b: GraphBuilder, cfg: TransformerConfig, batch: int, seq: int, dtype: DType) -> tuple[int, list[int]]:
    """Token (and learned position) embedding; returns the activations and the tables."""
    tokens = weight(b, (batch, seq), DType.I32, "tokens", ("batch", "seq"))
    table = weight(b, (cfg.vocab, cfg.hidden), dtype, "embed.table", ("vocab", "hidden"))
    x = b.gather(table, tokens, name="embed")
    tables = [table]
    if cfg.learned_positions:
        positions = weight(b, (seq, cfg.hidden), dtype, "embed.positions", ("seq", "hidden"))
        x = b.add(x, b.broadcast(positions, (batch, seq, cfg.hidden), (1, 2)))
        tables.append(positions)
    return x, tables


def lm_head_loss(b: GraphBuilder, x: int, cfg: TransformerConfig) -> int:
    """Final norm, vocabulary projection and softmax cross-entropy summed to a scalar; the
    cross-entropy runs on fp32 logits, written once (Megatron's vocabulary-parallel loss)."""
    batch, seq, hidden = b.shape(x)
    projection = weight(b, (hidden, cfg.vocab), b.node(x).dtype, "lm_head", ("hidden", "vocab"))
    logits = b.dot(norm(b, x, cfg, "final_norm"), projection, (2,), (0,), name="logits")
    dtype = DType.F32 if b.node(x).dtype.itemsize < 4 else b.node(x).dtype
    if dtype is not b.node(x).dtype:
        logits = b.convert(logits, dtype, name="logits.f32")
        b.tag(logits, stored=True)
    shape = (batch, seq, cfg.vocab)
    peak = _shift(b, logits, 2)
    shifted = b.sub(logits, b.broadcast(peak, shape, (0, 1)))
    lse = b.add(b.unary("log", b.reduce(b.exp(shifted), (2,))), peak)
    labels = weight(b, (batch, seq), DType.I32, "labels", ("batch", "seq"))
    hit = b.compare(b.iota(shape, 2), b.broadcast(labels, shape, (0, 1)), "eq")
    picked = b.reduce(b.select(hit, logits, b.zeros(shape, dtype)), (2,))
    return b.reduce(b.sub(lse, picked), (0, 1), name="loss")
