"""Transformer model descriptions (LLaMA, GPT-3, BERT, GShard MoE) and their presets.

A `TransformerConfig` is pure data: the sizes and the block flavour. Graphs are built from it
in `meshplan.models.blocks` (one block, the embedding, the head) and turned into training
graphs (forward, backward, optimizer) in `meshplan.models.training`.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from meshplan.errors import ModelSpecError
from meshplan.ir import DType


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
            `experts` counts the routed experts; each token runs through `top_k` of them.
        max_seq_len: the context the model was trained for (position table size).
        expert_ffn: width of one routed expert's MLP; None = ffn (DeepSeek-style MoE uses
            many narrow experts).
        shared_experts: experts every token runs through besides the routed ones (DeepSeek).
        first_moe_layer: blocks before it are dense (DeepSeek's first_k_dense_replace).
        head_size: per-head width when it is not hidden / heads (Gemma-7B: 16 heads of 256 on
            hidden 3072); None = hidden / heads.
        tied_embeddings: the LM head reuses the token embedding table (GPT-2, Gemma): counted
            once in the parameters.
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
    expert_ffn: int | None = None
    shared_experts: int = 0
    first_moe_layer: int = 0
    head_size: int | None = None
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for field_name in ("hidden", "heads", "layers", "ffn", "vocab"):
            if getattr(self, field_name) < 1:
                raise ModelSpecError(f"model {self.name!r}: {field_name} must be at least 1, got "
                                     f"{getattr(self, field_name)}")
        if self.head_size is None and self.hidden % self.heads:
            raise ModelSpecError(f"model {self.name!r}: hidden {self.hidden} is not divisible by {self.heads} heads")
        if self.heads % self.num_kv_heads:
            raise ModelSpecError(f"model {self.name!r}: {self.heads} heads are not divisible by "
                                 f"{self.num_kv_heads} key/value heads")
        if self.norm not in ("rms", "layer") or self.mlp not in ("swiglu", "gelu"):
            raise ModelSpecError(f"model {self.name!r}: norm must be rms|layer and mlp swiglu|gelu")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ModelSpecError(f"model {self.name!r}: top_k {self.top_k} must be between 1 and the "
                                 f"{self.experts} routed experts")

    first_piece = "embedding"
    last_piece = "head"
    sample_unit = "tokens"
    default_dtype = DType.BF16
    default_optimizer = "adam"
    closed_form = True  # the closed-form layout pricer (simulator/analytic.py) describes it

    def layer_kind(self, index: int) -> bool:
        """Blocks of one kind (dense or MoE) share one priced graph."""
        return self.is_moe_layer(index)

    def kind_name(self, kind: bool) -> str:
        return "moe-block" if kind else "block"

    def boundary_elements(self, seq_len: int) -> tuple[int, ...]:
        """Values one sequence sends across each block boundary."""
        return (seq_len * self.hidden,) * (self.layers - 1)

    def training_flops(self, samples: int, seq_len: int) -> float:
        """Training FLOPs of `samples` sequences by the usual 6 N T rule (see flop_params)."""
        return 6.0 * self.flop_params() * samples * seq_len

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    def expert_capacity(self, seq: int) -> int:
        """Token slots each routed expert takes per sequence (GShard's capacity)."""
        return min(seq, max(1, math.ceil(self.top_k * self.capacity_factor * seq / self.experts)))

    def routed_slots(self, seq: int) -> float:
        """Routed expert slots per token of a sequence: about top_k x capacity_factor."""
        return self.experts * self.expert_capacity(seq) / seq

    @property
    def dropout(self) -> bool:
        """Whether the model trains with dropout (GPT and BERT, as Megatron-LM configures them;
        LLaMA-style models train without)."""
        return self.family in ("gpt", "bert")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def expert_width(self) -> int:
        """MLP width of one routed (or shared) expert."""
        return self.expert_ffn or self.ffn

    def is_moe_layer(self, index: int) -> bool:
        return (self.experts > 0 and index >= self.first_moe_layer
                and (index - self.first_moe_layer) % self.moe_every == self.moe_every - 1)

    @functools.cache  # noqa: B019 - see _params
    def moe_layers(self) -> tuple[bool, ...]:
        """`is_moe_layer` of every layer, in order."""
        return tuple(self.is_moe_layer(i) for i in range(self.layers))

    def block_params(self, moe: bool = False, active: bool = False) -> int:
        """Parameters of one block; with `active`, only those one token runs through (the top-k
        routed experts and the shared ones, not every expert)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.num_kv_heads * d * 2
        norms = 2 * h * (2 if self.norm == "layer" else 1)
        return attn + norms + self.mlp_params(moe, active)

    def mlp_params(self, moe: bool, active: bool = False) -> int:
        """Parameters of a block's MLP: one dense MLP, or the router plus the experts."""
        h, mats = self.hidden, 3 if self.mlp == "swiglu" else 2
        biased = self.mlp == "gelu"
        if not moe:
            return mats * h * self.ffn + ((h + self.ffn + h) if biased else 0)
        routed = self.top_k if active else self.experts
        width = self.expert_width
        per_expert = mats * h * width  # expert MLPs carry no biases (GShard, Mixtral, DeepSeek)
        return (routed + self.shared_experts) * per_expert + h * self.experts

    def num_params(self) -> int:
        """All parameters: embeddings, blocks (every expert), final norm and LM head."""
        return self._params(active=False)

    def active_params(self) -> int:
        """Parameters one token runs through (MoE: top-k routed experts plus the shared ones); the
        N of the 6 N T model FLOPs. Equal to num_params for dense models."""
        return self._params(active=True)

    def flop_params(self) -> int:
        """Parameters a token multiplies by (the N of 6 N T model FLOPs): the activated ones
        without the input lookup tables (token and position embeddings gather rows; a tied
        table still counts once, as the LM head)."""
        lookups = 0 if self.tied_embeddings else self.vocab * self.hidden
        positions = self.max_seq_len * self.hidden if self.learned_positions else 0
        return self.active_params() - lookups - positions

    @functools.cache  # noqa: B019 - configs are few, frozen and hashable; layout searches ask thousands of times
    def _params(self, active: bool) -> int:
        blocks = sum(self.block_params(self.is_moe_layer(i), active) for i in range(self.layers))
        positions = self.max_seq_len * self.hidden if self.learned_positions else 0
        tables = (1 if self.tied_embeddings else 2) * self.vocab * self.hidden
        return blocks + tables + positions + self.hidden

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
    # Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 8 SwiGLU experts per block, top-2.
    TransformerConfig("mixtral-8x7b", "moe", 4096, 32, 32, 14336, 32000, kv_heads=8, experts=8, top_k=2,
                      moe_every=1, max_seq_len=32768),
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


# model_type values read, by how their keys map onto a TransformerConfig.
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "gemma", "gemma2")
_GPT_LIKE = ("gpt2", "gpt_neox", "gptj", "opt")
_MOE = ("mixtral", "qwen2_moe", "deepseek")
HF_MODEL_TYPES = (*_LLAMA_LIKE, *_GPT_LIKE, *_MOE, "bert")
# Architectures whose attention meshplan does not model: refused by name rather than misread.
_REFUSED = {
    "deepseek_v2": "multi-head latent attention (low-rank compressed keys and values)",
    "deepseek_v3": "multi-head latent attention (low-rank compressed keys and values)",
    "mamba": "state-space layers instead of attention",
    "jamba": "interleaved state-space and attention layers",
    "t5": "an encoder-decoder with cross-attention",
}


def load_hf_config(path: str | Path) -> TransformerConfig:
    """Read a Hugging Face `config.json`: LLaMA, Mistral, Qwen2, Gemma, GPT-2, GPT-NeoX, BERT,
    and the MoE families Mixtral, Qwen2-MoE and DeepSeek-MoE (shared + routed experts).

    Raises:
        ModelSpecError: the file is missing, not JSON, lacks a size, or its `model_type` is one
            meshplan does not model (named in the message).
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelSpecError(f"model config {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelSpecError(f"model config {str(path)!r} must hold a JSON object")
    model_type = str(raw.get("model_type", "llama")).lower()
    if model_type in _REFUSED or (model_type not in HF_MODEL_TYPES and "bert" not in model_type):
        why = f" ({_REFUSED[model_type]})" if model_type in _REFUSED else ""
        raise ModelSpecError(f"model config {str(path)!r}: model_type {model_type!r}{why} is not modelled; "
                             f"meshplan reads {', '.join(HF_MODEL_TYPES)}. Describe the model with a preset "
                             "or a config of one of these types.")
    name = path.stem if path.stem != "config" else path.parent.name or "config"
    return _from_hf(raw, model_type, name, str(path))


def _from_hf(raw: dict, model_type: str, name: str, where: str) -> TransformerConfig:
    def pick(*keys, default=None):
        for key in keys:
            if raw.get(key) is not None:
                return raw[key]
        if default is None:
            raise ModelSpecError(f"model config {where!r} lacks {' / '.join(keys)}")
        return default

    hidden = int(pick("hidden_size", "n_embd", "d_model"))
    gpt_like = model_type in _GPT_LIKE or "bert" in model_type
    family = "bert" if "bert" in model_type else "gpt" if gpt_like else "moe" if model_type in _MOE else "llama"
    ffn = int(pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden) or 4 * hidden)
    moe = _moe_fields(raw, model_type, pick)
    tied = bool(raw.get("tie_word_embeddings", model_type in ("gpt2", "gemma", "gemma2")))
    head_size = raw.get("head_dim")
    heads = int(pick("num_attention_heads", "n_head"))
    return TransformerConfig(
        name=name, family=family, hidden=hidden, heads=heads,
        layers=int(pick("num_hidden_layers", "n_layer")), ffn=ffn, vocab=int(pick("vocab_size")),
        kv_heads=raw.get("num_key_value_heads"),
        norm="layer" if gpt_like else "rms", mlp="gelu" if gpt_like else "swiglu",
        rotary=model_type in ("gpt_neox", "gptj") or not gpt_like,
        learned_positions=model_type in ("gpt2", "opt") or "bert" in model_type, causal=family != "bert",
        max_seq_len=int(pick("max_position_embeddings", "n_positions", default=2048)),
        head_size=int(head_size) if head_size and int(head_size) * heads != hidden else None,
        tied_embeddings=tied, **moe)


def _moe_fields(raw: dict, model_type: str, pick) -> dict:
    """Experts, top-k, expert width, shared experts and dense leading blocks of an MoE config."""
    if model_type == "mixtral":
        return {"experts": int(pick("num_local_experts")), "top_k": int(pick("num_experts_per_tok")),
                "moe_every": 1}
    if model_type == "qwen2_moe":
        width = int(pick("moe_intermediate_size"))
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        return {"experts": int(pick("num_experts")), "top_k": int(pick("num_experts_per_tok")),
                "moe_every": int(raw.get("decoder_sparse_step") or 1), "expert_ffn": width,
                "shared_experts": round(shared / width)}
    if model_type == "deepseek":
        return {"experts": int(pick("n_routed_experts")), "top_k": int(pick("num_experts_per_tok")),
                "moe_every": int(raw.get("moe_layer_freq") or 1), "expert_ffn": int(pick("moe_intermediate_size")),
                "shared_experts": int(raw.get("n_shared_experts") or 0),
                "first_moe_layer": int(raw.get("first_k_dense_replace") or 0)}
    return {}
