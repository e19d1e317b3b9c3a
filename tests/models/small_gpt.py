"""examples/gpt.py (tied lm_head, head count hard-coded in its views) at small sizes, 4 blocks."""

import importlib.util
from pathlib import Path

import torch

import autoplan

EXAMPLES = Path(autoplan.__file__).resolve().parents[1] / "examples"
"""Found through the package, not this file: train.py imports a copy of this file from its own folder."""

_spec = importlib.util.spec_from_file_location("autoplan_small_gpt", EXAMPLES / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
VOCAB, SEQ = 64, 8


def build_model():
    return gpt.GPT(vocab=VOCAB, seq_len=SEQ, n_layer=4, n_head=2, n_embd=16)


def example_batch(batch_size):
    idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return idx[:, :-1], idx[:, 1:]


loss_fn = gpt.loss_fn
