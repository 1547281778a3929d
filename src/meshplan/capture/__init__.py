"""Capture stage: a JAX function -> a meshplan Graph (via its jaxpr) and the maps back to JAX."""

from meshplan.capture.batch import BatchInputs, find_batch_inputs, infer_batch_inputs, updated_inputs
from meshplan.capture.jaxpr import Captured, UnsupportedPrimitiveWarning, capture, tag_batch_inputs
from meshplan.capture.rules import ir_dtype

__all__ = ["BatchInputs", "Captured", "UnsupportedPrimitiveWarning", "capture", "find_batch_inputs",
           "infer_batch_inputs", "ir_dtype", "tag_batch_inputs", "updated_inputs"]
