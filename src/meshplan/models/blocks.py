"""Forward graphs of transformer pieces: a decoder/encoder block, the embedding, the LM head.

Each builder appends to a GraphBuilder and returns the output node; activations are
[batch, seq, hidden]. Attention is written with grouped heads: q is [b, s, kv_heads, group, d]
so one code path covers multi-head (group = 1) and grouped-query attention.
"""

from __future__ import annotations

import math

from meshplan.ir import DType, GraphBuilder
from meshplan.models.transformer import TransformerConfig


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
    gain = b.parameter((hidden,), dtype, name=f"{prefix}.gain")
    out = b.mul(out, b.broadcast(gain, (batch, seq, hidden), (2,)))
    if cfg.norm == "layer":
        bias = b.parameter((hidden,), dtype, name=f"{prefix}.bias")
        out = b.add(out, b.broadcast(bias, (batch, seq, hidden), (2,)))
    return out


def _bias(b: GraphBuilder, x: int, name: str) -> int:
    shape = b.shape(x)
    bias = b.parameter((shape[-1],), b.node(x).dtype, name=name)
    return b.add(x, b.broadcast(bias, shape, (len(shape) - 1,)))


def _softmax(b: GraphBuilder, x: int) -> int:
    shape = b.shape(x)
    last = len(shape) - 1
    keep = tuple(range(last))
    peak = b.broadcast(b.reduce(x, (last,), "max"), shape, keep)
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
    wq = b.parameter((hidden, kvh, group, d), dtype, name=f"{prefix}.wq")
    q = b.dot(x, wq, (2,), (0,), name=f"{prefix}.q")  # [b, s, kvh, group, d]
    k = b.dot(x, b.parameter((hidden, kvh, d), dtype, name=f"{prefix}.wk"), (2,), (0,), name=f"{prefix}.k")
    v = b.dot(x, b.parameter((hidden, kvh, d), dtype, name=f"{prefix}.wv"), (2,), (0,), name=f"{prefix}.v")
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
        ctx = b.dot(probs, v, (4,), (1,), (0, 1), (0, 2), name=f"{prefix}.context")  # [b, kvh, s, group, d]
    wo = b.parameter((kvh, group, d, hidden), dtype, name=f"{prefix}.wo")
    out = b.dot(ctx, wo, (1, 3, 4), (0, 1, 2), name=f"{prefix}.out")  # [b, s, hidden]
    return _bias(b, out, f"{prefix}.out_bias") if cfg.mlp == "gelu" else out


def mlp(b: GraphBuilder, x: int, cfg: TransformerConfig, prefix: str, width: int | None = None) -> int:
    """The dense MLP (SwiGLU or GELU with biases) of `width` (default: cfg.ffn)."""
    hidden, dtype = b.shape(x)[2], b.node(x).dtype
    width = width or cfg.ffn
    up = b.dot(x, b.parameter((hidden, width), dtype, name=f"{prefix}.w1"), (2,), (0,), name=f"{prefix}.up")
    if cfg.mlp == "swiglu":
        gate = b.dot(x, b.parameter((hidden, width), dtype, name=f"{prefix}.w3"), (2,), (0,),
                     name=f"{prefix}.gate")
        act = b.mul(b.mul(gate, b.logistic(gate)), up)
    else:
        act = _gelu(b, _bias(b, up, f"{prefix}.b1"))
    down = b.dot(act, b.parameter((width, hidden), dtype, name=f"{prefix}.w2"), (2,), (0,), name=f"{prefix}.down")
    return down if cfg.mlp == "swiglu" else _bias(b, down, f"{prefix}.b2")


def moe_mlp(b: GraphBuilder, x: int, cfg: TransformerConfig, prefix: str) -> int:
    """GShard mixture of experts: top-k gating, dispatch to expert capacity slots, expert FFNs
    (SwiGLU or GELU, as the dense MLP) batched over experts, combine; plus the shared experts
    every token runs through (DeepSeek-MoE) as one dense MLP of their summed width. Sharding
    the expert dim makes the dispatch an all-to-all."""
    batch, seq, hidden = b.shape(x)
    dtype = b.node(x).dtype
    experts, width = cfg.experts, cfg.expert_width
    capacity = max(1, math.ceil(cfg.top_k * cfg.capacity_factor * seq / experts))
    gates = _softmax(b, b.dot(x, b.parameter((hidden, experts), dtype, name=f"{prefix}.gate"), (2,), (0,),
                              name=f"{prefix}.router"))  # [b, s, E]
    slots = (batch, seq, experts, capacity)
    # Top-k selection and capacity assignment: a comparison against the k-th gate and a
    # position mask per slot (elementwise work on [b, s, E, C]).
    spread = b.broadcast(gates, slots, (0, 1, 2))
    chosen = b.compare(spread, b.full(slots, 1.0 / experts, dtype), "ge")
    combine = b.select(chosen, spread, b.zeros(slots, dtype))
    dispatch = b.select(chosen, b.full(slots, 1.0, dtype), b.zeros(slots, dtype))
    expert_in = b.dot(dispatch, x, (1,), (1,), (0,), (0,), name=f"{prefix}.dispatch")  # [b, E, C, h]
    w1 = b.parameter((experts, hidden, width), dtype, name=f"{prefix}.experts.w1")
    h1 = b.dot(expert_in, w1, (3,), (1,), (1,), (0,), name=f"{prefix}.experts.up")  # [E, b, C, f]
    if cfg.mlp == "swiglu":
        w3 = b.parameter((experts, hidden, width), dtype, name=f"{prefix}.experts.w3")
        gate = b.dot(expert_in, w3, (3,), (1,), (1,), (0,), name=f"{prefix}.experts.gate")
        h1 = b.mul(b.mul(gate, b.logistic(gate)), h1)
    else:
        h1 = _gelu(b, h1)
    w2 = b.parameter((experts, width, hidden), dtype, name=f"{prefix}.experts.w2")
    h2 = b.dot(h1, w2, (3,), (1,), (0,), (0,), name=f"{prefix}.experts.down")  # [E, b, C, h]
    out = b.dot(combine, h2, (2, 3), (0, 2), (0,), (1,), name=f"{prefix}.combine")  # [b, s, h]
    if cfg.shared_experts:
        out = b.add(out, mlp(b, x, cfg, f"{prefix}.shared", cfg.shared_experts * width))
    return out


def block(b: GraphBuilder, x: int, cfg: TransformerConfig, index: int) -> int:
    """One pre-norm transformer block (post-norm for BERT is priced the same)."""
    prefix = f"layer{index}"
    x = b.add(x, attention(b, norm(b, x, cfg, f"{prefix}.attn_norm"), cfg, f"{prefix}.attn"),
              name=f"{prefix}.attn_residual")
    b.tag(x, stored=True)  # the residual stream is written between the fused kernels
    ffn = moe_mlp if cfg.is_moe_layer(index) else mlp
    out = b.add(x, ffn(b, norm(b, x, cfg, f"{prefix}.ffn_norm"), cfg, f"{prefix}.mlp"),
                name=f"{prefix}.ffn_residual")
    b.tag(out, stored=True)
    return out


def embedding(b: GraphBuilder, cfg: TransformerConfig, batch: int, seq: int, dtype: DType) -> tuple[int, list[int]]:
    """Token (and learned position) embedding; returns the activations and the tables."""
    tokens = b.parameter((batch, seq), DType.I32, name="tokens")
    table = b.parameter((cfg.vocab, cfg.hidden), dtype, name="embed.table")
    x = b.gather(table, tokens, name="embed")
    tables = [table]
    if cfg.learned_positions:
        positions = b.parameter((seq, cfg.hidden), dtype, name="embed.positions")
        x = b.add(x, b.broadcast(positions, (batch, seq, cfg.hidden), (1, 2)))
        tables.append(positions)
    return x, tables


def lm_head_loss(b: GraphBuilder, x: int, cfg: TransformerConfig) -> int:
    """Final norm, vocabulary projection and softmax cross-entropy summed to a scalar."""
    batch, seq, hidden = b.shape(x)
    dtype = b.node(x).dtype
    logits = b.dot(norm(b, x, cfg, "final_norm"), b.parameter((hidden, cfg.vocab), dtype, name="lm_head"),
                   (2,), (0,), name="logits")
    shape = (batch, seq, cfg.vocab)
    peak = b.reduce(logits, (2,), "max")
    shifted = b.sub(logits, b.broadcast(peak, shape, (0, 1)))
    lse = b.add(b.unary("log", b.reduce(b.exp(shifted), (2,))), peak)
    labels = b.parameter((batch, seq), DType.I32, name="labels")
    hit = b.compare(b.iota(shape, 2), b.broadcast(labels, shape, (0, 1)), "eq")
    picked = b.reduce(b.select(hit, logits, b.zeros(shape, dtype)), (2,))
    return b.reduce(b.sub(lse, picked), (0, 1), name="loss")
