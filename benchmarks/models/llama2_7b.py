"""Llama-2-7B's shapes (meta-llama/Llama-2-7b-hf config.json; examples/llama.py's transformers Llama, built from a
config, never downloaded), on SEQ_LEN-token sequences (set llama.SEQ_LEN before build_model): NeMo's published
long-sequence ladder (shared/reference/runs_frontier.csv; benchmarks/accuracy.py --frontier)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("autoplan_example_llama_2_7b",
                                               Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.SEQ_LEN = 4096
llama.VOCAB = 32000

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0)
"""Llama-2-7B's config.json: 6.74e9 parameters."""


def build_model():
    return llama.build_model(**LLAMA2_7B)


example_batch = llama.example_batch
loss_fn = llama.loss_fn
