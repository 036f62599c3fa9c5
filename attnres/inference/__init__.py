"""Inference glue around the models: loading a folder for generation and streaming its text.

The fused bank path itself lives in `attnres.layers.bank` (chosen by any forward without autograd); the KV
cache and drafter capture are options of `AttnResForCausalLM.forward` (`cache`, `capture_layers`).
"""

from attnres.inference.generation import ByteStreamer, encode_prompt, generate_text, load_for_generation

__all__ = ["ByteStreamer", "encode_prompt", "generate_text", "load_for_generation"]
