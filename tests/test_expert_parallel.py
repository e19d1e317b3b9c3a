"""autoplan.runtime.distributed.expert_parallel on 2 and 4 gloo ranks: transformers' MoE models (Mixtral with grouped
matmul experts, OLMoE, Qwen2-MoE with a shared expert; built from configs) with their experts sharded over
the ranks and tokens routed by all-to-all. Each rank trains on its own quarter or half of the batch (ep
borrows data-parallel ranks): the loss averaged over the ranks equals one device's on the whole batch;
non-expert gradients averaged over the ranks, and each rank's expert gradients divided by the rank count,
equal one device's (for the experts that rank holds)."""

from pathlib import Path

import pytest

from helpers.ranks import assert_every_rank_matches

ROOT = Path(__file__).resolve().parents[1]

ROUTED = """
import copy
import gc
import importlib.util
import sys
import torch
import torch.distributed as dist
from autoplan.runtime.distributed.expert_parallel import is_experts_module, shard_experts


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mixtral = load(f"{ROOT}/examples/mixtral.py", "autoplan_test_mixtral")
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, 4, 2, 8
zoo = load(f"{ROOT}/benchmarks/zoo/causal_lm.py", "autoplan_test_zoo_causal_lm")
dist.init_process_group("gloo")
ranks, rank = dist.get_world_size(), dist.get_rank()
for name, build, batch, loss_fn in (("mixtral", mixtral.build_model, mixtral.example_batch, mixtral.loss_fn),
                                    ("olmoe", zoo.olmoe, zoo.example_batch, None),
                                    ("qwen2_moe", zoo.qwen2_moe, zoo.example_batch, None)):
    torch.manual_seed(0)
    model = build()
    loss_fn = loss_fn or (lambda output, targets: torch.nn.functional.cross_entropy(
        output.logits.reshape(-1, output.logits.shape[-1]), targets.reshape(-1)))
    reference = copy.deepcopy(model)
    inputs, targets = batch(2 * ranks)
    expected = loss_fn(reference(**inputs), targets)
    expected.backward()
    shards = {fqn: shard_experts(module, dist.group.WORLD) for fqn, module in list(model.named_modules())
              if is_experts_module(module)}
    assert shards, name
    mine = slice(2 * rank, 2 * rank + 2)
    loss = loss_fn(model(**{k: v[mine] for k, v in inputs.items()}), targets[mine])
    loss.backward()
    dist.all_reduce(total := loss.detach().clone())
    torch.testing.assert_close(total / ranks, expected.detach(), rtol=1e-5, atol=1e-6, msg=name)
    wanted = dict(reference.named_parameters())
    for fqn, param in model.named_parameters():
        owner, want = fqn.rsplit(".", 1)[0], wanted[fqn].grad
        if owner in shards:
            shard = shards[owner]
            assert param.shape[0] == shard.local == shard.num_experts // ranks
            want = want[shard.first:shard.first + shard.local]
            grad = param.grad / ranks
        else:
            dist.all_reduce(grad := param.grad.clone())
            grad = grad / ranks
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=f"{name} {fqn}")
print("rank", rank, "matches")
# free the routed modules (their forwards hold the group) before the group goes, as train.py does: a gloo group
# torn down during interpreter exit can abort the process ("terminate called without an active exception")
del model, reference, shards, loss, expected
gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_moe_models_with_experts_sharded_and_tokens_routed_train_as_one_device(tmp_path, ranks):
    script = tmp_path / "routed.py"
    script.write_text(f"ROOT = {str(ROOT)!r}\n" + ROUTED)
    assert_every_rank_matches(script, ranks)


SHARDED = """
import copy
import gc
import importlib.util
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from autoplan.runtime.distributed.expert_parallel import parallelize_experts
from autoplan.layout import Parallelism

spec = importlib.util.spec_from_file_location("autoplan_test_mixtral", f"{ROOT}/examples/mixtral.py")
mixtral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixtral)
dist.init_process_group("gloo")
dp, rank, ep = dist.get_world_size(), dist.get_rank(), 2
for experts_count, fsdp_dim in ((4, 0), (2, 1)):  # E/ep = 2 experts split 2 ways (whole experts), or 1 (dim 1)
    (mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS,
     mixtral.EXPERTS, mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, experts_count, 2, 8
    torch.manual_seed(0)
    model = mixtral.build_model()
    reference = copy.deepcopy(model)
    inputs, targets = mixtral.example_batch(2 * dp)
    expected = mixtral.loss_fn(reference(**inputs), targets)
    expected.backward()
    experts = parallelize_experts(model, Parallelism(dp_shard=dp, ep=ep), "cpu")
    experts.fully_shard(model, reshard_after_forward=True)
    assert len(experts.modules) == 2
    mine = slice(2 * rank, 2 * rank + 2)  # this data-parallel rank's samples
    loss = mixtral.loss_fn(model(**{k: v[mine] for k, v in inputs.items()}), targets[mine])
    loss.backward()
    wanted = dict(reference.named_parameters())
    for fqn, param in model.named_parameters():
        want = wanted[fqn].grad
        if ".experts." in fqn:  # FSDP2 over the 2 ranks holding the same experts, inside the ep split
            placements = param.placements
            assert param.to_local().numel() * dp == param.numel(), (fqn, param.to_local().shape)
            assert placements[-1] == Shard(0) and placements[0].dim == fsdp_dim, (fqn, placements)
            grad = param.grad.full_tensor()
        else:  # data parallelism averages the rest over every rank
            dist.all_reduce(grad := param.grad.clone())
            grad = grad / dp
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=f"{experts_count} experts: {fqn}")
    del model, reference, experts, loss, expected  # before the groups go (see ROUTED)
    gc.collect()
print("rank", rank, "matches")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_experts_split_over_ep_and_fsdp_sharded_over_dp_over_ep_train_as_one_device(tmp_path):
    """dp=4 with ep=2: two ep groups of two ranks each split the experts, and FSDP2 shards each rank's experts
    over the 2 ranks holding the same ones (ExpertParallel.fully_shard: whole experts with 4 experts, dimension 1
    with 2), its reduce-scatter dividing by dp: every expert gradient is one device's."""
    script = tmp_path / "sharded.py"
    script.write_text(f"ROOT = {str(ROOT)!r}\n" + SHARDED)
    assert_every_rank_matches(script, 4)


def test_experts_modules_are_told_from_routers_and_plain_mlps():
    import importlib.util

    from autoplan.runtime.distributed.expert_parallel import is_experts_module

    spec = importlib.util.spec_from_file_location("autoplan_test_mixtral_find", ROOT / "examples" / "mixtral.py")
    mixtral = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mixtral)
    model = mixtral.build_model(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    found = [name for name, module in model.named_modules() if is_experts_module(module)]
    assert found == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]  # not the routers (mlp.gate)


def _grouped_matmul_dtypes(model, inputs):
    """The operand dtypes of every matmul the model's forward and backward run (grouped or per expert)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if "grouped_mm" in name or name.split(".")[0] in ("mm", "bmm", "addmm"):
                seen.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    with Record(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs).logits.float().sum().backward()
    return seen


def test_experts_compute_in_the_plans_dtype_under_autocast_without_expert_parallelism():
    """autocast casts torch.mm but not torch._grouped_mm, so transformers casts the tokens to the fp32 expert weights
    and the experts ran in fp32 on a GPU (measured by gpu_check's moe step: fp32 GEMM kernels, 6.7x the priced
    time). parallelize_experts at ep=1 in bf16 casts the experts' weights as autocast casts a Linear's: every
    matmul then takes bf16 operands, and the gradients still reach the fp32 parameters."""
    import importlib.util

    import torch
    from torch import nn

    from autoplan.layout import Parallelism
    from autoplan.runtime.distributed.expert_parallel import parallelize_experts

    spec = importlib.util.spec_from_file_location("autoplan_test_zoo_dtype", ROOT / "benchmarks" / "zoo" / "causal_lm.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    torch.manual_seed(0)
    model = zoo.qwen2_moe()
    inputs, _ = zoo.example_batch(2)
    before = [d for name, d in _grouped_matmul_dtypes(model, inputs) if torch.float32 in d]
    assert before, "the experts' matmuls ran in bf16 without the cast: the test no longer shows the fault"
    model.zero_grad(set_to_none=True)
    parallelize_experts(nn.ModuleList([model]), Parallelism(), "cpu", dtype=torch.bfloat16)
    after = _grouped_matmul_dtypes(model, inputs)
    assert after and all(torch.float32 not in d for _, d in after), [x for x in after if torch.float32 in x[1]]
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
                           for p in experts)
