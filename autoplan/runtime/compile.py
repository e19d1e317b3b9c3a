"""torch.compile per chain module, as torchtitan compiles each TransformerBlock (plan.json compile.enable).

Each of the plan's chain modules is compiled in place (nn.Module.compile: its parameter names do not change,
so checkpoints, the initial broadcast and FSDP2 see the same names), after tensor parallelism and activation
checkpointing and before FSDP2, torchtitan's order. Compiling the repeated blocks one at a time lets dynamo
reuse one compiled graph for every block of the same code. Inductor fuses each block's pointwise ops into a
few kernels (what the cost model prices, cost/calibration.py COMPILE_TIME_FACTOR); on a CPU it generates C++
and needs a compiler (gcc), and compiles for seconds to minutes per distinct block.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from autoplan.runtime.recompute import ROOT_MODULE, submodule


def compile_modules(module: nn.Module, chain_modules: Sequence[str], enabled: bool) -> nn.Module:
    """Compile each of `chain_modules` (submodule paths; "" = `module` itself) in place when `enabled`.
    Graph breaks are allowed (fullgraph=False): a model's own Python (Hugging Face's masks, say) runs eagerly
    between compiled regions instead of failing."""
    if not enabled:
        return module
    for path in chain_modules:
        target = module if path == ROOT_MODULE else submodule(module, path)
        target.compile()
    return module
