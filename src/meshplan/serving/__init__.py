"""Serving: autoregressive generation with a KV cache, prefill and decode each planned by the
intra-op ILP (`serve(model).generate(input_ids, max_new_tokens, temperature, top_k)`)."""

from meshplan.serving.decoder import Decoder, as_decoder
from meshplan.serving.generate import Server, serve

__all__ = ["Decoder", "Server", "as_decoder", "serve"]
