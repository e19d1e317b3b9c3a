"""bf16 without FSDP2 trains as torch.autocast over fp32 weights (runtime/distributed/steps.py): the memory model prices
that, not pure bf16. Closed forms: fp32 weights and gradients (4 + 4 + 8 bytes per parameter), the bf16 copies
autocast saves of the matmul weights, float32 activations where autocast computes in float32 (the residual
stream, norms, the loss) and bf16 elsewhere; one rule (layout.fsdp_wraps) for the program and the price."""

from dataclasses import replace

import pytest
from chain_fixtures import cluster, gpt_profile

from autoplan.cost.context import TableKey
from autoplan.chain.ops import autocast_fp32_nodes
from autoplan.cost.context import Context
from autoplan.cost.evaluate import build_problem
from autoplan.cost.memory import MemoryInputs, MemoryLayout, layout_memory
from autoplan.cost.module_costs import ModuleCosts, OpCost, autocast_weight_copy_bytes, saved_by_mode
from autoplan.layout import SUPPORTED, fsdp_wraps
from autoplan.plan import Parallelism, Training
from autoplan.profile_data import OpProfile


def _op(node, op, inputs=(), params=(), dtype="float32") -> OpProfile:
    return OpProfile(node=node, op=f"aten.{op}.default", module="m", module_stack=("m",), inputs=inputs,
                     params=params, input_shapes=(), dtype=dtype, flops_fwd=0.0, flops_bwd=0.0, input_bytes=0,
                     output_bytes=0, saved_bytes=0, time_fwd_s=0.0, time_bwd_s=0.0, source="estimated")


def test_autocast_keeps_the_residual_stream_in_fp32_and_the_matmuls_in_bf16():
    ops = [_op("ids_add", "add", dtype="int64"),
           _op("emb", "embedding", ("ids_add",), ("wte.weight",)),      # reads an fp32 weight: fp32
           _op("norm", "layer_norm", ("emb",), ("ln.weight",)),         # fp32 list
           _op("q", "linear", ("norm",), ("q.weight",)),                # lower precision: bf16
           _op("act", "silu", ("q",)),                                  # bf16 in, bf16 out
           _op("res", "add", ("emb", "act")),                           # fp32 + bf16 promotes: fp32
           _op("soft", "softmax", ("act",)),                            # fp32 list, even on a bf16 input
           _op("ones", "ones_like", ())]                                # no op input: made in fp32
    assert autocast_fp32_nodes(ops) == {"emb", "norm", "res", "soft", "ones"}


def _cost(kind, saved, out=0.0, fp32=False, weights=0.0, role="") -> OpCost:
    return OpCost(kind=kind, tp_role=role, flops_fwd=0.0, flops_bwd=0.0, activation_bytes=0.0, parameter_bytes=0.0,
                  input_activation_bytes=0.0, output_bytes=out, saved_bytes=saved, saved_scales=True,
                  has_backward=True, time_fwd_s=0.0, time_bwd_s=0.0, measured=False, profile_batch=1,
                  autocast_fp32=fp32, autocast_weight_numel=weights)


def test_saved_activations_and_weight_copies_closed_form():
    # per sample, capture (fp32) bytes: a norm saving 400 (fp32 under autocast), a Linear saving 800 (its bf16
    # cast input) with 1000 weights and an output of 1200, an elementwise op saving 600 (bf16); input 300
    module = ModuleCosts(ops=(_cost("memory", 400, fp32=True), _cost("gemm", 800, out=1200, weights=1000),
                              _cost("memory", 600)),
                         input_bytes=300, output_buffer_bytes=0.0, replicated_numel=1000, split_numel=0)
    pure = saved_by_mode(module, 1, 0.5)
    assert pure == {"none": 0.5 * 1800, "selective": 0.5 * (300 + 1200), "full": 0.5 * 300}
    autocast = saved_by_mode(module, 1, 0.5, autocast=True)
    assert autocast == {"none": 400 + 0.5 * 1400, "selective": min(1100, 300 + 0.5 * 1200), "full": 300}
    assert autocast_weight_copy_bytes(module, 1, 2) == 2 * 1000
    split = replace(module, ops=(_cost("gemm", 800, weights=1000, role="colwise"),))
    assert autocast_weight_copy_bytes(split, 4, 2) == 2 * 1000 / 4


def test_autocast_states_are_fp32_weights_gradients_and_moments():
    inputs = MemoryInputs(module_numel=(1e6, 3e6), group_numel=(), tied_group_modules=(),
                          module_largest_numel=(1e6, 3e6), activations={"none": (0.0, 0.0)},
                          working_bytes=(0.0, 0.0), cut_bytes=(0.0,))
    autocast = layout_memory(inputs, "bf16", MemoryLayout(autocast=True)).per_module
    pure = layout_memory(inputs, "bf16", MemoryLayout()).per_module
    assert autocast == {"parameters": (4e6, 12e6), "gradients": (4e6, 12e6), "optimizer": (8e6, 24e6)}
    assert pure == {"parameters": (2e6, 6e6), "gradients": (2e6, 6e6), "optimizer": (12e6, 36e6)}


def _par(**degrees) -> Parallelism:
    return Parallelism(**{"microbatch": 2, **degrees})


@pytest.mark.parametrize("degrees, wraps", [
    ({}, False),                                                       # one GPU
    ({"dp_replicate": 2}, False),                     # DDP
    ({"dp_shard": 2}, True),                          # FSDP2
    ({"dp_replicate": 2, "tp": 2}, True),  # fully_shard replicating DTensors
    ({"tp": 2}, False),                             # tensor parallel alone
])
def test_one_rule_picks_autocast_for_the_program_and_the_price(degrees, wraps):
    par = _par(**degrees)
    assert fsdp_wraps(par.dp_replicate, par.dp_shard,
                      par.cp, par.tp) == wraps
    ctx = Context(gpt_profile(n_layer=2), cluster(par.world_size), Training(4, "bf16"), SUPPORTED)
    assert ctx.autocast_layout(par) == (not wraps)
    assert not Context(gpt_profile(n_layer=2), cluster(par.world_size), Training(4, "fp32"),
                       SUPPORTED).autocast_layout(par)


def test_a_one_gpu_bf16_plan_prices_what_autocast_keeps():
    ctx = Context(gpt_profile(n_layer=2), cluster(1), Training(2, "bf16"), SUPPORTED)
    par = _par()
    memory = build_problem(ctx, par, ("none",)).memory[0]
    numel = sum(ctx.module_numel(1, 1)) + sum(ctx.group_numel(1))
    held = {**memory.per_module, **memory.late_per_module}  # gradients: made in backward (one micro-batch)
    tied = {**memory.per_tied_group, **memory.late_per_tied_group}
    states = {c: sum(held[c]) + sum(tied[c]) for c in ("parameters", "gradients", "optimizer")}
    assert states == pytest.approx({"parameters": 4 * numel, "gradients": 4 * numel, "optimizer": 8 * numel})
    pure = ctx.table(TableKey(1, 2))
    autocast = ctx.table(TableKey(1, 2), autocast=True)
    copies = [autocast_weight_copy_bytes(m, 1, 2) for m in ctx.costs.modules]
    assert sum(copies) > 0
    for u, module in enumerate(ctx.costs.modules):
        saved = saved_by_mode(module, 1, ctx.scale, autocast=True)
        assert autocast.activation_bytes["none"][u] == pytest.approx(2 * saved["none"] + copies[u])
        assert autocast.activation_bytes["full"][u] == pytest.approx(2 * saved["full"])
        assert autocast.activation_bytes["none"][u] >= pure.activation_bytes["none"][u]
    assert memory.activations_per_microbatch["none"] == autocast.activation_bytes["none"]
