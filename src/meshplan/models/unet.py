"""U-Net (Ronneberger et al. 2015, with batch norm): sizes, presets, analytic counts and graphs.

NHWC images. Level i (0 at full resolution) has `channels x 2^i` features. The stem is level
0's first 3x3 convolution (with batch norm and ReLU); down block 0 is its second; down block
i > 0 max-pools 2x2 and runs two 3x3 convolutions; the bottleneck does the same one level
deeper; up block i upsamples with a 2x2 stride-2 transposed convolution to level i's channels
(written as the contraction it is: each input pixel times a [channels, 2, 2, channels] kernel,
the 2x2 outputs laid out by a transpose and a reshape), concatenates down block i's output
(the skip connection) and runs two 3x3 convolutions; the head is a 1x1 convolution to the
output channels with an L2 loss against targets. "SAME" padding keeps every level's size.

A pipeline layer is one block (down blocks, bottleneck, up blocks): 2 x depth + 1 layers. Down
block i's output is both the next block's input and up block i's skip input, so a stage
boundary carries the main activation and every skip still waiting for its up block
(`boundary_elements`).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import ModelSpecError
from meshplan.ir import DType, Graph, GraphBuilder
from meshplan.models.blocks import weight
from meshplan.models.resnet import IMAGE_DIMS, batch_norm, conv, relu


@dataclass(frozen=True, slots=True)
class UNetConfig:
    """Sizes of a U-Net.

    Attributes:
        depth: down-sampling steps (the original: 4).
        channels: level 0's features (the original: 64).
        image_size: input height and width (a multiple of 2^depth).
        in_channels, out_channels: of the images and of the predicted maps.
    """

    name: str
    depth: int
    channels: int
    image_size: int
    in_channels: int = 3
    out_channels: int = 2

    family = "unet"
    first_piece = "stem"
    last_piece = "head"
    sample_unit = "images"
    default_dtype = DType.F32
    default_optimizer = "momentum"
    closed_form = False

    def __post_init__(self) -> None:
        for field_name in ("depth", "channels", "in_channels", "out_channels"):
            if getattr(self, field_name) < 1:
                raise ModelSpecError(f"model {self.name!r}: {field_name} must be at least 1")
        if self.image_size % 2 ** self.depth:
            raise ModelSpecError(f"model {self.name!r}: image size {self.image_size} is not a multiple of "
                                 f"2^{self.depth} (each level halves it)")

    def level(self, i: int) -> tuple[int, int]:
        """(side, channels) of level i."""
        return self.image_size // 2 ** i, self.channels * 2 ** i

    @property
    def layers(self) -> int:
        return 2 * self.depth + 1

    def block(self, index: int) -> tuple[str, int]:
        """("down" | "bottleneck" | "up", level) of layer `index`."""
        if index < self.depth:
            return "down", index
        if index == self.depth:
            return "bottleneck", self.depth
        return "up", 2 * self.depth - index

    def layer_kind(self, index: int) -> int:
        return index  # every block has its own shape

    def kind_name(self, kind: int) -> str:
        role, level = self.block(kind)
        return "bottleneck" if role == "bottleneck" else f"{role}{level}"

    def block_output(self, index: int) -> int:
        """Values per image a block outputs."""
        side, channels = self.level(self.block(index)[1])
        return side * side * channels

    def boundary_elements(self, seq_len: int) -> tuple[int, ...]:
        """Values per image crossing the boundary after each layer but the last: the block's
        output and the skips still waiting for their up blocks."""
        del seq_len
        crossing = []
        for k in range(self.layers - 1):
            skips = sum(self.block_output(i) for i in range(min(k, self.depth)) if 2 * self.depth - i > k)
            crossing.append(self.block_output(k) + skips)
        return tuple(crossing)

    # -- analytic counts ------------------------------------------------------------------

    def convolutions(self) -> tuple[tuple[int, int, int, int], ...]:
        """(kernel side, in channels, out channels, output side) of every convolution, the
        transposed ones as (2, in, out, their input side) since each input pixel meets one tap."""
        side0, c0 = self.level(0)
        convs = [(3, self.in_channels, c0, side0), (3, c0, c0, side0)]
        for i in range(1, self.depth + 1):  # down blocks 1.. and the bottleneck
            side, c = self.level(i)
            convs += [(3, c // 2, c, side), (3, c, c, side)]
        for i in range(self.depth - 1, -1, -1):  # up blocks
            side, c = self.level(i)
            convs += [(2, 2 * c, c, side // 2), (3, 2 * c, c, side), (3, c, c, side)]
        return (*convs, (1, c0, self.out_channels, side0))

    def num_params(self) -> int:
        """Kernels, batch-norm scales and biases (after every 3x3 convolution), transposed-conv
        and head biases."""
        total = 0
        for k, cin, cout, _ in self.convolutions():
            total += k * k * cin * cout + (2 * cout if k == 3 else cout)
        return total

    def forward_flops(self) -> float:
        """Multiply-add FLOPs of the convolutions of one image's forward pass (2 per multiply-add)."""
        return sum(2.0 * side * side * k * k * cin * cout for k, cin, cout, side in self.convolutions())

    def training_flops(self, samples: int, seq_len: int = 1) -> float:
        del seq_len
        return 3.0 * self.forward_flops() * samples


UNET_PRESETS: dict[str, UNetConfig] = {c.name: c for c in (
    UNetConfig("unet", 4, 64, 256),  # Ronneberger et al.'s widths, on 256x256 images
    UNetConfig("unet-wide", 4, 256, 256),
)}


# -- forward graphs ---------------------------------------------------------------------------

def _double_conv(b: GraphBuilder, x: int, channels: int, prefix: str) -> int:
    x = relu(b, batch_norm(b, conv(b, x, 3, channels, 1, f"{prefix}.conv1"), f"{prefix}.bn1"))
    return relu(b, batch_norm(b, conv(b, x, 3, channels, 1, f"{prefix}.conv2"), f"{prefix}.bn2"))


def unet_stem(b: GraphBuilder, images: int, cfg: UNetConfig) -> int:
    return relu(b, batch_norm(b, conv(b, images, 3, cfg.channels, 1, "stem.conv"), "stem.bn"))


def down_block(b: GraphBuilder, x: int, cfg: UNetConfig, level: int, prefix: str) -> int:
    if level == 0:
        return relu(b, batch_norm(b, conv(b, x, 3, cfg.channels, 1, f"{prefix}.conv2"), f"{prefix}.bn2"))
    pooled = b.max_pool(x, (2, 2), (2, 2), name=f"{prefix}.pool")
    return _double_conv(b, pooled, cfg.level(level)[1], prefix)


def up_block(b: GraphBuilder, x: int, skip: int, cfg: UNetConfig, level: int, prefix: str) -> int:
    batch, side, _, in_channels = b.shape(x)
    channels, dtype = cfg.level(level)[1], b.node(x).dtype
    kernel = weight(b, (in_channels, 2, 2, channels), dtype, f"{prefix}.up.kernel",
                    ("in_channels", "kernel_h", "kernel_w", "channels"))
    taps = b.dot(x, kernel, (3,), (0,), name=f"{prefix}.up")  # [b, h, w, 2, 2, c]
    up = b.reshape(b.transpose(taps, (0, 1, 3, 2, 4, 5)), (batch, 2 * side, 2 * side, channels))
    bias = b.parameter((channels,), dtype, name=f"{prefix}.up.bias")
    up = b.add(up, b.broadcast(bias, b.shape(up), (3,)))
    return _double_conv(b, b.concatenate((skip, up), 3), channels, prefix)


def unet_head_loss(b: GraphBuilder, x: int, cfg: UNetConfig, targets: int) -> int:
    out = conv(b, x, 1, cfg.out_channels, 1, "head.conv")
    bias = b.parameter((cfg.out_channels,), b.node(x).dtype, name="head.bias")
    error = b.sub(b.add(out, b.broadcast(bias, b.shape(out), (3,))), targets)
    return b.reduce(b.mul(error, error), (0, 1, 2, 3), name="loss")


def unet_forward(cfg: UNetConfig, batch: int, dtype: DType = DType.F32) -> Graph:
    """The whole forward pass and loss on `batch` images (for counting and tests)."""
    b = GraphBuilder(cfg.name)
    images = weight(b, (batch, cfg.image_size, cfg.image_size, cfg.in_channels), dtype, "images", IMAGE_DIMS)
    x, skips = unet_stem(b, images, cfg), {}
    for i in range(cfg.layers):
        role, level = cfg.block(i)
        with b.layer(i):
            if role == "up":
                x = up_block(b, x, skips[level], cfg, level, cfg.kind_name(i))
            else:
                x = down_block(b, x, cfg, level, cfg.kind_name(i))
                skips[level] = x
    targets = b.parameter((batch, cfg.image_size, cfg.image_size, cfg.out_channels), dtype, name="targets")
    b.outputs(unet_head_loss(b, x, cfg, targets))
    return b.build()
