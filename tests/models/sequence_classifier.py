"""A transformer encoder (SDPA attention) that classifies whole sequences: its targets are one label per
sequence, so context parallelism, which cuts the targets to each rank's share of the sequence, cannot run."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, CLASSES = 64, 16, 32, 3


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden.mean(1))


def build_model():
    return Classifier()


def example_batch(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)
