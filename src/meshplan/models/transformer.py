"""Transformer model descriptions (LLaMA, GPT-3, BERT, GShard MoE) and their presets.

A `TransformerConfig` is pure data: the sizes and the block flavour. Graphs are built from it
in `meshplan.models.blocks` (one block, the embedding, the head) and turned into training
graphs (forward, backward, optimizer) in `meshplan.models.training`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from meshplan.errors import ModelSpecError


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """Sizes and flavour of a transformer.

    Attributes:
        name: preset or file name, for reports.
        family: "llama", "gpt", "bert" or "moe".
        hidden, heads, layers, ffn, vocab: the usual sizes.
        kv_heads: key/value heads (grouped-query attention); None = heads.
        norm: "rms" (RMSNorm) or "layer" (LayerNorm).
        mlp: "swiglu" (three matrices) or "gelu" (two, with biases).
        rotary: rotary position embedding (priced as elementwise work on q and k).
        learned_positions: a learned position table added to the token embedding (GPT, BERT).
        causal: decoder (causal mask) or encoder (BERT).
        experts, top_k, moe_every, capacity_factor: GShard MoE; experts = 0 means dense.
        max_seq_len: the context the model was trained for (position table size).
    """

    name: str
    family: str
    hidden: int
    heads: int
    layers: int
    ffn: int
    vocab: int
    kv_heads: int | None = None
    norm: str = "rms"
    mlp: str = "swiglu"
    rotary: bool = True
    learned_positions: bool = False
    causal: bool = True
    experts: int = 0
    top_k: int = 2
    moe_every: int = 2
    capacity_factor: float = 1.25
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        for field_name in ("hidden", "heads", "layers", "ffn", "vocab"):
            if getattr(self, field_name) < 1:
                raise ModelSpecError(f"model {self.name!r}: {field_name} must be at least 1, got "
                                     f"{getattr(self, field_name)}")
        if self.hidden % self.heads:
            raise ModelSpecError(f"model {self.name!r}: hidden {self.hidden} is not divisible by {self.heads} heads")
        if self.heads % self.num_kv_heads:
            raise ModelSpecError(f"model {self.name!r}: {self.heads} heads are not divisible by "
                                 f"{self.num_kv_heads} key/value heads")
        if self.norm not in ("rms", "layer") or self.mlp not in ("swiglu", "gelu"):
            raise ModelSpecError(f"model {self.name!r}: norm must be rms|layer and mlp swiglu|gelu")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def is_moe_layer(self, index: int) -> bool:
        return self.experts > 0 and index % self.moe_every == self.moe_every - 1

    def block_params(self, moe: bool = False) -> int:
        """Parameters of one block."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.num_kv_heads * d * 2
        mats = 3 if self.mlp == "swiglu" else 2
        mlp = mats * h * self.ffn * (self.experts if moe else 1) + (h * self.experts if moe else 0)
        norms = 2 * h * (2 if self.norm == "layer" else 1)
        biases = (h + self.ffn + h) if self.mlp == "gelu" else 0
        return attn + mlp + norms + biases

    def num_params(self) -> int:
        """All parameters: embeddings, blocks, final norm and untied LM head."""
        blocks = sum(self.block_params(self.is_moe_layer(i)) for i in range(self.layers))
        positions = self.max_seq_len * self.hidden if self.learned_positions else 0
        return blocks + 2 * self.vocab * self.hidden + positions + self.hidden

    def replace(self, **changes) -> TransformerConfig:
        return replace(self, **changes)


def _llama(name, hidden, heads, layers, ffn, kv_heads=None, vocab=32000, seq=4096):
    return TransformerConfig(name, "llama", hidden, heads, layers, ffn, vocab, kv_heads, max_seq_len=seq)


def _gpt(name, hidden, heads, layers, vocab=51200, seq=2048):
    return TransformerConfig(name, "gpt", hidden, heads, layers, 4 * hidden, vocab, norm="layer", mlp="gelu",
                             rotary=False, learned_positions=True, max_seq_len=seq)


PRESETS: dict[str, TransformerConfig] = {c.name: c for c in (
    _llama("llama2-7b", 4096, 32, 32, 11008),
    _llama("llama2-13b", 5120, 40, 40, 13824),
    _llama("llama2-70b", 8192, 64, 80, 28672, kv_heads=8),
    # Llama 3.1 (Meta's model cards): grouped-query attention with 8 KV heads, 128,256-token vocabulary.
    _llama("llama3.1-8b", 4096, 32, 32, 14336, kv_heads=8, vocab=128256, seq=131072),
    _llama("llama3.1-70b", 8192, 64, 80, 28672, kv_heads=8, vocab=128256, seq=131072),
    _llama("llama3.1-405b", 16384, 128, 126, 53248, kv_heads=8, vocab=128256, seq=131072),
    # GPT-3 sizes of Alpa's benchmark (Alpa §8.1, after Brown et al. 2020).
    _gpt("gpt3-125m", 768, 12, 12),
    _gpt("gpt3-350m", 1024, 16, 24),
    _gpt("gpt3-760m", 1536, 16, 24),
    _gpt("gpt3-1.3b", 2048, 32, 24),
    _gpt("gpt3-2.6b", 2560, 32, 32),
    _gpt("gpt3-6.7b", 4096, 32, 32),
    _gpt("gpt3-15b", 5120, 40, 48),
    _gpt("gpt3-39b", 8192, 64, 48),
    _gpt("gpt3-175b", 12288, 96, 96),
    TransformerConfig("bert-base", "bert", 768, 12, 12, 3072, 30522, norm="layer", mlp="gelu", rotary=False,
                      learned_positions=True, causal=False, max_seq_len=512),
    TransformerConfig("bert-large", "bert", 1024, 16, 24, 4096, 30522, norm="layer", mlp="gelu", rotary=False,
                      learned_positions=True, causal=False, max_seq_len=512),
    # GShard MoE of Alpa's benchmark: every other FFN is a mixture of experts with top-2 gating.
    TransformerConfig("moe-1.3b", "moe", 768, 16, 16, 3072, 32000, norm="layer", mlp="gelu", rotary=False,
                      learned_positions=True, experts=32, max_seq_len=1024),
    TransformerConfig("moe-10b", "moe", 1536, 16, 16, 6144, 32000, norm="layer", mlp="gelu", rotary=False,
                      learned_positions=True, experts=64, max_seq_len=1024),
    TransformerConfig("moe-27b", "moe", 2048, 16, 16, 8192, 32000, norm="layer", mlp="gelu", rotary=False,
                      learned_positions=True, experts=100, max_seq_len=1024),
)}


def model_config(name: str) -> TransformerConfig:
    """A preset by name, or a Hugging Face `config.json` when `name` is a path to one."""
    path = Path(name)
    if name.endswith(".json") or path.is_file():
        return load_hf_config(path)
    key = name.lower()
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(key, list(PRESETS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ModelSpecError(f"unknown model {name!r}; known models: {', '.join(sorted(PRESETS))}, or a path to a "
                         f"Hugging Face config.json.{hint}")


def load_hf_config(path: str | Path) -> TransformerConfig:
    """Read a Hugging Face `config.json` (LLaMA/Mistral, GPT-2/GPT-NeoX, BERT, Mixtral keys)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelSpecError(f"model config {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelSpecError(f"model config {str(path)!r} must hold a JSON object")

    def pick(*keys, default=None):
        for key in keys:
            if key in raw:
                return raw[key]
        if default is None:
            raise ModelSpecError(f"model config {str(path)!r} lacks {' / '.join(keys)}")
        return default

    model_type = str(raw.get("model_type", "llama")).lower()
    hidden = int(pick("hidden_size", "n_embd", "d_model"))
    family = "bert" if "bert" in model_type else "gpt" if model_type in ("gpt2", "gpt_neox", "gptj", "opt") \
        else "moe" if "mixtral" in model_type else "llama"
    gpt_like = family in ("gpt", "bert")
    return TransformerConfig(
        name=path.stem if path.stem != "config" else path.parent.name or "config",
        family=family, hidden=hidden,
        heads=int(pick("num_attention_heads", "n_head")),
        layers=int(pick("num_hidden_layers", "n_layer")),
        ffn=int(pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden) or 4 * hidden),
        vocab=int(pick("vocab_size")),
        kv_heads=raw.get("num_key_value_heads"),
        norm="layer" if gpt_like else "rms", mlp="gelu" if gpt_like else "swiglu",
        rotary=not gpt_like, learned_positions=gpt_like, causal=family != "bert",
        experts=int(raw.get("num_local_experts", 0)), top_k=int(raw.get("num_experts_per_tok", 2)),
        moe_every=1 if "mixtral" in model_type else 2,
        max_seq_len=int(pick("max_position_embeddings", "n_positions", default=2048)),
    )
