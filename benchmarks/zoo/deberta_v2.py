"""DeBERTa-v2 sequence classification: disentangled relative attention (c2p + p2c, log buckets), pooler.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

VOCAB = 256
SEQ_LEN = 32
LABELS = 3


def config() -> DebertaV2Config:
    return DebertaV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=SEQ_LEN, relative_attention=True,
                           position_buckets=16, max_relative_positions=SEQ_LEN, pos_att_type=["p2c", "c2p"],
                           position_biased_input=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           pooler_dropout=0.0, num_labels=LABELS)


def build_model() -> DebertaV2ForSequenceClassification:
    return DebertaV2ForSequenceClassification(config())


def example_batch(batch_size: int):
    ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long)}
    return inputs, torch.randint(0, LABELS, (batch_size,))


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
