"""examples/llama.py (HF LlamaForCausalLM from a config, grouped-query attention) at tiny sizes."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("autoplan_tiny_llama",
                                               Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.VOCAB, llama.HIDDEN, llama.INTERMEDIATE, llama.LAYERS, llama.HEADS, llama.KV_HEADS, llama.SEQ_LEN = (
    64, 16, 32, 4, 4, 2, 8)

build_model = llama.build_model
example_batch = llama.example_batch
loss_fn = llama.loss_fn
