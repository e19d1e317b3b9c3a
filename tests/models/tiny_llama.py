"""examples/llama.py (HF LlamaForCausalLM from a config, grouped-query attention) at tiny sizes."""

import importlib.util
from pathlib import Path

import autoplan

EXAMPLES = Path(autoplan.__file__).resolve().parents[1] / "examples"
"""Found through the package, not this file: train.py imports a copy of this file from its own folder."""

_spec = importlib.util.spec_from_file_location("autoplan_tiny_llama", EXAMPLES / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.VOCAB, llama.HIDDEN, llama.INTERMEDIATE, llama.LAYERS, llama.HEADS, llama.KV_HEADS, llama.SEQ_LEN = (
    64, 16, 32, 4, 4, 2, 8)

build_model = llama.build_model
example_batch = llama.example_batch
loss_fn = llama.loss_fn
