"""The graphs of Alpa's playground solver tests, rebuilt with GraphBuilder.

Alpa (alpa-projects/alpa, playground/auto_sharding_solver/test_solver_mlp.py and
test_solver_attention.py) checks its intra-op ILP on these graphs; meshplan's unit setting
must reproduce the objectives it asserts.
"""

from __future__ import annotations

from meshplan.ir import GraphBuilder


def mlp_2_layer(batch: int, hidden: int, bias: bool = False):
    """Forward, MSE-style gradient and SGD update of x @ w1 @ w2 (w <- w - grad aliased)."""
    b = GraphBuilder("mlp2" + ("_bias" if bias else ""))
    x = b.parameter((batch, hidden), name="x")
    y = b.parameter((batch, hidden), name="y")
    w1 = b.parameter((hidden, hidden), name="w1")
    w2 = b.parameter((hidden, hidden), name="w2")
    if bias:
        b1 = b.parameter((hidden,), name="b1")
        b2 = b.parameter((hidden,), name="b2")
    h1 = b.matmul(x, w1, name="h1")
    if bias:
        h1 = b.add(h1, b.broadcast(b1, (batch, hidden), (1,)))
    h2 = b.matmul(h1, w2, name="h2")
    if bias:
        h2 = b.add(h2, b.broadcast(b2, (batch, hidden), (1,)))
    loss = b.sub(h2, y, name="diff")
    scale = b.broadcast(b.constant(value=2 / batch / hidden), (batch, hidden), ())
    grad = b.mul(loss, scale, name="grad_out")
    gw2 = b.dot(h1, grad, (0,), (0,), name="grad_w2")
    nw2 = b.sub(w2, gw2, name="new_w2")
    gh1 = b.dot(grad, w2, (1,), (1,), name="grad_h1")
    gw1 = b.dot(x, gh1, (0,), (0,), name="grad_w1")
    nw1 = b.sub(w1, gw1, name="new_w1")
    outs = [nw1, nw2]
    if bias:
        nb1 = b.sub(b1, b.reduce(gh1, (0,)), name="new_b1")
        nb2 = b.sub(b2, b.reduce(grad, (0,)), name="new_b2")
        outs += [nb1, nb2]
    b.outputs(*outs)
    b.alias(w1, nw1)
    b.alias(w2, nw2)
    return b.build()


def mlp_n_layer(layers: int, batch: int, hidden: int):
    """The n-layer variant, with Alpa's quirk: the first middle weight's gradient reads the
    last middle activation (h_inter[-1]) rather than the first layer's output."""
    b = GraphBuilder(f"mlp{layers}")
    x = b.parameter((batch, hidden), name="x")
    y = b.parameter((batch, hidden), name="y")
    w_first = b.parameter((hidden, hidden), name="w_first")
    w_inter = [b.parameter((hidden, hidden), name=f"w_inter{i}") for i in range(layers - 2)]
    w_last = b.parameter((hidden, hidden), name="w_last")
    h_first = b.matmul(x, w_first)
    h_inter, h = [], h_first
    for w in w_inter:
        h = b.matmul(h, w)
        h_inter.append(h)
    h_last = b.matmul(h_inter[-1], w_last)
    loss = b.sub(h_last, y)
    grad = b.mul(loss, b.broadcast(b.constant(value=2 / batch / hidden), (batch, hidden), ()))
    gw_last = b.dot(h_inter[-1], grad, (0,), (0,))
    new_w_last = b.sub(w_last, gw_last)
    g = b.dot(grad, w_last, (1,), (1,))
    new_w_inter = []
    for i in range(layers - 3, -1, -1):
        gw = b.dot(h_inter[i - 1], g, (0,), (0,))
        new_w_inter.append(b.sub(w_inter[i], gw))
        g = b.dot(g, w_inter[i], (1,), (1,))
    gw_first = b.dot(x, g, (0,), (0,))
    new_w_first = b.sub(w_first, gw_first)
    b.outputs(new_w_first, *new_w_inter, new_w_last)
    b.alias(w_first, new_w_first)
    b.alias(w_last, new_w_last)
    for w, nw in zip(w_inter, reversed(new_w_inter), strict=True):
        b.alias(w, nw)
    return b.build()


def attention_forward(batch: int, seq: int, hidden: int, heads: int, force_replicated_output: bool):
    """Alpa's attention test graph: q/k/v projections with biases, masked softmax, output."""
    per = hidden // heads
    b = GraphBuilder("attention")
    hs = b.reshape(b.parameter((batch, seq, hidden), name="hidden_states"), (batch * seq, hidden))

    def project(name: str, scale: bool):
        w = b.parameter((hidden, heads, per), name=f"w{name}")
        h = b.matmul(hs, b.reshape(w, (hidden, hidden)))
        h = b.reshape(h, (batch, seq, heads, per))
        bias = b.parameter((heads, per), name=f"b{name}")
        h = b.add(h, b.broadcast(bias, (batch, seq, heads, per), (2, 3)))
        if scale:
            h = b.mul(b.broadcast(b.constant(value=0.125), (batch, seq, heads, per), ()), h)
        return h, w, bias

    q, wq, bq = project("q", True)
    q = b.transpose(q, (0, 2, 1, 3))
    k, wk, bk = project("k", False)
    k = b.transpose(k, (0, 2, 3, 1))
    att = b.dot(q, k, (3,), (2,), (0, 1), (0, 1))
    mask = b.parameter((batch, seq), name="mask")
    pred = b.compare(mask, b.broadcast(b.constant(value=0), (batch, seq), ()), "lt")
    sel = b.select(pred, b.broadcast(b.constant(value=0), (batch, seq), ()),
                   b.broadcast(b.constant(value=-1e10), (batch, seq), ()))
    att = b.add(att, b.broadcast(sel, (batch, heads, seq, seq), (0, 3)))
    mx = b.broadcast(b.reduce(att, (3,), "max"), (batch, heads, seq, seq), (0, 1, 2))
    ex = b.exp(b.sub(att, mx))
    total = b.broadcast(b.reduce(ex, (3,)), (batch, heads, seq, seq), (0, 1, 2))
    soft = b.div(ex, total)
    v, wv, bv = project("v", False)
    v = b.transpose(v, (0, 2, 3, 1))
    sa = b.dot(v, soft, (3,), (3,), (0, 1), (0, 1))
    sa = b.reshape(b.transpose(sa, (0, 3, 1, 2)), (batch * seq, hidden))
    wo = b.parameter((hidden, heads, per), name="wo")
    o = b.reshape(b.matmul(sa, b.reshape(wo, (hidden, hidden))), (batch, seq, hidden))
    bo = b.parameter((hidden,), name="bo")
    o = b.add(o, b.broadcast(bo, (batch, seq, hidden), (2,)), name="out")
    b.outputs(o, wv, bv, wq, bq, wk, bk, wo, bo)
    if force_replicated_output:
        b.force_replicated(o)
    return b.build()


def transposed_dot(times_x: int, times_y: int, times_out: int, d0: int = 128, d1: int = 2048):
    """x (d1, d0) and y (d0, d1) transposed back and forth, multiplied, the product transposed."""
    b = GraphBuilder("transposes")
    x, y = b.parameter((d1, d0), name="x"), b.parameter((d0, d1), name="y")
    for i in range(max(times_x, times_y)):
        if i < times_x:
            x = b.transpose(x, (1, 0))
        if i < times_y:
            y = b.transpose(y, (1, 0))
    o = b.matmul(x, y)
    for _ in range(times_out):
        o = b.transpose(o, (1, 0))
    b.outputs(o, force_replicated=True)
    return b.build()


def reshaped_dot(multi: bool, d0: int = 128, d1: int = 2048):
    b = GraphBuilder("reshapes")
    x = b.parameter((d0, d1 // 2, 2), name="x")
    y = b.parameter((d1 // 2, 2, d0), name="y")
    x, y = b.reshape(x, (d0, d1)), b.reshape(y, (d1, d0))
    if multi:
        x, y = b.reshape(x, (d0 // 4, 4, d1)), b.reshape(y, (d1 // 4, 4, d0))
        x, y = b.reshape(x, (d0, d1)), b.reshape(y, (d1, d0))
    o = b.matmul(x, y)
    if multi:
        o = b.reshape(o, (d0, 2, d0 // 2))
    b.outputs(o, force_replicated=True)
    return b.build()


def allreduce_simplification(reuse_output: bool, d0: int = 128, d1: int = 2048):
    b = GraphBuilder("allreduce_simplification")
    x, y = b.parameter((d0, d1), name="x"), b.parameter((d1, d0), name="y")
    if not reuse_output:
        out = b.add(b.matmul(x, y), b.matmul(x, y))
        b.outputs(out, force_replicated=True)
        return b.build()
    z = b.parameter((d0 // 4, 4, d0), name="z")
    hs = [b.reshape(b.matmul(x, y), (d0 // 4, 4, d0)) for _ in range(3)]
    out = b.add(b.add(b.add(z, hs[0]), hs[1]), hs[2])
    exps = []
    for _ in range(6):
        out = b.exp(out)
        exps.append(out)
    b.outputs(*exps)
    b.force_replicated(exps[-1])
    return b.build()
