"""Capture stage: a JAX function -> a meshplan Graph (via its jaxpr) and the maps back to JAX."""

from meshplan.capture.batch import (
    BatchInputs,
    UnprovenBatchWarning,
    check_micro_batchable,
    find_batch_inputs,
    given_batch_inputs,
    infer_batch_inputs,
    updated_inputs,
    warn_if_unproven,
)
from meshplan.capture.jaxpr import Captured, UnsupportedPrimitiveWarning, capture, tag_batch_inputs
from meshplan.capture.rules import ir_dtype

__all__ = ["BatchInputs", "Captured", "UnprovenBatchWarning", "UnsupportedPrimitiveWarning", "capture",
           "check_micro_batchable", "find_batch_inputs", "given_batch_inputs", "infer_batch_inputs", "ir_dtype",
           "tag_batch_inputs", "updated_inputs", "warn_if_unproven"]
