"""A bf16 step as the program runs it (torch.autocast over fp32 weights, the experts cast to bf16 by
runtime/distributed/expert_parallel.py), priced against what it keeps and what it runs.

- The experts module: priced (saved activations + the experts' cast weight copies) against the bytes its forward
  saves for backward, tallied with saved_tensors_hooks under CPU autocast with the runtime's expert cast. Before,
  the grouped matmuls (which autocast does not cast) and the expert MLP after them were priced as float32 (1.57x
  what they keep) and their bf16 weight copies not at all. On an H200 the same pricing explains the measured
  difference between the experts run in fp32 and in bf16 (2.420 GB of 72.27; benchmarks/results/
  gpu_check_h200_20261127b, train_moe_fp32_experts.json vs train_moe.json) to the MB.
- The loss_fn's cross-entropy, outside the captured graph, and autocast's weight casts each step: priced in the time.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autoplan.chain.modules import build_chain
from autoplan.chain.tensor_parallel import tensor_parallel_facts
from autoplan.cost import calibration
from autoplan.cost.compute import TableSetting, loss_s, module_table, weight_cast_s
from autoplan.cost.module_costs import autocast_weight_copy_bytes, chain_costs, saved_by_mode
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import profile_model
from autoplan.source import load_source

MODELS = Path(__file__).resolve().parent / "models"
BATCH = 2


@pytest.fixture(scope="module")
def deepseek():
    source = load_source(str(MODELS / "tiny_deepseek_v3.py"))
    profile = profile_model(source, BATCH, load_hardware("h200-sxm-141gb"), measure=False)
    chain = build_chain(profile)
    return source, profile, chain, chain_costs(profile, chain, tensor_parallel_facts(profile))


def _held_by_module(source) -> dict[str, int]:
    """Bytes each module's forward saves for backward (storages no earlier op saved, parameters excluded) in one
    bf16 autocast forward with the experts cast as the program casts them."""
    from autoplan.layout import Parallelism
    from autoplan.runtime.distributed.expert_parallel import parallelize_experts

    torch.manual_seed(0)
    model = source.build_model()
    parallelize_experts(model, Parallelism(), "cpu", dtype=torch.bfloat16)
    inputs, _ = source.example_batch(BATCH)
    stack, held, seen = [""], {}, set()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name))
        module.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
    storages = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            storages.append(storage)
            owner = stack[-1]
            held[owner] = held.get(owner, 0) + storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs)
    return held


def test_the_experts_are_priced_as_a_bf16_step_keeps_them(deepseek):
    source, profile, chain, costs = deepseek
    held = _held_by_module(source)
    by_node = {op.node: op for op in profile.ops}
    for layer in (1, 2):
        experts = f"model.layers.{layer}.mlp.experts"
        measured = sum(b for name, b in held.items() if name.startswith(experts))
        ops = tuple(op for chain_module, module in zip(chain.modules, costs.modules)
                    for node, op in zip(chain_module.ops, module.ops) if by_node[node].module.startswith(experts))
        part = replace(costs.modules[0], ops=ops, input_bytes=0.0)
        copies = autocast_weight_copy_bytes(part, 1, 2)
        priced = saved_by_mode(part, 1, 0.5, autocast=True)["none"] * BATCH + copies
        stacked = sum(n for name, n in profile.parameters.items() if name.startswith(experts))
        assert stacked > 0 and copies == 2 * stacked  # the experts' bf16 copies, saved for backward
        assert priced == pytest.approx(measured, rel=0.02), f"priced {priced:.0f} B, the step keeps {measured} B"


def _setting(costs, profile, autocast: bool, **kw) -> TableSetting:
    return TableSetting(gpu=load_hardware("h200-sxm-141gb").gpu, capture_dtype="fp32", train_dtype="bf16", tp=1,
                        microbatch=4, tp_link=None, use_measured=False, autocast=autocast, **kw)


def test_the_loss_fn_outside_the_graph_is_priced_on_the_logits(deepseek):
    _, profile, chain, costs = deepseek
    last = costs.modules[-1]
    assert last.output_buffer_bytes > 0  # the logits leave the graph: the loss_fn runs on them outside it
    without = replace(costs, modules=costs.modules[:-1] + (replace(last, output_buffer_bytes=0.0),))
    for autocast in (True, False):
        setting = _setting(costs, profile, autocast)
        table, bare = module_table(costs, setting), module_table(without, setting)
        forward, backward = loss_s(last.output_buffer_bytes * 4, setting)
        assert table.forward_s[-1] - bare.forward_s[-1] == pytest.approx(forward)
        assert table.backward_s[-1] - bare.backward_s[-1] == pytest.approx(backward)
    gpu = setting.gpu
    logits = last.output_buffer_bytes * 4
    bandwidth = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    forward, _ = loss_s(logits, _setting(costs, profile, True))
    # fp32 under autocast: the passes over fp32 logits plus the cast from bf16 (2 + 4 bytes a logit)
    assert forward == pytest.approx((calibration.LOSS_FORWARD_PASSES * logits + logits * 1.5) / bandwidth
                                    + 3 * gpu.kernel_overhead_s)


def test_autocast_casts_the_weights_each_step(deepseek):
    _, profile, chain, costs = deepseek
    plain = module_table(costs, _setting(costs, profile, False))
    cast = module_table(costs, _setting(costs, profile, True))
    setting = _setting(costs, profile, True)
    for u, module in enumerate(costs.modules):
        casts = sum(weight_cast_s(op, setting) for op in module.ops if op.autocast_weight_numel)
        loss_f, loss_b = (loss_s(module.output_buffer_bytes * 4, setting)[i]
                          - loss_s(module.output_buffer_bytes * 4, _setting(costs, profile, False))[i] for i in (0, 1))
        assert cast.forward_s[u] - plain.forward_s[u] == pytest.approx(casts + loss_f, abs=1e-12)
        assert cast.backward_s[u] - plain.backward_s[u] == pytest.approx(casts + loss_b, abs=1e-12)
    experts = [op for module in costs.modules for op in module.ops if op.grouped]
    assert experts and all(op.autocast_weight_numel > 0 for op in experts)
    gpu = setting.gpu
    op = experts[0]
    assert weight_cast_s(op, setting) == pytest.approx(
        op.autocast_weight_numel * 6 / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
        + gpu.kernel_overhead_s)
