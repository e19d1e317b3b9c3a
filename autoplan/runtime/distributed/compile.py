"""torch.compile per chain module, as torchtitan compiles each TransformerBlock (plan.json compile.enable).

Each of the plan's chain modules is compiled in place (nn.Module.compile: its parameter names do not change,
so checkpoints, the initial broadcast and FSDP2 see the same names), after tensor parallelism and activation
checkpointing and before FSDP2, torchtitan's order. Compiling the repeated blocks one at a time lets dynamo
reuse one compiled graph for every block of the same code. Inductor fuses each block's pointwise ops into a
few kernels (what the cost model prices, cost/calibration.py COMPILE_TIME_FACTOR); on a CPU it generates C++
and needs a compiler (gcc), and compiles for seconds to minutes per distinct block.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import nn

from autoplan.runtime.distributed.recompute import ROOT_MODULE, allow_mode_in_compiled_checkpoint, submodule


def compile_modules(module: nn.Module, chain_modules: Sequence[str], enabled: bool,
                    tensor_parallel_plan: Mapping[str, str] | None = None) -> nn.Module:
    """Compile each of `chain_modules` (submodule paths; "" = `module` itself) in place when `enabled`.
    Graph breaks are allowed (fullgraph=False): a model's own Python (Hugging Face's masks, say) runs eagerly
    between compiled regions instead of failing.

    A chain module that is itself in the `tensor_parallel_plan` (the vocabulary-parallel embedding, the
    head whose logits leave it sharded for loss_parallel) stays eager: its output is a sharded DTensor, whose
    tangent AOTAutograd cannot prepare (torch 2.13: "Attempting to use FunctionalTensor on its own"), and
    torchtitan compiles the transformer blocks only. Their ops are a matmul or a lookup, which compile
    prices unchanged (COMPILE_TIME_FACTOR). With tensor parallelism AOTAutograd's on-disk cache is off
    (_no_autograd_cache).

    Shapes are static (dynamic=False): train.py's micro-batches all have one shape, and with symbolic shapes (what
    dynamo turns to after a recompile) AOTAutograd failed to trace a recomputed module over tensor-parallel
    DTensors on torch 2.13 (a GPT at tp=2 with full recompute: "RecursionError" and "SymInt is not tracked with
    proxy" in proxy_tensor, tests/test_pairs_matrix.py)."""
    if not enabled:
        return module
    allow_mode_in_compiled_checkpoint()  # recomputed chain modules turn dropout off inside their checkpoint
    if tensor_parallel_plan:
        _no_autograd_cache()
    sharded = set(tensor_parallel_plan or ())
    compiled = [path for path in chain_modules if path not in sharded]
    _room_for_each_module(len(compiled))
    for path in compiled:
        target = module if path == ROOT_MODULE else submodule(module, path)
        target.compile(dynamic=False)
    return module


def _room_for_each_module(modules: int) -> None:
    """Let dynamo keep one graph per compiled chain module of one code object. Recomputed chain modules are
    wrapped by torch's checkpoint_wrapper, whose one `forward` every wrapper shares: dynamo caches graphs per code
    object, so each chain module of another kind (the embedding, a decoder layer, the final norm, the head) is a
    recompilation of that forward (4 on Llama-3.2-1B with recompute under compile, seen on an H200 with torch
    2.11), and past torch._dynamo.config.recompile_limit (8) the rest would run eager, silently, while priced
    compiled. The limit is raised to the number of modules compiled (never lowered)."""
    import torch._dynamo.config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, modules)


def _no_autograd_cache() -> None:
    """Turn off AOTAutograd's cache of compiled graphs for this process. On torch 2.13 a graph whose inputs
    or outputs are DTensors (tensor parallelism, sequence-parallel activations) reloaded from that cache
    stops with "'Tensor' object has no attribute 'elem'" in its subclass wrapper: the first run of a
    program trains, and every later run on the machine fails (seen with HF Llama at tp=2 with sequence
    parallelism). Inductor's own kernel cache stays on, so a later run still skips the C++ compile."""
    import torch._functorch.config

    torch._functorch.config.enable_autograd_cache = False
