"""Graph builders of model families, for planning and simulation."""

from meshplan.models.llama import LLAMA_PRESETS, LlamaConfig, llama_forward
from meshplan.models.registry import forward_graph, model_names

__all__ = ["LLAMA_PRESETS", "LlamaConfig", "forward_graph", "llama_forward", "model_names"]
