"""Phi-3: fused qkv and gate_up projections, grouped-query attention, sliding window (8 < sequence 32).

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import Phi3Config, Phi3ForCausalLM

VOCAB = 256
SEQ_LEN = 32


def config() -> Phi3Config:
    return Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                      original_max_position_embeddings=SEQ_LEN, sliding_window=8, resid_pdrop=0.0, embd_pdrop=0.0,
                      attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)


def build_model() -> Phi3ForCausalLM:
    return Phi3ForCausalLM(config())


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
