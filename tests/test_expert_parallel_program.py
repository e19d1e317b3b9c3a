"""Expert parallelism in the generated program (issue 19): train.py with ep=2 on 2 ranks (FSDP2 over both, the
experts split over them) and dp=4 x ep=2 on 4 ranks (FSDP2 over the four, the experts split over pairs and
FSDP2-sharded over the 2 ranks holding the same ones: whole experts with 4, dimension 1 with 2 experts; and HSDP
dp_replicate 2 x dp_shard 2 with ep=2, the experts replicated over dp_replicate; and dp=2 x ep=2 x tp=2, ep folded
over the tp ranks, with and without sequence parallelism) trains like the single-device model, on a
tiny examples/mixtral.py (grouped-matmul experts) and on HF OLMoE and Qwen2-MoE (a shared expert) from config
(benchmarks/zoo/causal_lm.py); a dp=4 x ep=2 checkpoint (torch.distributed.checkpoint, the experts as DTensors
sharded over the ep ranks and over FSDP2's) resumes into the uninterrupted run. Plans written as
tests/test_layouts.py writes them, and planned by the search with ep pinned (autoplan MODEL.py --gpu cpu --pin
ep=2; its chain modules include the experts modules themselves). One 4-process torchrun launch
(tests/helpers/verify_many.py). With tp, every gradient is also compared with the single-device model's (AdamW's
update does not see a gradient's scale, the loss parity alone would miss a wrong sum over tp)."""

import json
import math
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from torch.distributed.checkpoint import FileSystemReader

from helpers.verify_many import BatchJob, verify_many
from test_layouts import check_parity, check_resumed, mb, resume_jobs, write_case

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
CHAIN = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
MIXTRAL = '''
"""examples/mixtral.py shrunk: {experts} experts (top-2), 2 layers, width 16, sequence 8."""
import importlib.util

spec = importlib.util.spec_from_file_location("autoplan_ep_mixtral", "{root}/examples/mixtral.py")
mixtral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixtral)
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, {experts}, 2, 8
build_model, example_batch, loss_fn = mixtral.build_model, mixtral.example_batch, mixtral.loss_fn
'''


def zoo_source(factory: str) -> str:
    return f'''
"""benchmarks/zoo/causal_lm.py's {factory}() (tiny, from config)."""
import importlib.util

spec = importlib.util.spec_from_file_location("autoplan_ep_zoo", "{ROOT}/benchmarks/zoo/causal_lm.py")
zoo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zoo)
build_model, example_batch = zoo.{factory}, zoo.example_batch
'''


SOURCES = {"mixtral": MIXTRAL.format(root=ROOT, experts=4), "mixtral_2_experts": MIXTRAL.format(root=ROOT, experts=2),
           "olmoe": zoo_source("olmoe"), "qwen2_moe": zoo_source("qwen2_moe")}
EP_LAYOUTS = {
    ("mixtral", "ep=2"): dict(dp_shard=2, reshard=True,
                              ep=2, **mb(1, 4)),
    ("mixtral", "dp=4,zero=3,ep=2"): dict(dp_shard=4, reshard=True,
                                          ep=2, **mb(1, 2)),
    ("mixtral_2_experts", "dp=4,zero=3,ep=2"): dict(dp_shard=4, reshard=True,
                                                    ep=2, **mb(1, 2)),
    ("olmoe", "ep=2, 2 accumulated micro-batches"): dict(dp_shard=2, ep=2,
                                                         **mb(2, 2)),
    ("olmoe", "dp=4,zero=3,ep=2"): dict(dp_shard=4, reshard=True,
                                        ep=2, **mb(1, 2)),
    ("qwen2_moe", "ep=2,recompute=full"): dict(dp_shard=2, ep=2,
                                               recompute="full", **mb(1, 4)),
    # selective recompute keeps the all-to-alls' outputs and reruns the grouped expert matmuls inside the
    # checkpointed block
    ("qwen2_moe", "ep=2,recompute=selective"): dict(dp_shard=2, ep=2,
                                                    recompute="selective", **mb(1, 4)),
    ("qwen2_moe", "hsdp dp_replicate=2 x dp_shard=2,ep=2"): dict(
        dp_replicate=2, dp_shard=2, reshard=True,
        ep=2, **mb(1, 2)),
    ("mixtral", "pp=2,gpipe,dp=2,zero=3,ep=2"): dict(pp=2, schedule="gpipe",
                                                     dp_shard=2, reshard=True,
                                                     ep=2, **mb(2, 2)),
    ("qwen2_moe", "pp=2,1f1b,dp=2,zero=3,ep=2"): dict(pp=2, schedule="1f1b",
                                                      dp_shard=2,
                                                      reshard=True, ep=2,
                                                      **mb(2, 2)),
}
ATTENTION_TP_PLAN = {f"model.layers.{i}.self_attn.{p}_proj": "rowwise" if p == "o" else "colwise"
                     for i in range(2) for p in "qkvo"} | {"model.embed_tokens": "rowwise", "lm_head": "colwise"}
"""Tensor parallelism for the attention and the vocabulary (the experts are left out: each stays whole, ETP 1, and ep
is folded over the tp ranks)."""
SHARED_EXPERT_TP_PLAN = ATTENTION_TP_PLAN | {f"model.layers.{i}.mlp.shared_expert.{p}_proj": "rowwise" if p == "down"
                                             else "colwise" for i in range(2) for p in ("gate", "up", "down")}
EP_TP_LAYOUTS = {
    ("qwen2_moe", "dp=2,zero=3,ep=2,tp=2"): (SHARED_EXPERT_TP_PLAN, dict(
        dp_shard=2, reshard=True, ep=2,
        tp=2, sp=False, **mb(1, 4))),
    # sp=on with a hand-written plan that leaves out the "sequence_local" MoE blocks the search now adds
    # (tests/test_moe_sequence_parallel.py): the router runs on DTensors and each tp rank routes its share of the
    # tokens (TensorParallelTokens)
    ("mixtral", "dp=2,zero=1,ep=2,tp=2,sp=on"): (ATTENTION_TP_PLAN, dict(
        dp_shard=2, ep=2, tp=2,
        sp=True, **mb(2, 2))),
}
GRADIENTS = f'''
"""dp_shard 2 x ep 2 x tp 2 with sequence parallelism on or off (argv[0]): every gradient after one forward_backward
of a tiny examples/mixtral.py against the single-device model's (the expert gradients gathered over the ep and FSDP2
ranks); rank 0 writes the largest difference per parameter (argv[1]). AdamW's update is blind to a gradient's
scale, so a wrongly summed or divided expert gradient would pass the loss parity: this checks it."""
import copy
import gc
import json
import importlib.util

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoplan
from autoplan.layout import Parallelism
from autoplan.runtime.distributed.config import ParallelConfig

spec = importlib.util.spec_from_file_location("autoplan_ep_mixtral_grads", "{ROOT}/examples/mixtral.py")
mixtral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixtral)
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, 4, 2, 8
CHAIN = {CHAIN!r}
TP_PLAN = {ATTENTION_TP_PLAN!r}


def main(argv):
    torch.manual_seed(0)
    model = mixtral.build_model()
    reference = copy.deepcopy(model)
    inputs, targets = mixtral.example_batch(8)
    mixtral.loss_fn(reference(**inputs), targets).backward()
    layout = Parallelism(dp_shard=2, reshard=True, tp=2, ep=2, sp=argv[0] == "on", microbatch=4)
    config = ParallelConfig(layout, stages=(CHAIN,), tensor_parallel_plan=TP_PLAN)
    parallel = autoplan.parallelize(model, config, device="cpu", loss_fn=mixtral.loss_fn, example_inputs=inputs)
    parallel.forward_backward(*parallel.shard_batch(inputs, targets))
    expected, found = dict(reference.named_parameters()), {{}}
    for name, param in parallel.model.named_parameters():
        grad, want = param.grad, expected[name].grad
        if isinstance(grad, DTensor):  # the experts: ep over the tp pairs, FSDP2 over the 2 data-parallel ranks
            grad = grad.full_tensor()
        found[name] = [(grad - want).abs().max().item(), want.abs().max().item()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        with open(argv[1], "w") as out:
            json.dump(gathered, out)
    del parallel, model
    gc.collect()
'''
"""Run as extra jobs (sequence parallelism on and off) on 4 ranks."""
STAGES = {1: [CHAIN], 2: [CHAIN[:2], CHAIN[2:]]}
"""The pipeline stages of a layout by its pipeline degree (one expert layer on each of 2 stages)."""
RESUMED = ("mixtral", "dp=4,zero=3,ep=2")
RESUMED_WITH_TP = ("qwen2_moe", "dp=2,zero=3,ep=2,tp=2")
PIPELINED = ("mixtral", "pp=2,gpipe,dp=2,zero=3,ep=2")
"""Resumed from a checkpoint too, and inspected: each stage's ranks hold their halves of its experts."""
INSPECT = '''
"""On an expert-parallel plan's ranks: the shape of each expert parameter of the stages the rank holds (global, and
this rank's local tensor) and whether, gathered, it holds the single-device model's initial values, by the model's
name; rank 0 writes JSON."""
import importlib.util
import json
from pathlib import Path

import torch
import torch.distributed as dist

import autoplan


def main(argv):
    folder, out = Path(argv[0]), Path(argv[1])
    spec = importlib.util.spec_from_file_location("autoplan_ep_train", folder / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    source = train.runtime.load_source(f"{train.MODEL_FILE}:{train.FACTORY}")
    config, device = train.parallel_config(False), torch.device("cpu")
    parallel = train.build_parallel_model(source, config, autoplan.init_mesh(config, device), device)
    full = dict(train.runtime.build_seeded(source, train.SEED).named_parameters())
    found = {}
    for s, part in parallel.parts.items():
        fqns = parallel.split.state_fqns[s] if parallel.split is not None else None
        for stage_name, param in part.named_parameters():
            name = stage_name if fqns is None else fqns[stage_name]
            if ".experts." in name:
                found[name] = {"global": list(param.shape), "local": list(param.to_local().shape),
                               "values": torch.equal(param.full_tensor(), full[name])}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
'''
"""Run as an extra job on the RESUMED and PIPELINED plans' 4 ranks."""
PINNED = {("mixtral", "pin ep=2"): ("ep=2", 2), ("mixtral", "pin dp=2,ep=2,tp=2"): ("dp=2,ep=2,tp=2", 4),
          ("olmoe", "pin dp=2,ep=2,tp=2"): ("dp=2,ep=2,tp=2", 4), ("mixtral", "pin ep=2,pp=2"): ("ep=2,pp=2", 4)}
"""Planned by the search: pins and GPUs (with pp=2 it cuts 2 x 2 interleaved stages, the experts modules chain
modules of their own, so that each pipeline rank holds one stage without experts and one with)."""


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    folders = {key: write_case(root, f"{key[0]} {key[1]}", SOURCES[key[0]],
                               STAGES[layout.get("pp", 1)], **layout)
               for key, layout in EP_LAYOUTS.items()}
    folders.update({key: write_case(root, f"{key[0]} {key[1]}", SOURCES[key[0]], [CHAIN], plan, **layout)
                    for key, (plan, layout) in EP_TP_LAYOUTS.items()})
    for (model, name), (pin, gpus) in PINNED.items():
        source = root / f"{model}_model.py"
        source.write_text(SOURCES[model])
        folders[model, name] = root / f"{model} {name}".replace(" ", "_").replace("=", "").replace(",", "_")
        plan_model(str(source), gpus, "cpu", PlanOptions(global_batch=8, pin=pin, out=folders[model, name]))
    keys = list(folders)
    inspect = root / "inspect_experts.py"
    inspect.write_text(INSPECT)
    shapes = [BatchJob(folders[key], (str(folders[key]), str(root / f"experts{i}.json")), 4, program=inspect)
              for i, key in enumerate((RESUMED, PIPELINED))]
    gradients = root / "expert_gradients.py"
    gradients.write_text(GRADIENTS)
    gradient_jobs = [BatchJob(root, (sp, str(root / f"gradients_sp_{sp}.json")), 4, program=gradients)
                     for sp in ("on", "off")]
    result = verify_many([folders[k] for k in keys], steps=STEPS, timeout_s=1800, nproc=4,
                         extra_jobs=[*resume_jobs(folders[RESUMED], 4, 0), *resume_jobs(folders[PIPELINED], 4, 3),
                                     *shapes, *gradient_jobs, *resume_jobs(folders[RESUMED_WITH_TP], 4, 10)])
    return dict(zip(keys, result.results)), result.extra_errors, folders, root


@pytest.mark.parametrize("key", [*EP_LAYOUTS, *EP_TP_LAYOUTS, *PINNED], ids=lambda key: " ".join(key))
def test_expert_parallel_program_trains_like_the_single_device_model(batch, key):
    results, _, folders, _ = batch
    check_parity(results[key])
    assert "2-way expert parallel" in (folders[key] / "train.py").read_text()
    parallelism = json.loads((folders[key] / "plan.json").read_text())["parallelism"]
    assert parallelism["expert_parallel_degree"] == 2
    assert parallelism["pipeline_parallel_degree"] == (2 if "pp=2" in key[1] else 1)
    if key in PINNED:  # the search's choice of the unpinned degrees: any that fill the GPUs (ep folds over tp too)
        degrees = ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                   "context_parallel_degree", "pipeline_parallel_degree")
        assert math.prod(parallelism[d] for d in degrees) == PINNED[key][1]
        assert "tp=2" not in key[1] or parallelism["tensor_parallel_degree"] == 2
    else:
        assert parallelism["tensor_parallel_degree"] == (2 if "tp=2" in key[1] else 1)


@pytest.mark.parametrize("sp", ["on", "off"])
def test_with_tensor_parallelism_every_gradient_is_the_single_device_models(batch, sp):
    _, errors, _, root = batch
    error = errors[8 if sp == "on" else 9]
    assert not error, error[-3000:]
    ranks = json.loads((root / f"gradients_sp_{sp}.json").read_text())
    assert len(ranks) == 4 and all(len(rank) == 21 for rank in ranks)
    assert all(any(".experts." in name for name in rank) for rank in ranks)
    for rank in ranks:
        assert all(diff <= 1e-5 for diff, _ in rank.values()), rank  # a wrong sum over tp: ~5e-4 here


@pytest.mark.parametrize("key", [RESUMED, PIPELINED], ids=lambda key: " ".join(key))
def test_an_expert_parallel_checkpoint_resumes_into_the_uninterrupted_run(batch, key):
    _, errors, folders, _ = batch
    failures = [e for e in errors[:6] if e]
    assert not failures, failures[0][-3000:]
    out = folders[key]
    check_resumed(out)
    saved = FileSystemReader(out / "checkpoints" / "step_2").read_metadata().state_dict_metadata
    # once, whole, under the model's own names whatever the split (a pipeline's stage names mapped back): one expert
    # per rank with dp=4 (ep halves, FSDP2 over the 2 ranks holding each), halves with a pipeline (dp=2 per stage:
    # ep=2, nothing left for FSDP2 to split)
    experts = saved["model.model.layers.0.mlp.experts.gate_up_proj"]
    offsets = [0, 1, 2, 3] if key == RESUMED else [0, 2]
    assert list(experts.size) == [4, 64, 16] and sorted(c.offsets[0] for c in experts.chunks) == offsets


def test_each_rank_of_a_pipeline_stage_holds_its_half_of_the_stages_experts(batch):
    _, errors, _, root = batch
    assert not errors[7], errors[7][-3000:]
    ranks = json.loads((root / "experts1.json").read_text())  # ranks 0, 1: stage 0 (layer 0); 2, 3: stage 1 (layer 1)
    for rank, layer in zip(ranks, (0, 0, 1, 1)):
        assert sorted(rank) == [f"model.layers.{layer}.mlp.experts.{name}" for name in ("down_proj", "gate_up_proj")]
        assert rank[f"model.layers.{layer}.mlp.experts.gate_up_proj"]["local"] == [2, 64, 16]
        assert all(entry["global"][0] == 4 and entry["values"] for entry in rank.values()), rank


def test_an_expert_and_tensor_parallel_checkpoint_resumes_into_the_uninterrupted_run(batch):
    _, errors, folders, _ = batch
    failures = [e for e in errors[10:] if e]
    assert not failures, failures[0][-3000:]
    check_resumed(folders[RESUMED_WITH_TP])


def test_each_rank_holds_a_quarter_of_the_experts_with_the_single_device_values(batch):
    """ep=2 splits the 4 experts in halves, FSDP2 each half over the 2 ranks holding it: one expert per rank."""
    _, errors, _, root = batch
    assert not errors[6], errors[6][-3000:]
    ranks = json.loads((root / "experts0.json").read_text())
    assert len(ranks) == 4 and all(len(rank) == 4 for rank in ranks)  # 2 layers x gate_up_proj, down_proj
    for rank in ranks:
        assert rank["model.layers.0.mlp.experts.gate_up_proj"]["global"] == [4, 64, 16]
        assert rank["model.layers.0.mlp.experts.gate_up_proj"]["local"] == [1, 64, 16]
        assert all(entry["values"] for entry in rank.values()), rank
