"""A Hugging Face Llama as a newcomer writes it: a plain LlamaConfig, use_cache left at its default (True), so
its forward returns a KV cache (transformers' DynamicCache) beside the logits unless told otherwise.

build_cached (`plain_llama.py:build_cached`) wraps it in a forward that asks for the cache whatever the config says."""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 64, 8


def build_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = build_model()

    def forward(self, input_ids):
        return self.inner(input_ids=input_ids, use_cache=True)


def build_cached():
    return Cached()


def example_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]
