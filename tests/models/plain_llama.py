"""A Hugging Face Llama as a newcomer writes it: a plain LlamaConfig, use_cache left at its default (True), so
its forward returns a KV cache (transformers' DynamicCache) beside the logits unless told otherwise."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 64, 8


def build_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


def example_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]
