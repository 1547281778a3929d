"""Serving: generation with a KV cache, prefill and decode planned on 8 CPU devices, equals
single-device generation token for token (and Hugging Face's own generate)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from framework_models import VOCAB, gpt2, llama
from meshplan import OptionsError
from meshplan.serving import Decoder, Server, serve

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
NEW_TOKENS = 32


def prompts():
    """Four prompts in one batch (one plan and one compile per step): two of 8 tokens and two
    left-padded ones of 5 and 2 tokens, so full and padded rows share the cache and the steps."""
    ids = np.asarray(jax.random.randint(jax.random.key(1), (4, 8), 0, VOCAB), np.int32)
    mask = np.ones((4, 8), np.int32)
    mask[2, :3] = mask[3, :6] = 0
    return np.where(mask == 1, ids, 0), mask


@functools.cache
def served(name):
    """(model, planned server, one-device server), built once per module for both tests that generate."""
    model = gpt2(layers=2) if name == "gpt2" else llama(layers=2)
    return model, serve(model), Server.single_device(model)


@pytest.fixture(scope="module", autouse=True)
def _free_servers():
    yield
    served.cache_clear()  # their compiled steps are not needed past this module


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_generation_equals_one_device_token_for_token(name):
    model, server, reference = served(name)
    ids, mask = prompts()
    got = server.generate(ids, NEW_TOKENS, attention_mask=mask)
    want = reference.generate(ids, NEW_TOKENS, attention_mask=mask)
    assert got.shape == (ids.shape[0], ids.shape[1] + NEW_TOKENS)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:, :ids.shape[1]], ids)
    hf = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                        pad_token_id=0, eos_token_id=VOCAB).sequences  # no early stop: no id reaches VOCAB
    np.testing.assert_array_equal(got, np.asarray(hf))  # Hugging Face's own greedy search agrees
    plans = server.get_plans()
    assert set(plans) == {"prefill", "decode"} and plans["prefill"].mesh.shape == plans["decode"].mesh.shape == (2, 4)
    assert plans["prefill"].graph_name == "prefill" and plans["decode"].graph_name == "decode"
    caches = server.cache_specs()
    kv = {name: spec for name, spec in caches.items() if name.endswith(("cached_key']", "cached_value']"))}
    assert kv and all(spec != "RRRR" for spec in kv.values())  # planned split (by batch and/or heads)
    assert all(spec[2:4] == "RR" or spec[2] == "R" for spec in kv.values())  # never along the written length


def test_sampled_generation_equals_one_device_with_the_same_seed():
    _, server, reference = served("gpt2")  # the greedy test's server: its greedy steps are compiled
    ids, mask = prompts()
    sample = dict(temperature=0.8, top_k=10, attention_mask=mask)
    got = server.generate(ids, NEW_TOKENS, seed=7, **sample)
    np.testing.assert_array_equal(got, reference.generate(ids, NEW_TOKENS, seed=7, **sample))
    assert not np.array_equal(got, server.generate(ids, NEW_TOKENS, seed=8, **sample))
    greedy = server.generate(ids, NEW_TOKENS, attention_mask=mask)
    assert not np.array_equal(got, greedy)
    stats = server.stats
    assert stats.batch == 4 and stats.prompt_tokens == 8 and stats.new_tokens == NEW_TOKENS
    assert stats.prefill_tokens_per_second > 0 and stats.decode_tokens_per_second > 0


def test_bad_requests_are_clear_errors():
    model = gpt2()
    server = serve(model, max_length=16)
    with pytest.raises(OptionsError, match=r"input_ids must be integer token ids of shape \[batch, prompt\], got "
                                           r"int32\[8\]; batch single prompts as ids\[None\]"):
        server.generate(np.zeros(8, np.int32), 4)
    with pytest.raises(OptionsError, match=r"a prompt of 8 tokens plus max_new_tokens=9 exceeds the server's "
                                           r"max_length=16"):
        server.generate(np.zeros((1, 8), np.int32), 9)
    with pytest.raises(OptionsError, match=r"attention_mask has shape \(1, 4\) but input_ids \(1, 8\)"):
        server.generate(np.zeros((1, 8), np.int32), 4, attention_mask=np.ones((1, 4)))
    with pytest.raises(OptionsError, match=r"serve\(dict\): not a model meshplan can serve"):
        serve({})
    with pytest.raises(OptionsError, match=r"a Decoder holds no weights; pass its params"):
        serve(Decoder.from_hf(model))
