"""A tiny Mixtral-architecture mixture of experts (transformers, as examples/mixtral.py builds it) for
benchmarks/chaos.py's expert-parallel layout: 4 experts (top-2), 2 layers, width 16, sequence 8, dropout 0.1 on the
attention weights (attention_dropout). Self-contained: the output folder trains its copy in model_code/."""

import torch
from torch.nn import functional as F
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB, SEQ_LEN = 64, 8


def build_model() -> MixtralForCausalLM:
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ_LEN,
        use_cache=False, attention_dropout=0.1))


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
