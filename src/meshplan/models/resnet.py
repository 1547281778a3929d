"""Wide-ResNet (Alpa's benchmark family): sizes, presets, analytic counts and forward graphs.

The network is ResNet v1.5 as Flax's ImageNet example and Alpa's `alpa/model/wide_resnet.py`
write it, on NHWC images: a 7x7 stride-2 stem convolution, batch norm, ReLU and a 3x3
stride-2 max pool; then stages of bottleneck blocks (1x1 conv to `filters`, 3x3 conv to
`filters x width_factor` with the stage's stride, 1x1 conv to `4 x filters`, each followed by
batch norm, ReLU after the first two and after the residual add; a 1x1 projection with batch
norm on the residual where its shape changes); then a global average pool and a dense
classifier. Convolutions carry no bias (batch norm follows them).

A pipeline layer is one bottleneck block (Alpa cuts Wide-ResNet into 16 or 33 layers, one per
residual block); the stem stacks onto the first layer and the classifier onto the last, as
a transformer's embedding and LM head do.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from meshplan.errors import ModelSpecError
from meshplan.ir import DType, Graph, GraphBuilder
from meshplan.models.blocks import weight

# Blocks per stage (He et al. 2016, Table 1).
STAGE_SIZES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
IMAGE_DIMS = ("batch", "height", "width", "channels")
_CONV_LAYOUT = ("NHWC", "HWIO", "NHWC")
_BN_EPSILON = 1e-5


@dataclass(frozen=True, slots=True)
class BlockShape:
    """One bottleneck block: input channels and side, the stage's filters, stride and width."""

    in_channels: int
    side: int  # input height = width
    filters: int
    stride: int
    width_factor: int

    @property
    def middle(self) -> int:
        return self.filters * self.width_factor

    @property
    def out_channels(self) -> int:
        return 4 * self.filters

    @property
    def out_side(self) -> int:
        return -(-self.side // self.stride)  # "SAME" padding

    @property
    def projected(self) -> bool:
        """The residual needs a 1x1 projection (Alpa: its shape differs from the block's output)."""
        return self.in_channels != self.out_channels or self.stride != 1

    def convolutions(self) -> tuple[tuple[int, int, int, int], ...]:
        """(kernel side, in channels, out channels, output side) of every convolution."""
        convs = [(1, self.in_channels, self.filters, self.side),
                 (3, self.filters, self.middle, self.out_side),
                 (1, self.middle, self.out_channels, self.out_side)]
        if self.projected:
            convs.append((1, self.in_channels, self.out_channels, self.out_side))
        return tuple(convs)


@dataclass(frozen=True, slots=True)
class ResNetConfig:
    """Sizes of a (wide) bottleneck ResNet, in Alpa's terms.

    Attributes:
        depth: 50, 101 or 152 (blocks per stage as He et al.).
        channels: base channels (Alpa's `num_channels`; 64 for ResNet-50).
        width_factor: the 3x3 convolutions' widening (Alpa's `width_factor`; 1 for ResNet-50).
        image_size: input height and width.
        num_classes: classifier outputs (Alpa's benchmark: 1024).
    """

    name: str
    depth: int
    channels: int
    width_factor: int
    image_size: int = 224
    num_classes: int = 1024

    family = "resnet"
    first_piece = "stem"
    last_piece = "head"
    sample_unit = "images"
    default_dtype = DType.F32  # Alpa ran its Wide-ResNet benchmark in fp32
    default_optimizer = "momentum"  # SGD with Nesterov momentum 0.9, as Alpa's benchmark
    closed_form = False  # the closed-form layout pricer models transformer blocks only

    def __post_init__(self) -> None:
        if self.depth not in STAGE_SIZES:
            raise ModelSpecError(f"model {self.name!r}: ResNet depth {self.depth} is not one of "
                                 f"{', '.join(map(str, STAGE_SIZES))}")
        for field_name in ("channels", "width_factor", "num_classes"):
            if getattr(self, field_name) < 1:
                raise ModelSpecError(f"model {self.name!r}: {field_name} must be at least 1")
        if self.image_size < 32:
            raise ModelSpecError(f"model {self.name!r}: image size {self.image_size} is below 32 (five stride-2 "
                                 "steps need at least 32 pixels)")

    @property
    def stem_side(self) -> int:
        """Side of the stem's output: the 7x7 stride-2 conv, then the stride-2 max pool."""
        after_conv = -(-self.image_size // 2)
        return -(-after_conv // 2)

    def blocks(self) -> tuple[BlockShape, ...]:
        """Every bottleneck block in order."""
        shapes, channels, side = [], self.channels, self.stem_side
        for stage, count in enumerate(STAGE_SIZES[self.depth]):
            for j in range(count):
                block = BlockShape(channels, side, self.channels * 2 ** stage, 2 if stage and not j else 1,
                                   self.width_factor)
                shapes.append(block)
                channels, side = block.out_channels, block.out_side
        return tuple(shapes)

    @property
    def layers(self) -> int:
        """Pipeline layers: one per bottleneck block."""
        return sum(STAGE_SIZES[self.depth])

    def layer_kind(self, index: int) -> BlockShape:
        """Blocks of one shape share one priced graph."""
        return self.blocks()[index]

    def kind_name(self, kind: BlockShape) -> str:
        """E.g. "block3" (the first block of this shape)."""
        return f"block{self.blocks().index(kind)}"

    def boundary_elements(self, seq_len: int) -> tuple[int, ...]:
        """Values one image sends across each block boundary."""
        del seq_len
        return tuple(b.out_side ** 2 * b.out_channels for b in self.blocks()[:-1])

    # -- analytic counts ------------------------------------------------------------------

    def num_params(self) -> int:
        """Trainable parameters: convolution kernels, batch-norm scales and biases, classifier."""
        stem = 7 * 7 * 3 * self.channels + 2 * self.channels
        blocks = sum(k * k * cin * cout + 2 * cout for b in self.blocks() for k, cin, cout, _ in b.convolutions())
        head_in = self.blocks()[-1].out_channels
        return stem + blocks + head_in * self.num_classes + self.num_classes

    def forward_flops(self) -> float:
        """Multiply-add FLOPs (2 per multiply-add) of the convolutions and the classifier for one
        image's forward pass: what the usual "ResNet-50 is 4.1 GFLOPs" counts in multiply-adds."""
        side = -(-self.image_size // 2)
        stem = 2.0 * side * side * 7 * 7 * 3 * self.channels
        blocks = sum(2.0 * out * out * k * k * cin * cout
                     for b in self.blocks() for k, cin, cout, out in b.convolutions())
        return stem + blocks + 2.0 * self.blocks()[-1].out_channels * self.num_classes

    def training_flops(self, samples: int, seq_len: int = 1) -> float:
        """Model FLOPs of training on `samples` images: forward, and twice it backward (the input
        and the kernel gradients of every contraction)."""
        del seq_len
        return 3.0 * self.forward_flops() * samples


# Alpa's benchmark/alpa/suite_wresnet.py (`wresnet_specs`): image 224, fp32.
WRESNET_PRESETS: dict[str, ResNetConfig] = {c.name: c for c in (
    ResNetConfig("wresnet-250m", 50, 160, 2),
    ResNetConfig("wresnet-500m", 50, 224, 2),
    ResNetConfig("wresnet-1b", 50, 320, 2),
    ResNetConfig("wresnet-2b", 50, 448, 2),
    ResNetConfig("wresnet-4b", 50, 640, 2),
    ResNetConfig("wresnet-6.8b", 50, 320, 16),
    ResNetConfig("wresnet-13b", 101, 320, 16),
    # He et al. 2016 with Flax's (v1.5) strides, on ImageNet's 1000 classes.
    ResNetConfig("resnet-50", 50, 64, 1, num_classes=1000),
)}


def resnet_config(name: str) -> ResNetConfig:
    """A ResNet preset by name.

    Raises:
        ModelSpecError: unknown name (with the closest preset).
    """
    key = name.lower()
    if key in WRESNET_PRESETS:
        return WRESNET_PRESETS[key]
    close = difflib.get_close_matches(key, list(WRESNET_PRESETS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ModelSpecError(f"unknown ResNet {name!r}; known: {', '.join(WRESNET_PRESETS)}.{hint}")


# -- forward graphs ---------------------------------------------------------------------------

def conv(b: GraphBuilder, x: int, kernel: int, out_channels: int, stride: int, name: str,
         padding: str | tuple[tuple[int, int], ...] = "SAME") -> int:
    """A bias-free NHWC convolution with its HWIO kernel parameter `<name>.kernel`."""
    in_channels, dtype = b.shape(x)[3], b.node(x).dtype
    w = weight(b, (kernel, kernel, in_channels, out_channels), dtype, f"{name}.kernel",
                ("kernel_h", "kernel_w", "in_channels", "channels"))
    return b.conv(x, w, (stride, stride), padding, dimension_numbers=_CONV_LAYOUT, name=name)


def batch_norm(b: GraphBuilder, x: int, name: str) -> int:
    """Training-mode batch norm over (batch, height, width): the statistics are sums over the
    batch, so a batch split over devices all-reduces them (cross-replica batch norm, as an
    SPMD program computes it). The running averages' update (a few values per channel) is left
    out: it moves no cost."""
    shape, dtype = b.shape(x), b.node(x).dtype
    channels, count = shape[3], shape[0] * shape[1] * shape[2]
    per_channel = lambda value: b.full((channels,), value, dtype)  # noqa: E731
    spread = lambda v: b.broadcast(v, shape, (3,))  # noqa: E731
    mean = b.mul(b.reduce(x, (0, 1, 2)), per_channel(1 / count))
    centred = b.sub(x, spread(mean))
    variance = b.mul(b.reduce(b.mul(centred, centred), (0, 1, 2)), per_channel(1 / count))
    inverse = b.rsqrt(b.add(variance, per_channel(_BN_EPSILON)))
    scale = weight(b, (channels,), dtype, f"{name}.scale", ("channels",))
    bias = weight(b, (channels,), dtype, f"{name}.bias", ("channels",))
    return b.add(b.mul(centred, spread(b.mul(inverse, scale))), spread(bias), name=name)


def relu(b: GraphBuilder, x: int) -> int:
    return b.max(x, b.zeros(b.shape(x), b.node(x).dtype))


def stem(b: GraphBuilder, images: int, cfg: ResNetConfig) -> int:
    """7x7 stride-2 convolution (padding 3), batch norm, ReLU, 3x3 stride-2 max pool ("SAME")."""
    x = relu(b, batch_norm(b, conv(b, images, 7, cfg.channels, 2, "stem.conv", ((3, 3), (3, 3))), "stem.bn"))
    return b.max_pool(x, (3, 3), (2, 2), "SAME", name="stem.pool")


def bottleneck(b: GraphBuilder, x: int, block: BlockShape, prefix: str) -> int:
    y = relu(b, batch_norm(b, conv(b, x, 1, block.filters, 1, f"{prefix}.conv1"), f"{prefix}.bn1"))
    y = relu(b, batch_norm(b, conv(b, y, 3, block.middle, block.stride, f"{prefix}.conv2"), f"{prefix}.bn2"))
    y = batch_norm(b, conv(b, y, 1, block.out_channels, 1, f"{prefix}.conv3"), f"{prefix}.bn3")
    residual = x
    if block.projected:
        residual = batch_norm(b, conv(b, x, 1, block.out_channels, block.stride, f"{prefix}.proj"),
                              f"{prefix}.proj_bn")
    out = relu(b, b.add(residual, y, name=f"{prefix}.residual"))
    b.rename(out, f"{prefix}.out")
    return out


def classifier_loss(b: GraphBuilder, x: int, cfg: ResNetConfig, labels: int) -> int:
    """Global average pool, dense classifier with bias, softmax cross-entropy summed to a scalar."""
    batch, height, width, channels = b.shape(x)
    dtype = b.node(x).dtype
    pooled = b.mul(b.reduce(x, (1, 2)), b.full((batch, channels), 1 / (height * width), dtype), name="pool")
    w = weight(b, (channels, cfg.num_classes), dtype, "head.kernel", ("channels", "classes"))
    bias = weight(b, (cfg.num_classes,), dtype, "head.bias", ("classes",))
    shape = (batch, cfg.num_classes)
    logits = b.add(b.dot(pooled, w, (1,), (0,), name="logits"), b.broadcast(bias, shape, (1,)))
    peak = b.unary("floor", b.reduce(logits, (1,), "max"))  # a constant shift: no gradient flows
    shifted = b.sub(logits, b.broadcast(peak, shape, (0,)))
    lse = b.add(b.unary("log", b.reduce(b.exp(shifted), (1,))), peak)
    hit = b.compare(b.iota(shape, 1), b.broadcast(labels, shape, (0,)), "eq")
    picked = b.reduce(b.select(hit, logits, b.zeros(shape, dtype)), (1,))
    return b.reduce(b.sub(lse, picked), (0,), name="loss")


def resnet_forward(cfg: ResNetConfig, batch: int, dtype: DType = DType.F32) -> Graph:
    """The whole forward pass and loss on `batch` images (for counting and tests)."""
    b = GraphBuilder(cfg.name)
    images = weight(b, (batch, cfg.image_size, cfg.image_size, 3), dtype, "images", IMAGE_DIMS)
    x = stem(b, images, cfg)
    for i, block in enumerate(cfg.blocks()):
        with b.layer(i):
            x = bottleneck(b, x, block, f"block{i}")
    labels = weight(b, (batch,), DType.I32, "labels", ("batch",))
    b.outputs(classifier_loss(b, x, cfg, labels))
    return b.build()
