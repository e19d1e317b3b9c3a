"""examples/mixtral.py shrunk for benchmarks/chaos.py's expert-parallel layout: 4 experts (top-2), 2 layers, width 16,
sequence 8, with dropout 0.1 on the attention weights (transformers' attention_dropout)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("autoplan_chaos_mixtral",
                                               Path(__file__).resolve().parents[2] / "examples" / "mixtral.py")
mixtral = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mixtral)
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, 4, 2, 8
example_batch, loss_fn = mixtral.example_batch, mixtral.loss_fn


def build_model():
    return mixtral.build_model(attention_dropout=0.1)
