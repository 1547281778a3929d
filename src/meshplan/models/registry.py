"""Model presets by name."""

from __future__ import annotations

import difflib

from meshplan.errors import ModelSpecError
from meshplan.ir import Graph
from meshplan.models.llama import LLAMA_PRESETS, llama_forward


def model_names() -> tuple[str, ...]:
    return tuple(sorted(LLAMA_PRESETS))


def forward_graph(name: str, batch: int, seq_len: int, layers: int | None = None,
                  force_replicated_output: bool = False) -> Graph:
    """The forward graph of preset `name` (e.g. "llama2-13b")."""
    key = name.lower()
    if key not in LLAMA_PRESETS:
        close = difflib.get_close_matches(key, model_names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ModelSpecError(f"unknown model {name!r}; known models: {', '.join(model_names())}.{hint}")
    c = LLAMA_PRESETS[key]
    return llama_forward(batch, seq_len, c.hidden, c.heads, layers or c.layers, c.ffn,
                         force_replicated_output, name=key)
