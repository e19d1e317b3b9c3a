"""Llama-3.1-405B's shapes (meta-llama/Llama-3.1-405B config.json; examples/llama.py's transformers Llama, built from
a config, never downloaded), on SEQ_LEN-token sequences (set llama.SEQ_LEN before build_model): torchtitan's
published 405B runs (shared/reference/runs_frontier.csv; benchmarks/accuracy.py --frontier)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("autoplan_example_llama_405b",
                                               Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.SEQ_LEN = 8192

LLAMA31_405B = dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                    num_attention_heads=128, num_key_value_heads=8)
"""Llama-3.1-405B's config.json: 405.9e9 parameters."""


def build_model():
    return llama.build_model(**LLAMA31_405B)


example_batch = llama.example_batch
loss_fn = llama.loss_fn
