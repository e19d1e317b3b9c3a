"""Hugging Face Qwen3 from a tiny Qwen3Config that computes its loss inside forward (labels=): the user's loss_fn
returns the model's own output.loss."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB, SEQ_LEN = 64, 8


def build_model() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
        use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids}, ids


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return output.loss
