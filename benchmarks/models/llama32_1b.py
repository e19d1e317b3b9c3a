"""Llama-3.2-1B's shapes (meta-llama/Llama-3.2-1B's config.json: 16 layers, hidden 2048, MLP 8192, 32 heads
with 8 KV heads, vocabulary 128256, tied embeddings, rope theta 500000; 1.24e9 parameters) on 2048-token
sequences, built from a transformers config (as examples/llama.py builds Llama-3), never downloaded: the model
benchmarks/gpu_check.sh plans and trains on one GPU. Self-contained: train.py runs a copy of this file."""

import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 2048
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0)


def build_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**LLAMA32_1B, max_position_embeddings=SEQ_LEN, use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, LLAMA32_1B["vocab_size"], (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
