"""The plan's memory, part by part, against what `autoplan verify --measure` finds the peak held on CPU
(PeakLiveMemory.peak_parts: parameters, gradients, optimizer state, buffers, activations), for each layout of the
matrix: FSDP, tensor and pipeline parallel on their own; context parallel (ring attention); expert parallel on a tiny
Qwen3-MoE (over data-parallel ranks, and folded over tensor-parallel ones); FSDP x pipeline and FSDP x tensor
parallel. One 4-process launch for all of them (tests/helpers/verify_many.py, measure=True).

What each checks beyond the total: the gradients and optimizer state a rank holds at its peak (exactly: they follow
from the layout), the parameters (exactly where nothing is gathered; FSDP2's resharding layouts: the shards plus at
most the gathered units priced), and the activations (within ACTIVATIONS_TOLERANCE; with resharding FSDP2 together
with the parameters, since what is gathered at the peak's moment moves between the two)."""

import json
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model

from helpers.verify_many import verify_many

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPT = f"""import sys, torch
sys.path.insert(0, {str(EXAMPLES)!r})
from gpt import GPT, loss_fn
def build_model():
    return GPT(256, 512, 2, 2, 64)
def example_batch(batch_size):
    idx = torch.randint(0, 256, (batch_size, 513))
    return idx[:, :-1], idx[:, 1:]
"""
WIDE_GPT = GPT.replace("GPT(256, 512, 2, 2, 64)", "GPT(256, 32, 8, 2, 256)").replace("(batch_size, 513)",
                                                                                     "(batch_size, 33)")
"""8 blocks of 256 features on 32 tokens: a pipeline stage's parameters (4 blocks) outweigh a micro-batch's
activations, so the stage's peak is its last backward's (the whole stage gathered, its unsharded gradients and the
reduce-scatter buffers), not a steady-state one's."""
MOE = '''"""A tiny Hugging Face Qwen3-MoE (4 experts, top-2) at 128 tokens, built from its config, never downloaded."""
import torch
from torch.nn import functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SEQ = 128


def build_model():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False))


def example_batch(batch_size):
    ids = torch.randint(0, 256, (batch_size, SEQ + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''
MODELS = {"gpt": GPT, "wide_gpt": WIDE_GPT, "moe": MOE}
LAYOUTS = {
    # one micro-batch per rank: FSDP2's sharded gradients are made in backward, none alive at the loss's peak
    "fsdp": ("gpt", "dp=2,zero=3,microbatch=2,recompute=none", 2, 4),
    # one micro-batch, no data parallelism: autograd's .grad made in backward (was priced as held at the peak)
    "tp": ("gpt", "dp=1,tp=2,microbatch=4,recompute=none", 2, 4),
    # a pipeline accumulates: the gradients exist from the first micro-batch's backward on
    "pp": ("gpt", "dp=1,pp=2,microbatch=1,recompute=none,schedule=1f1b", 2, 4),
    # FSDP2 over the two context-parallel ranks (reshard never), two micro-batches: the unsharded gradients are the
    # gathered parameters' .grad from the first micro-batch's backward on, let go after the last reduce-scatter
    "cp": ("gpt", "dp=1,cp=2,microbatch=2,recompute=none", 2, 4),
    # 1F1B over 4 micro-batches: a pipeline's backwards keep the stage gathered, its forwards reshard it, so the
    # first stage's peak (a steady-state backward) holds the units in flight and the unsharded gradients
    "fsdp_pp": ("gpt", "dp=2,zero=3,pp=2,microbatch=1,recompute=none,schedule=1f1b", 4, 8),
    # the same with parameters outweighing activations: the peak is the last backward's, the whole stage gathered,
    # the unsharded gradients and two units' reduce-scatter buffers (the sharded gradients replace the unsharded)
    "fsdp_pp_wide": ("wide_gpt", "dp=2,zero=3,pp=2,microbatch=1,recompute=none,schedule=1f1b", 4, 8),
    "fsdp_tp": ("gpt", "dp=2,zero=3,tp=2,microbatch=2,recompute=none", 4, 4),
    # experts split over the two data-parallel ranks
    "ep": ("moe", "dp=2,zero=3,ep=2,microbatch=2,recompute=none", 2, 4),
    # experts folded over the two tensor-parallel ranks (no data parallelism): each rank holds half of them
    "ep_tp": ("moe", "dp=1,tp=2,ep=2,microbatch=4,recompute=none", 2, 4),
    # selective recompute keeps matmul and attention outputs and the route's all-to-all outputs (runtime/distributed/recompute.py):
    # checked by test_selective_recompute_keeps_the_routes_all_to_all_outputs_as_priced
    "ep_selective": ("moe", "dp=2,zero=3,ep=2,microbatch=2,recompute=selective", 2, 4),
}
ALL_PARTS = [name for name in LAYOUTS if name != "ep_selective"]
"""Layouts whose every part is checked. Not ep_selective's: its peak comes in the backward, after the head's gradient
is made (measured 32,896 B of gradients at it, the head's FSDP2 shard), where the memory model prices the peak at the
forward's end with no gradient alive: that moment is not priced yet."""
RESHARDING = {"fsdp", "fsdp_pp", "fsdp_pp_wide", "fsdp_tp", "ep", "ep_selective"}
"""FSDP2 with reshard=always: what is gathered at the peak's moment is priced as the units in flight (or, at the
last backward of a pipeline stage, the whole stage)."""
ACTIVATIONS_TOLERANCE = {"fsdp": 0.15, "tp": 0.15, "pp": 0.15, "cp": 0.15, "fsdp_pp": 0.15, "fsdp_pp_wide": 0.15,
                         "fsdp_tp": 0.15, "ep": 0.15, "ep_tp": 0.05, "ep_selective": 0.15}
"""Measured here, predicted vs measured activations (with the parameters where RESHARDING): tp -8.7%, fsdp -6% (with
the gathered units), pp +7.5% on the first stage, -5.9% on the last (cut after blocks.1.ln_1; before the program's
receive buffers were made on demand and the last stage's kept logits priced, runtime/distributed/steps.py and cost/memory.py,
the last stage was -29%), cp -3.7% / -2.1% (the
two ranks), fsdp_pp +8.9% first stage / -0.6% last, fsdp_pp_wide +2.6% / +11.0%, fsdp_tp -5.9%, ep +12.4% / +12.7%,
ep_tp +1.0% / +1.2% (0.05 there: 0.15 held the over-price below too). The MoE layouts were +24.0% and +12.0%
(tolerance 0.30) while the Qwen3-MoE's attention was
priced as captured: under torch.export transformers materializes the causal mask and, given one, repeats the
grouped-query keys and values, where the program passes is_causal and enable_gqa (its SDPA call keeps 196 KiB at
2 x 128 tokens, 388 KiB priced: chain/attention.py run_time_saved_bytes, tests/test_attention_saved.py); kept once
per layer and again in the layer's working set. What remains of ep's: the gathered parameters priced at the loss's
peak (FSDP_PREFETCH_UNITS units, +0.28 MiB, the dense fsdp layout's rule) and the working set of a module's backward,
priced as its whole saved bytes again (cost/compute.py _module_row): on one process, no parallelism, a Qwen3-MoE
decoder layer's backward holds 0.375 MiB beyond what is alive when it starts at 2 x 128 tokens (0.24 of its 1.53 MiB
saved), a GPT block's 1.06 MiB (0.26 of 4.02), both far under the rule, yet the distributed GPT layouts are priced
2-9% low with it, so changing it needs what those programs hold beyond it found first. Unpriced on the other side:
the expert-parallel route's own saved tensors (runtime/distributed/expert_parallel.py _route: the returned rows before the
router-weight multiply and the (token, slot) index vectors, ~0.14 MiB a layer here by their shapes)."""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory_parts")
    for name, code in MODELS.items():
        (root / f"{name}_model.py").write_text(code)
    folders = {}
    for name, (model, pin, gpus, batch) in LAYOUTS.items():
        folders[name] = root / name
        # op times from the roofline, so the pipeline's cut does not move with this machine's timings
        plan_model(str(root / f"{model}_model.py"), gpus, "cpu",
                   PlanOptions(global_batch=batch, pin=pin, out=folders[name], measure=False))
    results = verify_many(list(folders.values()), steps=2, timeout_s=1800, nproc=4, measure=True).results
    return {name: (result, json.loads((folders[name] / "verify.json").read_text()))
            for name, result in zip(folders, results)}


@pytest.mark.parametrize("name", ALL_PARTS)
def test_each_part_of_the_peak_is_priced_as_measured(measured, name):
    result, report = measured[name]
    assert result.passed, result.error or report
    ranks = report["ranks"]
    assert len(ranks) == LAYOUTS[name][2]
    for rank in ranks:
        got, priced = rank["measured_peak_memory_parts"], rank["predicted_peak_memory_parts"]
        where = f"rank {rank['rank']}: measured {got}, predicted {priced}"
        assert got["gradients"] == pytest.approx(priced["gradients"], rel=0.01, abs=1024), where
        assert got["optimizer"] == pytest.approx(priced["optimizer"], rel=0.01, abs=1024), where
        tolerance = ACTIVATIONS_TOLERANCE[name]
        if name in RESHARDING:  # the shards, and at most the gathered units priced in flight
            assert 0 < got["parameters"] <= priced["parameters"], where
            assert (got["parameters"] + got["activations"]
                    == pytest.approx(priced["parameters"] + priced["activations"], rel=tolerance)), where
        else:
            assert got["parameters"] == pytest.approx(priced["parameters"], rel=0.01), where
            assert got["activations"] == pytest.approx(priced["activations"], rel=tolerance), where


MOE_SEQ = 128
"""The tiny Qwen3-MoE's sequence (MOE's SEQ)."""
ROUTE_KEPT_SHARE = 0.10
"""The least share of the priced parameters and activations that the route's kept all-to-all outputs make in the
ep_selective layout (2 x 128 tokens a rank, top-2, 64 features, fp32 on CPU: 0.54 of 3.68 MB): a price without them
would miss the measurement by more than ACTIVATIONS_TOLERANCE allows."""


def test_selective_recompute_keeps_the_routes_all_to_all_outputs_as_priced(measured):
    """Under selective recompute an expert-parallel rank keeps its route's all-to-all outputs (the rows and ids it
    received, its rows back: cost/expert_parallel.py selective_kept_bytes), as the program's save list keeps them
    (runtime/distributed/recompute.py). Measured here: 3.689 MB of parameters and activations at the peak, priced 3.683 MB
    (3.14 MB without the route's 0.54 MB: -15%)."""
    from autoplan.cost.expert_parallel import selective_kept_bytes

    result, report = measured["ep_selective"]
    assert result.passed, result.error or report
    _, pin, gpus, batch = LAYOUTS["ep_selective"]
    tokens = batch // gpus * MOE_SEQ
    route = 2 * selective_kept_bytes(tokens * 2, 64, 4, 1.0, 2)  # two layers, top-2, 64 features, fp32
    for rank in report["ranks"]:
        got, priced = rank["measured_peak_memory_parts"], rank["predicted_peak_memory_parts"]
        where = f"rank {rank['rank']}: measured {got}, predicted {priced}"
        assert got["optimizer"] == pytest.approx(priced["optimizer"], rel=0.01, abs=1024), where
        whole = priced["parameters"] + priced["activations"]
        assert route > ROUTE_KEPT_SHARE * whole, where
        assert got["parameters"] + got["activations"] == pytest.approx(whole, rel=ACTIVATIONS_TOLERANCE["ep"]), where
