"""Decoder: what generation needs of a model — one forward step over a KV cache, and the cache.

The contract is Hugging Face Flax's (`model(input_ids, attention_mask, position_ids, params,
past_key_values)`), so its causal LMs serve as they are (`Decoder.from_hf`); any JAX model with
a cache can be wrapped the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshplan.errors import OptionsError


@dataclass(frozen=True, slots=True)
class Decoder:
    """A causal language model with a KV cache.

    Attributes:
        forward: `forward(params, cache, input_ids, attention_mask, position_ids) -> (logits,
            cache)`: input_ids and position_ids are int32 [batch, steps] (the prompt at prefill,
            one token per decode step), attention_mask int32 [batch, max_length] (1 for real
            tokens and the positions still to be generated, 0 for left padding), logits
            [batch, steps, vocab]; the cache comes back with this step's keys and values written.
        init_cache: `init_cache(batch, max_length) -> cache`, a pytree of arrays (e.g. keys and
            values [batch, max_length, heads, head_dim] per layer and a write index).
    """

    forward: Callable[..., tuple[Any, Any]]
    init_cache: Callable[[int, int], Any]

    @classmethod
    def from_hf(cls, model: Any) -> Decoder:
        """The Decoder of a Hugging Face Flax causal LM (`FlaxGPT2LMHeadModel`, `FlaxLlamaForCausalLM`, ...)."""

        def forward(params: Any, cache: Any, input_ids: Any, attention_mask: Any, position_ids: Any) -> tuple[Any, Any]:
            out = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, params=params,
                        past_key_values=cache)
            return out.logits, out.past_key_values

        return cls(forward, model.init_cache)


def as_decoder(model: Any, params: Any) -> tuple[Decoder, Any]:
    """(Decoder, params) of a Decoder or a Hugging Face Flax causal LM (params default to its own).

    Raises:
        OptionsError: `model` is neither, or no params are given for a Decoder.
    """
    if isinstance(model, Decoder):
        if params is None:
            raise OptionsError("serve(decoder, params): a Decoder holds no weights; pass its params")
        return model, params
    if callable(getattr(model, "init_cache", None)) and hasattr(model, "params"):
        return Decoder.from_hf(model), model.params if params is None else params
    raise OptionsError(
        f"serve({type(model).__name__}): not a model meshplan can serve; pass a Hugging Face Flax causal LM "
        "(it has init_cache and params) or a meshplan.serving.Decoder(forward, init_cache) with its params")
