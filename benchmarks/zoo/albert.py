"""ALBERT masked-LM: one transformer layer shared by all 4 layers (cross-layer weight sharing),
factorized embeddings (32 -> 64).

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import AlbertConfig, AlbertForMaskedLM

VOCAB = 256
SEQ_LEN = 32


def config() -> AlbertConfig:
    return AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=4,
                        num_hidden_groups=1, num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=SEQ_LEN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        classifier_dropout_prob=0.0)


def build_model() -> AlbertForMaskedLM:
    return AlbertForMaskedLM(config())


def example_batch(batch_size: int):
    ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN))  # no pad/bos/eos ids (0..2)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long)}
    return inputs, ids  # predict every token (a real MLM masks 15% of them; the cost is the same)


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
