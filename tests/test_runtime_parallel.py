"""autoplan.runtime pieces in one process: the batch driver's schedule, data from make_dataloader,
meta-device build and materialization (ties kept, values equal to the single-device build),
the pipeline split of a meta model, Linears restored for tensor parallelism, selective
recomputation, mixed-precision output casting."""

import copy
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import fx, nn

from autoplan.errors import UserError
from autoplan.layout import Parallelism
from autoplan.runtime import (ModelPart, TrainingData, build_on_meta, catalog, checkpoint_modules, compute_dtype,
                              materialize, restore_linears, split_model, step_batch)
from autoplan.runtime.distributed.recompute import _save_matmuls, saved_ops
from autoplan.runtime.distributed.steps import CastOutputs
from autoplan.contract import load_source
from helpers.batch import placements
from test_runtime import load_example, run_stages

GPT_UNITS = [("wte", "wpe", "blocks.0"), ("blocks.1", "ln_f", "lm_head")]


def test_batch_schedule_packs_jobs_into_rank_windows():
    # 8 ranks: the 8-rank job first, then two 4-rank jobs side by side, the 1-rank jobs fill in
    assert placements([8, 4, 4, 1, 1, 2], 8) == [0, 0, 4, 0, 1, 2]
    # a job that must follow another runs on its ranks, even if others are free
    assert placements([2, 2, 2], 4, [None, None, 1]) == [0, 2, 2]
    with pytest.raises(ValueError, match="does not fit"):
        placements([16], 8)
    with pytest.raises(ValueError, match="cannot follow"):
        placements([2, 4], 4, [None, 0])


def test_a_later_batch_job_computes_on_its_own_device_mesh(tmp_path):
    """Two jobs on one rank, one after the other: the second job's DTensor results name its own
    mesh's process groups, not those of an equal mesh the first job built and destroyed (run_job forgets
    DTensor's cached meshes between jobs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from helpers.batch import _forget_device_meshes

    outputs = []
    for job in range(2):
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / f"store{job}"), 1), rank=0,
                                world_size=1, timeout=timedelta(seconds=30))
        try:
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
            out = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]) * 2
            outputs.append((mesh, out.device_mesh))
        finally:
            dist.destroy_process_group()
            _forget_device_meshes()
    (first, first_out), (second, second_out) = outputs
    assert first == second and first is not second  # equal meshes, each naming its own job's groups
    assert first_out is first and second_out is second


def loader_source(batch_size_argument: bool):
    data = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(12, 1), torch.arange(12))

    def make_dataloader(rank, world_size, batch_size=3):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        return torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler)

    def without_batch_size(rank, world_size):
        return make_dataloader(rank, world_size)

    loader = make_dataloader if batch_size_argument else without_batch_size
    return SimpleNamespace(module=SimpleNamespace(make_dataloader=loader), example_batch=None)


def test_make_dataloader_shards_like_a_distributed_sampler_across_epochs():
    source = loader_source(batch_size_argument=True)
    ranks = [TrainingData(source, global_batch=6, seed=0, dp_rank=r, dp=2) for r in range(2)]
    reference = TrainingData(source, global_batch=6, seed=0, dp_rank=0, dp=2)
    seen = []
    for step in range(4):  # 6 samples per rank per epoch, 3 per step: steps 2 and 3 are epoch 1
        parts = [data.batch(step) for data in ranks]
        inputs, targets = reference.global_batch_of(step)
        assert torch.equal(inputs, torch.cat([p[0] for p in parts])) and torch.equal(targets, torch.cat([p[1] for p in parts]))
        seen.append(sorted(targets.tolist()))
    assert sorted(seen[0] + seen[1]) == list(range(12)) == sorted(seen[2] + seen[3])  # each epoch sees all data
    assert seen[:2] != seen[2:]  # set_epoch reshuffles
    with pytest.raises(UserError, match="asked for step 1 after step 3"):
        ranks[0].batch(1)


def test_make_dataloader_batch_size_must_match_the_plan():
    data = TrainingData(loader_source(batch_size_argument=False), global_batch=8, seed=0, dp_rank=0, dp=2)
    with pytest.raises(UserError, match=r"gave 3 samples per batch, .* global batch 8 / 2 data-parallel ranks = 4"):
        data.batch(0)


def test_synthetic_data_is_the_global_batch_sliced():
    def example_batch(n):
        return torch.randn(n, 2), torch.randn(n)

    source = SimpleNamespace(module=SimpleNamespace(), example_batch=example_batch)
    inputs, _ = TrainingData(source, global_batch=8, seed=1, dp_rank=1, dp=4).batch(3)
    assert torch.equal(inputs, step_batch(example_batch, 8, 1, 3)[0][2:4])


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def gpt_source(tmp_path: Path):
    model_file = tmp_path / "gpt_model.py"
    model_file.write_text(
        "import importlib.util, torch\n"
        f"spec = importlib.util.spec_from_file_location('g', {str(Path(__file__).parents[1] / 'examples' / 'gpt.py')!r})\n"
        "gpt = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpt)\n"
        "def build_model():\n    return gpt.GPT(vocab=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)\n"
        "def example_batch(n):\n    idx = torch.randint(0, 64, (n, 9))\n    return idx[:, :-1], idx[:, 1:]\n")
    return load_source(str(model_file))


def test_meta_build_materializes_to_the_single_device_values_with_ties_kept(tmp_path, one_rank_group):
    source = gpt_source(tmp_path)
    model = build_on_meta(source)
    assert all(p.is_meta for p in model.parameters())
    entries = catalog(model)
    tied = next(e for e in entries if len(e.fqns) > 1)
    assert tied.fqns == ("wte.weight", "lm_head.weight")
    materialize([ModelPart(model)], entries, source, seed=5, device=torch.device("cpu"))
    assert model.lm_head.weight is model.wte.weight  # to_empty alone would untie them
    torch.manual_seed(5)
    expected = source.build_model()
    for (name, value), (_, want) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(value, want), name


TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"  # MultiheadAttention; forward makes a mask with no device
DEVICE_BRANCH = Path(__file__).parent / "models" / "device_branch.py"  # forward branches on the device type


@pytest.mark.parametrize("model_file, chain_modules", [
    (None, GPT_UNITS), (TINY_GPT, [("tok", "h.0", "h.1"), ("h.2", "h.3", "norm", "head")]),
    (DEVICE_BRANCH, [("a",), ("b",)])])
def test_a_meta_model_splits_into_stages_that_run_on_the_real_device(tmp_path, one_rank_group, model_file,
                                                                     chain_modules):
    source = load_source(str(model_file)) if model_file else gpt_source(tmp_path)
    model = build_on_meta(source)
    entries = catalog(model)
    idx = source.example_batch(2)[0]
    split = split_model(model, idx.to("meta"), chain_modules, torch.device("cpu"))
    for stage in split.stages:  # no op still creates tensors on meta
        for node in stage.graph.nodes:
            assert torch.device("meta") not in [*node.args, *node.kwargs.values()], node.format_node()
    parts = [ModelPart(stage, fqns) for stage, fqns in zip(split.stages, split.state_fqns)]
    materialize(parts, entries, source, seed=5, device=torch.device("cpu"))
    torch.manual_seed(5)
    expected = source.build_model()(idx)
    torch.testing.assert_close(split.unflatten_output(run_stages(split, idx)), expected, rtol=0, atol=1e-6)


def test_planned_linears_are_restored_as_modules_in_an_exported_stage():
    torch.manual_seed(0)
    model = load_example("gpt").GPT(vocab=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 8))
    split = split_model(model, idx, GPT_UNITS)
    stage = split.stages[1]
    restored = restore_linears(stage, {"blocks.1.attn.qkv", "blocks.1.mlp.proj", "blocks.0.mlp.fc"})
    assert restored == {"blocks.1.attn.qkv", "blocks.1.mlp.proj"}  # blocks.0 runs on stage 0
    linear = stage.get_submodule("blocks.1.attn.qkv")
    assert isinstance(linear, nn.Linear) and linear.weight is model.blocks[1].attn.qkv.weight
    calls = [n.target for n in stage.get_submodule("blocks.1").graph.nodes if n.op == "call_module"]
    assert calls == ["attn.qkv", "mlp.proj"]
    torch.testing.assert_close(split.unflatten_output(run_stages(split, idx)), reference(idx), rtol=0, atol=1e-6)
    # in one stage the tied lm_head weight is read by two chain modules: not a plain Linear, left alone
    (whole,) = split_model(model, idx, [tuple(u for stage in GPT_UNITS for u in stage)]).stages
    assert restore_linears(whole, {"lm_head", "blocks.0.mlp.fc"}) == {"blocks.0.mlp.fc"}


def test_a_chain_module_that_is_itself_a_planned_linear_becomes_the_linear_the_stage_calls():
    # the solver's chain cuts small models finer than blocks: each attention Linear is a chain module
    torch.manual_seed(0)
    model = load_example("gpt").GPT(vocab=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 8))
    fine = ("wte", "wpe", "blocks.0.ln_1", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.ln_2", "blocks.0.mlp")
    split = split_model(model, idx, [fine, ("blocks.1", "ln_f", "lm_head")])
    stage = split.stages[0]
    planned = {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"}
    assert restore_linears(stage, planned) == planned
    for fqn in planned:
        linear = stage.get_submodule(fqn)
        assert isinstance(linear, nn.Linear) and linear.weight is model.get_parameter(f"{fqn}.weight")
    calls = [n.target for n in stage.graph.nodes if n.op == "call_module"]
    assert calls == list(fine)  # the Linears are called where their chain modules were, with their result
    assert set(dict(stage.named_parameters())) == set(split.state_fqns[0])  # names unchanged
    torch.testing.assert_close(split.unflatten_output(run_stages(split, idx)), reference(idx), rtol=0, atol=1e-6)


def test_selective_recompute_keeps_matmuls_and_gives_the_same_gradients():
    from torch.utils.checkpoint import CheckpointPolicy

    saved = saved_ops()
    assert torch.ops.aten.mm.default in saved and torch.ops.aten.addmm.default in saved
    assert _save_matmuls(saved, None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _save_matmuls(saved, None, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    torch.manual_seed(0)
    model = load_example("gpt").GPT(vocab=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 8))
    checkpoint_modules(model, ["blocks.0", "blocks.1"], "selective")
    assert type(model.blocks[0]).__name__ == "CheckpointWrapper"
    model(idx).square().mean().backward()
    reference(idx).square().mean().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    with pytest.raises(UserError, match="activation_checkpoint must be one of"):
        checkpoint_modules(model, [], "some")


def test_mixed_precision_stage_outputs_keep_the_pipeline_dtypes():
    stage = CastOutputs(nn.Linear(4, 4), (torch.float32,), torch.bfloat16, torch.device("cpu"))
    assert stage(torch.randn(2, 4)).dtype == torch.float32
    assert compute_dtype("bf16", torch.device("cuda")) == torch.bfloat16
    assert compute_dtype("bf16", torch.device("cpu")) == torch.float32


def test_a_graph_module_stage_is_what_tensor_parallel_sees():
    torch.manual_seed(0)
    model = load_example("gpt").GPT(vocab=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
    split = split_model(model, torch.randint(0, 64, (2, 8)), GPT_UNITS)
    assert all(isinstance(stage, fx.GraphModule) for stage in split.stages)
    assert split.state_fqns[1]["lm_head.weight"] == "wte.weight"  # the tied copy maps to the model's tensor


def test_mixed_precision_accumulation_computes_in_bf16_and_the_loss_in_fp32():
    from autoplan.runtime import AccumulationStep, default_loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    seen = []
    model[2].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    loss = AccumulationStep(model, Parallelism(microbatches=2), loss_fn=None, dtype=torch.bfloat16)(x, y)
    default_loss(reference(x), y).backward()
    assert seen == [torch.bfloat16] * 2 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, default_loss(reference(x), y).detach(), rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32  # master weights and gradients stay fp32
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-1, atol=2e-2)


def test_a_loss_that_cannot_run_on_vocabulary_sharded_logits_runs_on_gathered_ones(tmp_path, capsys):
    """ParallelLoss: the default cross-entropy runs on logits sharded on the vocabulary (loss_parallel); a
    loss_fn that loss_parallel rejects (a log-softmax over the sequence) runs on the gathered logits from
    then on, and says so once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn import functional as F

    from autoplan.runtime.distributed.tensor_parallel import ParallelLoss, loss_parallel_context, plain_tensor
    from helpers.batch import _forget_device_meshes

    def over_the_sequence(output, targets):
        return -F.log_softmax(output, dim=1).mean()

    logits, targets = torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        default, odd = ParallelLoss(None), ParallelLoss(over_the_sequence)
        with loss_parallel_context(True):
            sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
            value = default(sharded, targets)
            value.backward()
            assert default.sharded and "gathering" not in capsys.readouterr().out
            assert plain_tensor(value).item() == pytest.approx(F.cross_entropy(logits.reshape(-1, 8),
                                                                                 targets.reshape(-1)).item())
            sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
            value = odd(sharded, targets)
            value.backward()
        assert not odd.sharded and "gathering the logits instead" in capsys.readouterr().out
        assert plain_tensor(value).item() == pytest.approx(over_the_sequence(logits, targets).item())
        assert sharded.grad is not None
    finally:
        dist.destroy_process_group()
        _forget_device_meshes()


def test_tied_copies_sum_their_gradients_and_an_unused_copy_counts_zero():
    """TiedGradients on one rank: the copies' gradients summed into every copy; a copy its stage did not use this
    step (grad None) takes part with zeros instead of failing the step."""
    from autoplan.runtime.distributed.parallel import TiedGradients

    used, other, unused = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    used.grad, other.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 0.5])
    tied = TiedGradients(None, None, {}, None)
    tied.tied.append(([used, other, unused], None))
    tied.sum_gradients()
    for copy in (used, other, unused):
        assert torch.equal(copy.grad, torch.tensor([1.5, 2.5, 3.5]))
