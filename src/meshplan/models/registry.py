"""Model presets by name: forward graphs of LLaMA presets, and every model the simulator plans."""

from __future__ import annotations

import difflib
from pathlib import Path

from meshplan.errors import ModelSpecError
from meshplan.ir import Graph
from meshplan.models.llama import LLAMA_PRESETS, llama_forward
from meshplan.models.resnet import WRESNET_PRESETS
from meshplan.models.training import ModelConfig
from meshplan.models.transformer import PRESETS, model_config
from meshplan.models.unet import UNET_PRESETS

IMAGE_PRESETS: dict[str, ModelConfig] = {**WRESNET_PRESETS, **UNET_PRESETS}


def model_names() -> tuple[str, ...]:
    return tuple(sorted(LLAMA_PRESETS))


def simulation_model(name: str) -> ModelConfig:
    """A model the simulator plans: a transformer, ResNet or U-Net preset by name, or a Hugging
    Face `config.json` path.

    Raises:
        ModelSpecError: unknown name (listing the presets and the closest one), or a bad config.
    """
    key = name.lower()
    if key in IMAGE_PRESETS:
        return IMAGE_PRESETS[key]
    if key in PRESETS or name.endswith(".json") or Path(name).is_file():
        return model_config(name)
    known = sorted([*PRESETS, *IMAGE_PRESETS])
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ModelSpecError(f"unknown model {name!r}; known models: {', '.join(known)}, or a path to a Hugging Face "
                         f"config.json.{hint}")


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
