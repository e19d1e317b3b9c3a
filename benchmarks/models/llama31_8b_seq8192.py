"""Llama-3.1-8B's shapes (examples/llama.py's Llama-3-8B; 3.1 changes only the rotary scaling, which costs the
same) on 8192-token sequences: torchtitan's published torch.compile comparison (benchmarks/accuracy.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("autoplan_example_llama_8192",
                                               Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.SEQ_LEN = 8192

build_model = llama.llama3_8b
example_batch = llama.example_batch
loss_fn = llama.loss_fn
