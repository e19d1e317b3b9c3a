"""Qwen2-MoE: 4 routed experts (top-2) plus a gated shared expert in every layer, grouped-query attention.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

VOCAB = 256
SEQ_LEN = 32


def config() -> Qwen2MoeConfig:
    return Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=1,
                          max_position_embeddings=SEQ_LEN, attention_dropout=0.0, output_router_logits=False,
                          use_cache=False)


def build_model() -> Qwen2MoeForCausalLM:
    return Qwen2MoeForCausalLM(config())


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
