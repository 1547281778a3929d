"""Training graphs of model pieces: forward, backward (autodiff) and gradient outputs.

A pipeline stage runs some blocks, plus the first piece (a transformer's embedding, a ResNet's
stem) on the first stage and the last (the LM head, the classifier) on the last. Each piece
becomes one micro-batch graph: its input activations are parameters, the cotangent arriving from
the next stage is a parameter too (loss = sum(out * cotangent) gives exactly the backward pass a
pipeline stage runs), and parameter gradients are marked `accumulated`: they are summed over
micro-batches and synchronised once per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost.fusion import BOUNDARY
from meshplan.errors import ModelSpecError
from meshplan.ir import DType, Graph, GraphBuilder, OpKind
from meshplan.ir.autodiff import append_backward
from meshplan.models.blocks import ACTIVATION_DIMS, block, embedding, lm_head_loss, weight
from meshplan.models.optimizers import append_adam, append_momentum, append_sgd
from meshplan.models.resnet import IMAGE_DIMS, ResNetConfig, bottleneck, classifier_loss, stem
from meshplan.models.transformer import TransformerConfig
from meshplan.models.unet import UNetConfig, down_block, unet_head_loss, unet_stem, up_block

ModelConfig = TransformerConfig | ResNetConfig | UNetConfig

_PASS_THROUGH = (OpKind.TRANSPOSE, OpKind.RESHAPE, OpKind.BROADCAST)


@dataclass(frozen=True, slots=True)
class PieceGraph:
    """A training graph and where its forward pass ends."""

    graph: Graph
    forward_end: int  # id of the last forward node (the scalar loss)
    weights: tuple[int, ...]  # trainable parameter ids
    backward_end: int  # id of the last backward node; optimizer nodes follow it


def _batch_input(b: GraphBuilder, x: int) -> int:
    """Mark an input that arrives split over the batch from the neighbouring stage."""
    b.tag(x, batch_input=True)
    return x


OPTIMIZERS = ("adam", "sgd", "momentum")


def training_pieces(model: ModelConfig, micro_batch: int, seq: int, dtype: DType = DType.BF16,
                    optimizer: str = "adam") -> tuple[dict, PieceGraph, PieceGraph]:
    """The training graphs a model's layers are priced with: one per kind of block (keyed by
    `model.layer_kind`), the first piece and the last."""
    kinds = {}
    for i in range(model.layers):
        kinds.setdefault(model.layer_kind(i), i)
    if isinstance(model, UNetConfig):
        blocks = {kind: unet_block_training_graph(model, i, micro_batch, dtype, optimizer) for kind, i in kinds.items()}
        return (blocks, unet_stem_training_graph(model, micro_batch, dtype, optimizer),
                unet_head_training_graph(model, micro_batch, dtype, optimizer))
    if isinstance(model, ResNetConfig):
        blocks = {kind: resnet_block_training_graph(model, i, micro_batch, dtype, optimizer)
                  for kind, i in kinds.items()}
        return (blocks, stem_training_graph(model, micro_batch, dtype, optimizer),
                classifier_training_graph(model, micro_batch, dtype, optimizer))
    blocks = {kind: block_training_graph(model, i, micro_batch, seq, dtype, optimizer) for kind, i in kinds.items()}
    return (blocks, embedding_training_graph(model, micro_batch, seq, dtype, optimizer),
            head_training_graph(model, micro_batch, seq, dtype, optimizer))


def block_training_graph(cfg: TransformerConfig, index: int, micro_batch: int, seq: int,
                         dtype: DType = DType.BF16, optimizer: str = "adam") -> PieceGraph:
    """Forward and backward of block `index` for one micro-batch."""
    b = GraphBuilder(f"{cfg.name}.block{index}")
    x = _batch_input(b, weight(b, (micro_batch, seq, cfg.hidden), dtype, "activations", ACTIVATION_DIMS))
    first_weight = len(b)
    with b.layer(index):
        out = block(b, x, cfg, index)
    weights = _weights_since(b, first_weight)
    return _with_backward(b, out, [x], weights, optimizer)


def embedding_training_graph(cfg: TransformerConfig, micro_batch: int, seq: int,
                             dtype: DType = DType.BF16, optimizer: str = "adam") -> PieceGraph:
    b = GraphBuilder(f"{cfg.name}.embedding")
    out, tables = embedding(b, cfg, micro_batch, seq, dtype)
    _batch_input(b, _find(b, "tokens"))
    return _with_backward(b, out, [], tables, optimizer)


def head_training_graph(cfg: TransformerConfig, micro_batch: int, seq: int,
                        dtype: DType = DType.BF16, optimizer: str = "adam") -> PieceGraph:
    b = GraphBuilder(f"{cfg.name}.head")
    x = _batch_input(b, weight(b, (micro_batch, seq, cfg.hidden), dtype, "activations", ACTIVATION_DIMS))
    first_weight = len(b)
    loss = lm_head_loss(b, x, cfg)
    weights = [n for n in range(first_weight, len(b))
               if b.node(n).kind is OpKind.PARAMETER and b.node(n).dtype is dtype]
    _batch_input(b, _find(b, "labels"))
    return _finish(b, loss, [x], weights, optimizer)


def resnet_block_training_graph(cfg: ResNetConfig, index: int, micro_batch: int, dtype: DType = DType.F32,
                                optimizer: str = "momentum") -> PieceGraph:
    """Forward and backward of bottleneck block `index` for one micro-batch of images."""
    block = cfg.blocks()[index]
    b = GraphBuilder(f"{cfg.name}.block{index}")
    x = _batch_input(b, weight(b, (micro_batch, block.side, block.side, block.in_channels), dtype, "activations",
                               IMAGE_DIMS))
    first_weight = len(b)
    with b.layer(index):
        out = bottleneck(b, x, block, f"block{index}")
    weights = _weights_since(b, first_weight)
    return _with_backward(b, out, [x], weights, optimizer)


def _weights_since(b: GraphBuilder, first: int) -> list[int]:
    """The parameters a piece's builder added from node `first` on: the piece's own weights."""
    return [n for n in range(first, len(b)) if b.node(n).kind is OpKind.PARAMETER]


def stem_training_graph(cfg: ResNetConfig, micro_batch: int, dtype: DType = DType.F32,
                        optimizer: str = "momentum") -> PieceGraph:
    b = GraphBuilder(f"{cfg.name}.stem")
    images = _batch_input(b, weight(b, (micro_batch, cfg.image_size, cfg.image_size, 3), dtype, "images",
                                    IMAGE_DIMS))
    first_weight = len(b)
    out = stem(b, images, cfg)
    weights = _weights_since(b, first_weight)
    return _with_backward(b, out, [], weights, optimizer)


def classifier_training_graph(cfg: ResNetConfig, micro_batch: int, dtype: DType = DType.F32,
                              optimizer: str = "momentum") -> PieceGraph:
    last = cfg.blocks()[-1]
    b = GraphBuilder(f"{cfg.name}.head")
    x = _batch_input(b, weight(b, (micro_batch, last.out_side, last.out_side, last.out_channels), dtype,
                               "activations", IMAGE_DIMS))
    labels = _batch_input(b, weight(b, (micro_batch,), DType.I32, "labels", ("batch",)))
    first_weight = len(b)
    loss = classifier_loss(b, x, cfg, labels)
    weights = _weights_since(b, first_weight)
    return _finish(b, loss, [x], weights, optimizer)


def unet_block_training_graph(cfg: UNetConfig, index: int, micro_batch: int, dtype: DType = DType.F32,
                              optimizer: str = "momentum") -> PieceGraph:
    """Forward and backward of U-Net block `index`; an up block also takes its skip input."""
    role, level = cfg.block(index)
    b = GraphBuilder(f"{cfg.name}.{cfg.kind_name(index)}")
    source = index - 1 if index else None  # the stem feeds down block 0 at level 0's size
    side, channels = cfg.level(cfg.block(source)[1] if source is not None else 0)
    x = _batch_input(b, weight(b, (micro_batch, side, side, channels), dtype, "activations", IMAGE_DIMS))
    inputs = [x]
    if role == "up":
        skip_side, skip_channels = cfg.level(level)
        inputs.append(_batch_input(b, weight(b, (micro_batch, skip_side, skip_side, skip_channels), dtype,
                                             "skip", IMAGE_DIMS)))
    first_weight = len(b)
    with b.layer(index):
        name = cfg.kind_name(index)
        out = up_block(b, x, inputs[1], cfg, level, name) if role == "up" else down_block(b, x, cfg, level, name)
    weights = _weights_since(b, first_weight)
    return _with_backward(b, out, inputs, weights, optimizer)


def unet_stem_training_graph(cfg: UNetConfig, micro_batch: int, dtype: DType = DType.F32,
                             optimizer: str = "momentum") -> PieceGraph:
    b = GraphBuilder(f"{cfg.name}.stem")
    images = _batch_input(b, weight(b, (micro_batch, cfg.image_size, cfg.image_size, cfg.in_channels), dtype,
                                    "images", IMAGE_DIMS))
    first_weight = len(b)
    out = unet_stem(b, images, cfg)
    weights = _weights_since(b, first_weight)
    return _with_backward(b, out, [], weights, optimizer)


def unet_head_training_graph(cfg: UNetConfig, micro_batch: int, dtype: DType = DType.F32,
                             optimizer: str = "momentum") -> PieceGraph:
    b = GraphBuilder(f"{cfg.name}.head")
    shape = (micro_batch, cfg.image_size, cfg.image_size)
    x = _batch_input(b, weight(b, (*shape, cfg.channels), dtype, "activations", IMAGE_DIMS))
    targets = _batch_input(b, weight(b, (*shape, cfg.out_channels), dtype, "targets", IMAGE_DIMS))
    first_weight = len(b)
    loss = unet_head_loss(b, x, cfg, targets)
    weights = _weights_since(b, first_weight)
    return _finish(b, loss, [x], weights, optimizer)


def _find(b: GraphBuilder, name: str) -> int:
    return next(i for i in range(len(b)) if b.node(i).name == name)


def _with_backward(b: GraphBuilder, out: int, inputs: list[int], weights: list[int],
                   optimizer: str) -> PieceGraph:
    cotangent = _batch_input(b, b.parameter(b.shape(out), b.node(out).dtype, name="cotangent"))
    with b.kernel(BOUNDARY):  # stands for the rest of the model: no kernel of this stage
        loss = b.reduce(b.mul(out, cotangent), tuple(range(len(b.shape(out)))), name="stage_loss")
    return _finish(b, loss, inputs, weights, optimizer)


def _finish(b: GraphBuilder, loss: int, inputs: list[int], weights: list[int], optimizer: str) -> PieceGraph:
    """Backward pass, then the optimizer step on every weight: mixed-precision Adam (fp32
    master copy, m, v), SGD with Nesterov momentum, or plain SGD."""
    if optimizer not in OPTIMIZERS:
        raise ModelSpecError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    grads = append_backward(b, loss, [*inputs, *weights])
    backward_end = len(b) - 1
    for node_id in range(loss + 1, backward_end + 1):
        b.tag(node_id, backward=True)
    for w in weights:
        _mark_accumulated(b, grads[w])
    if optimizer == "adam":
        updated = append_adam(b, weights, grads, master_dtype=DType.F32, relayout=True)
    elif optimizer == "momentum":
        updated = append_momentum(b, weights, grads)
    else:
        updated = append_sgd(b, weights, grads)
    for node_id in range(backward_end + 1, len(b)):
        b.tag(node_id, per_iteration=True)
    b.outputs(*(grads[x] for x in inputs), *updated.values())
    return PieceGraph(b.build(), loss, tuple(weights), backward_end)


def _mark_accumulated(b: GraphBuilder, node_id: int) -> None:
    """Tag a parameter gradient and the layout ops it passes through back to its producer."""
    while True:
        b.tag(node_id, accumulated=True)
        node = b.node(node_id)
        if node.kind not in _PASS_THROUGH or len(node.operands) != 1:
            return
        node_id = node.operands[0]
