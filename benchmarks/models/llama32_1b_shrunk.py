"""benchmarks/models/llama32_1b.py shrunk for gpu_check.sh's CPU dry run (--device cpu) and its checkpoint step:
the same Llama structure (tied embeddings, grouped-query attention) at 2 layers, width 64, vocabulary 512,
64-token sequences. Self-contained: train.py runs a copy of this file."""

import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 64
SHRUNK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0)


def build_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**SHRUNK, max_position_embeddings=SEQ_LEN, use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, SHRUNK["vocab_size"], (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
