"""StarCoder2: grouped-query attention, sliding window (8 < sequence 32), biased linears, LayerNorm.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import Starcoder2Config, Starcoder2ForCausalLM

VOCAB = 256
SEQ_LEN = 32


def config() -> Starcoder2Config:
    return Starcoder2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                            sliding_window=8, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
                            use_cache=False)


def build_model() -> Starcoder2ForCausalLM:
    return Starcoder2ForCausalLM(config())


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
