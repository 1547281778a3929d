"""Generation: prompts -> prompts + new tokens, with a KV cache; the prefill step (the whole
prompt) and the decode step (one token) each run under their own plan.

Both steps are one function, `step(params, cache, input_ids, attention_mask, position_ids, key,
temperature) -> (next tokens, cache)`: the model's forward over the cache, then the next token
picked on the devices (argmax, or a sample from the top-k of the tempered logits), so only
[batch, 1] tokens leave the step. `serve` hands it to `parallelize` (ShardParallel by default):
prefill and decode have different shapes, so each is captured and planned by the intra-op ILP on
the mesh; the KV cache is split as the decode plan finds best (by heads, by batch, ...) and is
donated, so each decode step writes it in place and keeps its layout. Left-padded prompts of
different lengths are batched with an attention mask, as in Hugging Face's generate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshplan.errors import OptionsError
from meshplan.serving.decoder import Decoder, as_decoder

StepCompiler = Callable[[Callable[..., Any], str], Callable[..., Any]]


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """Wall times of the last `generate` call (planning and compilation included on first use)."""

    batch: int
    prompt_tokens: int  # per sequence
    new_tokens: int  # per sequence, the prefill's token included
    prefill_seconds: float
    decode_seconds: float  # the new_tokens - 1 decode steps

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.batch * self.prompt_tokens / self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        return self.batch * (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 else 0.0


class Server:
    """Generates with a Decoder whose steps `compile_step` turns into executables.

    Use `serve(...)` for planned, sharded steps, or `Server.single_device(...)` for plain `jax.jit`.
    """

    def __init__(self, decoder: Decoder, params: Any, compile_step: StepCompiler,
                 max_length: int | None = None) -> None:
        self.decoder, self.params, self.max_length = decoder, params, max_length
        self._compile = compile_step
        self._steps: dict[tuple[bool, int | None], tuple[Any, Any]] = {}
        self._last: tuple[Any, Any] | None = None
        self._placed: dict[int, Any] = {}  # id of a planned executable -> params laid out for it
        self.stats: GenerationStats | None = None

    @classmethod
    def single_device(cls, model: Any, params: Any = None, max_length: int | None = None) -> Server:
        """A Server running each step with `jax.jit` on JAX's default device (the reference)."""
        decoder, params = as_decoder(model, params)
        return cls(decoder, params, lambda fn, _: jax.jit(fn, donate_argnums=(1,)), max_length)

    def generate(self, input_ids: Any, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 attention_mask: Any = None, seed: int = 0) -> np.ndarray:
        """Extend each prompt by `max_new_tokens` tokens.

        Args:
            input_ids: int [batch, prompt] token ids, left-padded when prompts differ in length.
            max_new_tokens: tokens to add to every prompt (no early stop).
            temperature: 0 picks the most likely token (greedy); > 0 samples from softmax(logits / T).
            top_k: sample only among the k most likely tokens (None: all); ignored when greedy.
            attention_mask: int [batch, prompt], 0 at padding; default all ones.
            seed: the sampling key's seed; equal seeds draw equal tokens.

        Returns:
            int32 [batch, prompt + max_new_tokens]: the prompts followed by the new tokens.
        """
        ids, prompt_mask = _check_prompts(input_ids, attention_mask, max_new_tokens, temperature, top_k)
        batch, length = ids.shape
        total = self._total_length(length, max_new_tokens)
        prefill, decode = self._steps_for(temperature == 0, top_k)
        mask = np.ones((batch, total), np.int32)
        mask[:, :length] = prompt_mask
        position = np.cumsum(prompt_mask, axis=1, dtype=np.int32) - 1  # Hugging Face's positions of left-padded prompts
        keys = list(jax.random.split(jax.random.key(seed), max_new_tokens))
        temp = np.float32(temperature or 1.0)
        start = time.perf_counter()
        token, cache = prefill(self.params, self.decoder.init_cache(batch, total), ids, mask, position, keys[0], temp)
        tokens, prefilled = [token.block_until_ready()], time.perf_counter()
        position = position[:, -1:]
        for key in keys[1:]:
            position = position + 1
            token, cache = decode(self._params_for(decode), cache, token, mask, position, key, temp)
            tokens.append(token)
        out = np.concatenate([ids, np.asarray(jnp.concatenate(tokens, axis=1))], axis=1)
        self.stats = GenerationStats(batch, length, max_new_tokens, prefilled - start, time.perf_counter() - prefilled)
        return out

    def get_plans(self) -> dict[str, Any]:
        """{"prefill": IntraPlan, "decode": IntraPlan} of the last generate call's mode (empty for jit steps)."""
        if self._last is None or not hasattr(self._last[0], "get_plan"):
            return {}
        return {"prefill": self._last[0].get_plan(), "decode": self._last[1].get_plan()}

    def cache_specs(self) -> dict[str, str]:
        """Planned layout of each KV-cache leaf at the decode step's input, e.g. {"args[1]['cache']...": "S0RS1R"}."""
        plan = self.get_plans().get("decode")
        if plan is None:
            return {}
        return {c.name: str(c.output) for c in plan.nodes if c.op == "parameter" and c.name.startswith("args[1]")}

    def _params_for(self, step: Any) -> Any:
        """The params laid out as `step`'s current plan takes them, placed once: moving every weight
        to its layout on each decode call took 8x the step itself (measured, GPT-2 on 8 CPU devices)."""
        if not hasattr(step, "get_input_shardings"):  # the single-device reference
            return self.params
        try:
            shardings = step.get_input_shardings()  # the executable of these shapes
        except OptionsError:  # not called yet: the first call places the params itself
            return self.params
        if id(shardings) not in self._placed:
            self._placed = {id(shardings): jax.device_put(self.params, shardings[0])}
        return self._placed[id(shardings)]

    def _steps_for(self, greedy: bool, top_k: int | None) -> tuple[Any, Any]:
        key = (greedy, None if greedy else top_k)
        if key not in self._steps:
            step = _step_function(self.decoder, greedy, key[1])
            self._steps[key] = (self._compile(_named(step, "prefill"), "prefill"),
                                self._compile(_named(step, "decode"), "decode"))
        self._last = self._steps[key]
        return self._last

    def _total_length(self, prompt: int, new: int) -> int:
        if self.max_length is None:
            return prompt + new
        if prompt + new > self.max_length:
            raise OptionsError(f"generate: a prompt of {prompt} tokens plus max_new_tokens={new} exceeds the "
                               f"server's max_length={self.max_length}; shorten the prompt or generate fewer tokens")
        return self.max_length


def serve(model: Any, params: Any = None, *, method: Any = None, devices: Sequence[Any] | None = None,
          max_length: int | None = None) -> Server:
    """A Server whose prefill and decode steps are planned and sharded by `parallelize`.

    Args:
        model: a Hugging Face Flax causal LM (e.g. `FlaxGPT2LMHeadModel(GPT2Config(...))`) or a Decoder.
        params: the weights; default the Hugging Face model's own `params`.
        method: a parallelize method for both steps; default ShardParallel(memory_price=0.5):
            the ILP picks every layout on the default mesh of the devices, and splits what
            costs (almost) no communication to split, such as the KV cache.
        devices: the devices to serve on; default all of JAX's.
        max_length: the KV cache's length; default prompt + new tokens of each call (a new
            plan per length), else fixed (one plan per prompt length and batch).

    Returns:
        A Server: `server.generate(input_ids, max_new_tokens, temperature, top_k)`.
    """
    from meshplan import ShardParallel, parallelize  # the runtime face, loaded on use

    decoder, params = as_decoder(model, params)
    method = ShardParallel(memory_price=0.5) if method is None else method
    return Server(decoder, params, lambda fn, _: parallelize(fn, method=method, devices=devices, donate_argnums=(1,)),
                  max_length)


def _step_function(decoder: Decoder, greedy: bool, top_k: int | None) -> Callable[..., Any]:
    def step(params: Any, cache: Any, input_ids: Any, attention_mask: Any, position_ids: Any, key: Any,
             temperature: Any) -> tuple[Any, Any]:
        logits, cache = decoder.forward(params, cache, input_ids, attention_mask, position_ids)
        last = logits[:, -1].astype(jnp.float32)
        token = jnp.argmax(last, axis=-1) if greedy else _sample(last, key, temperature, top_k)
        return token.astype(jnp.int32)[:, None], cache

    return step


def _sample(logits: Any, key: Any, temperature: Any, top_k: int | None) -> Any:
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def named(*args: Any) -> Any:
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    return named


def _check_prompts(input_ids: Any, attention_mask: Any, max_new_tokens: int, temperature: float,
                   top_k: int | None) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or 0 in ids.shape:
        raise OptionsError(f"generate: input_ids must be integer token ids of shape [batch, prompt], got "
                           f"{ids.dtype}{list(ids.shape)}; batch single prompts as ids[None]")
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask, np.int32)
    if mask.shape != ids.shape:
        raise OptionsError(f"generate: attention_mask has shape {mask.shape} but input_ids {ids.shape}; give one "
                           "entry per prompt token (0 at left padding)")
    if max_new_tokens < 1 or temperature < 0 or (top_k is not None and top_k < 1):
        raise OptionsError(f"generate(max_new_tokens={max_new_tokens}, temperature={temperature}, top_k={top_k}): "
                           "need max_new_tokens >= 1, temperature >= 0 (0 = greedy) and top_k >= 1 or None")
    return ids.astype(np.int32), mask
