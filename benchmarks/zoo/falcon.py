"""Falcon (7B-style): multi-query attention, ALiBi, parallel attention + MLP block, biased linears.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import FalconConfig, FalconForCausalLM

VOCAB = 256
SEQ_LEN = 32


def config() -> FalconConfig:
    return FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        multi_query=True, alibi=True, parallel_attn=True, new_decoder_architecture=False, bias=True,
                        hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)


def build_model() -> FalconForCausalLM:
    return FalconForCausalLM(config())


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
