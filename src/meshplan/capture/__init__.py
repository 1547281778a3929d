"""Capture stage: a JAX function -> a meshplan Graph (via its jaxpr) and the maps back to JAX."""

from meshplan.capture.jaxpr import Captured, UnsupportedPrimitiveWarning, capture, tag_batch_inputs
from meshplan.capture.rules import ir_dtype

__all__ = ["Captured", "UnsupportedPrimitiveWarning", "capture", "ir_dtype", "tag_batch_inputs"]
