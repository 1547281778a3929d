"""Element types and their sizes in bytes."""

from __future__ import annotations

import enum

from meshplan.errors import GraphError


class DType(enum.Enum):
    """Element types of tensors in the IR; the value is (name, bytes per element)."""

    F64 = ("f64", 8)
    F32 = ("f32", 4)
    BF16 = ("bf16", 2)
    F16 = ("f16", 2)
    I64 = ("i64", 8)
    I32 = ("i32", 4)
    I8 = ("i8", 1)
    U8 = ("u8", 1)
    PRED = ("pred", 1)

    @property
    def short_name(self) -> str:
        return self.value[0]

    @property
    def itemsize(self) -> int:
        return self.value[1]

    def __str__(self) -> str:
        return self.short_name


_ALIASES = {
    "float64": DType.F64, "float32": DType.F32, "bfloat16": DType.BF16, "float16": DType.F16,
    "int64": DType.I64, "int32": DType.I32, "int8": DType.I8, "uint8": DType.U8,
    "bool": DType.PRED,
}
_BY_NAME = {d.short_name: d for d in DType} | _ALIASES


def as_dtype(value: DType | str) -> DType:
    """Return the DType named by `value` ("f32", "bfloat16", DType.F16, ...)."""
    if isinstance(value, DType):
        return value
    try:
        return _BY_NAME[str(value).lower()]
    except KeyError:
        known = ", ".join(sorted(_BY_NAME))
        raise GraphError(f"unknown dtype {value!r}; use one of: {known}") from None
