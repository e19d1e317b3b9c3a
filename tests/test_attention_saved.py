"""What a transformers model's SDPA calls keep for backward, priced (chain.attention.run_time_saved_bytes, the
OpCost of the call) against what the real model's calls save (saved_tensors_hooks during each
F.scaled_dot_product_attention call, storages no earlier op saved, parameters excluded).

Under torch.export transformers builds its causal mask as a tensor and, with a mask, repeats grouped-query keys
and values to the query heads; run eagerly on an unpadded batch it passes is_causal and enable_gqa instead: the
call keeps its queries, the unrepeated keys and values, its output and logsumexp. Priced from the capture as it was
(mask and repeated keys and values), the tiny Qwen3-MoE of tests/test_memory_parts.py had its attention at twice
what it keeps, which made its expert-parallel layouts' activations look over-priced."""

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from autoplan.chain.modules import build_chain
from autoplan.chain.tensor_parallel import tensor_parallel_facts
from autoplan.cost.module_costs import chain_costs
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import profile_model
from autoplan.contract import load_source

ZOO = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo" / "causal_lm.py"
BATCH = 2


class _SdpaCalls(TorchFunctionMode):
    """Counts the bytes each F.scaled_dot_product_attention call saves for backward that nothing saved before."""

    def __init__(self, parameters: set[int]) -> None:
        super().__init__()
        self.parameters, self.seen, self.calls, self.inside = parameters, set(), [], False
        self.storages: list[torch.UntypedStorage] = []

    def pack(self, tensor: torch.Tensor) -> None:
        """Counts it and keeps its storage (so no later tensor reuses its key), not the tensor (no backward runs:
        holding an op's own output from its node is a cycle autograd's C++ side keeps alive, the model with it)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.parameters and key not in self.seen:
            self.seen.add(key)
            self.storages.append(storage)
            if self.inside:
                self.calls[-1] += storage.nbytes()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.calls.append(0)
        self.inside = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.inside = False


def _real_sdpa_saved_bytes(source) -> list[int]:
    torch.manual_seed(0)
    model = source.build_model()
    inputs, _ = source.example_batch(BATCH)
    mode = _SdpaCalls({p.untyped_storage()._cdata for p in model.parameters()})
    with mode, torch.autograd.graph.saved_tensors_hooks(mode.pack, lambda packed: packed):
        model(**inputs)
    return mode.calls


def _priced_sdpa_saved_bytes(source) -> tuple[list[float], bool]:
    profile = profile_model(source, BATCH, load_hardware("h100-sxm5-80gb"), measure=False)
    chain = build_chain(profile)
    costs = chain_costs(profile, chain, tensor_parallel_facts(profile))
    priced = [op.saved_bytes * BATCH for module in costs.modules for op in module.ops if op.kind == "attention"]
    return priced, profile.masks_left_to_is_causal


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_a_causal_grouped_query_call_is_priced_as_the_program_keeps_it(family):
    source = load_source(f"{ZOO}:{family}")
    real = _real_sdpa_saved_bytes(source)
    priced, maskless = _priced_sdpa_saved_bytes(source)
    assert maskless
    assert len(priced) == len(real) > 0
    assert priced == pytest.approx(real, rel=0.02), f"priced {priced}, saved {real}"


@pytest.mark.parametrize("family", ["qwen2", "mixtral_moe"])
def test_a_sliding_window_keeps_the_capture_s_mask_and_repeats(family):
    """A window shorter than the sequence (Qwen2's second layer, every Mixtral layer): transformers builds a mask for
    it at run time, so the capture's masks are not all left to is_causal; the calls are priced as captured, never
    below what they keep."""
    source = load_source(f"{ZOO}:{family}")
    real = _real_sdpa_saved_bytes(source)
    priced, maskless = _priced_sdpa_saved_bytes(source)
    assert not maskless
    assert len(priced) == len(real) > 0
    assert all(p >= r for p, r in zip(priced, real)), f"priced {priced}, saved {real}"
