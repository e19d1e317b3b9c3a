"""Expert parallelism in the generated program (issue 19): train.py with ep=2 on 2 ranks (FSDP2 over both, the
experts split over them) and dp=4 x ep=2 on 4 ranks (FSDP2 over the four, the experts split over pairs and
replicated over 2; and HSDP dp_replicate 2 x dp_shard 2 with ep=2) trains like the single-device model, on a
tiny examples/mixtral.py (grouped-matmul experts) and on HF OLMoE and Qwen2-MoE (a shared expert) from config
(benchmarks/zoo/causal_lm.py); inside pipeline stages (pp=2 x dp=2, ep=2 over each stage's 2 data-parallel ranks,
FSDP2 zero=3) on Mixtral (gpipe) and Qwen2-MoE (1f1b); a dp=4 x ep=2 checkpoint and a pp=2 x dp=2 x ep=2 one
(torch.distributed.checkpoint, the experts as DTensors sharded over the ep ranks) resume into the uninterrupted
run. Plans written as tests/test_layouts.py writes them, and two planned by the search with ep pinned (autoplan
MODEL.py --gpu cpu --pin ep=2, and --pin ep=2,pp=2). One 4-process torchrun launch (tests/helpers/verify_many.py)."""

import json
from pathlib import Path

import pytest

from autoplan.api import plan_model
from torch.distributed.checkpoint import FileSystemReader

from helpers.verify_many import BatchJob, verify_many
from test_layouts import check_parity, check_resumed, mb, resume_jobs, write_case

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
CHAIN = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
MIXTRAL = f'''
"""examples/mixtral.py shrunk: 4 experts (top-2), 2 layers, width 16, sequence 8."""
import importlib.util

spec = importlib.util.spec_from_file_location("autoplan_ep_mixtral", "{ROOT}/examples/mixtral.py")
mixtral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixtral)
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, 4, 2, 8
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


SOURCES = {"mixtral": MIXTRAL, "olmoe": zoo_source("olmoe"), "qwen2_moe": zoo_source("qwen2_moe")}
EP_LAYOUTS = {
    ("mixtral", "ep=2"): dict(data_parallel_shard_degree=2, fsdp_reshard_after_forward="always",
                              expert_parallel_degree=2, **mb(1, 4)),
    ("mixtral", "dp=4,zero=3,ep=2"): dict(data_parallel_shard_degree=4, fsdp_reshard_after_forward="always",
                                          expert_parallel_degree=2, **mb(1, 2)),
    ("olmoe", "ep=2, 2 accumulated micro-batches"): dict(data_parallel_shard_degree=2, expert_parallel_degree=2,
                                                         **mb(2, 2)),
    ("olmoe", "dp=4,zero=3,ep=2"): dict(data_parallel_shard_degree=4, fsdp_reshard_after_forward="always",
                                        expert_parallel_degree=2, **mb(1, 2)),
    ("qwen2_moe", "ep=2,recompute=full"): dict(data_parallel_shard_degree=2, expert_parallel_degree=2,
                                               activation_checkpoint="full", **mb(1, 4)),
    ("qwen2_moe", "hsdp dp_replicate=2 x dp_shard=2,ep=2"): dict(
        data_parallel_replicate_degree=2, data_parallel_shard_degree=2, fsdp_reshard_after_forward="always",
        expert_parallel_degree=2, **mb(1, 2)),
    ("mixtral", "pp=2,gpipe,dp=2,zero=3,ep=2"): dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="gpipe",
                                                     data_parallel_shard_degree=2, fsdp_reshard_after_forward="always",
                                                     expert_parallel_degree=2, **mb(2, 2)),
    ("qwen2_moe", "pp=2,1f1b,dp=2,zero=3,ep=2"): dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="1f1b",
                                                      data_parallel_shard_degree=2,
                                                      fsdp_reshard_after_forward="always", expert_parallel_degree=2,
                                                      **mb(2, 2)),
}
STAGES = {1: [CHAIN], 2: [CHAIN[:2], CHAIN[2:]]}
"""The pipeline stages of a layout by its pipeline degree (one expert layer on each of 2 stages)."""
RESUMED = ("mixtral", "dp=4,zero=3,ep=2")
PIPELINED = ("mixtral", "pp=2,gpipe,dp=2,zero=3,ep=2")
"""Resumed from a checkpoint too, and inspected: each stage's ranks hold their halves of its experts."""
INSPECT = '''
"""On an expert-parallel plan's ranks: the shape of each expert parameter of the stages the rank holds (global, and
this rank's local tensor) and whether its local tensor holds its experts of the single-device model's initial
values, by the model's name; rank 0 writes JSON."""
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
    source = train.load_source(f"{train.MODEL_FILE}:{train.FACTORY}")
    config, device = train.parallel_config(False), torch.device("cpu")
    parallel = train.build_parallel_model(source, config, autoplan.init_mesh(config, device), device)
    full = dict(train.runtime.build_seeded(source, train.SEED).named_parameters())
    found = {}
    for s, part in parallel.parts.items():
        fqns = parallel.split.state_fqns[s] if parallel.split is not None else None
        for stage_name, param in part.named_parameters():
            name = stage_name if fqns is None else fqns[stage_name]
            if ".experts." not in name:
                continue
            local = param.to_local()
            first = parallel.rank.dp_rank % config.ep * local.shape[0]
            found[name] = {"global": list(param.shape), "local": list(local.shape),
                           "values": torch.equal(local, full[name][first:first + local.shape[0]])}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
'''
"""Run as an extra job on the RESUMED and PIPELINED plans' 4 ranks."""
PINNED = {("mixtral", "pin ep=2"): ("ep=2", 2), ("mixtral", "pin ep=2,pp=2"): ("ep=2,pp=2", 4)}
"""Planned by the search: pins and GPUs (with pp=2 it cuts 2 x 2 interleaved stages, the experts modules chain
modules of their own, so that each pipeline rank holds one stage without experts and one with)."""


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    folders = {key: write_case(root, f"{key[0]} {key[1]}", SOURCES[key[0]],
                               STAGES[layout.get("pipeline_parallel_degree", 1)], **layout)
               for key, layout in EP_LAYOUTS.items()}
    for (model, name), (pin, gpus) in PINNED.items():
        source = root / f"{model}_model.py"
        source.write_text(SOURCES[model])
        folders[model, name] = root / f"{model} {name}".replace(" ", "_").replace("=", "").replace(",", "_")
        plan_model(str(source), gpus, "cpu", global_batch=8, pin=pin, out=folders[model, name])
    keys = list(folders)
    inspect = root / "inspect_experts.py"
    inspect.write_text(INSPECT)
    shapes = [BatchJob(folders[key], (str(folders[key]), str(root / f"experts{i}.json")), 4, program=inspect)
              for i, key in enumerate((RESUMED, PIPELINED))]
    result = verify_many([folders[k] for k in keys], steps=STEPS, timeout_s=1500, nproc=4,
                         extra_jobs=[*resume_jobs(folders[RESUMED], 4, 0), *resume_jobs(folders[PIPELINED], 4, 3),
                                     *shapes])
    return dict(zip(keys, result.results)), result.extra_errors, folders, (root / "experts0.json",
                                                                          root / "experts1.json")


@pytest.mark.parametrize("key", [*EP_LAYOUTS, *PINNED], ids=lambda key: " ".join(key))
def test_expert_parallel_program_trains_like_the_single_device_model(batch, key):
    results, _, folders, _ = batch
    check_parity(results[key])
    assert "2-way expert parallel" in (folders[key] / "train.py").read_text()
    parallelism = json.loads((folders[key] / "plan.json").read_text())["parallelism"]
    assert parallelism["expert_parallel_degree"] == 2
    assert parallelism["pipeline_parallel_degree"] == (2 if "pp=2" in key[1] else 1)


@pytest.mark.parametrize("key", [RESUMED, PIPELINED], ids=lambda key: " ".join(key))
def test_an_expert_parallel_checkpoint_resumes_into_the_uninterrupted_run(batch, key):
    _, errors, folders, _ = batch
    failures = [e for e in errors[:6] if e]
    assert not failures, failures[0][-3000:]
    out = folders[key]
    check_resumed(out)
    saved = FileSystemReader(out / "checkpoints" / "step_2").read_metadata().state_dict_metadata
    # once, whole, in the halves of its ep group (a pipeline's stages are saved as stage<k>)
    name = "model.model" if key == RESUMED else "model.stage0.model"
    experts = saved[f"{name}.layers.0.mlp.experts.gate_up_proj"]
    assert list(experts.size) == [4, 64, 16] and sorted(c.offsets[0] for c in experts.chunks) == [0, 2]


def test_each_rank_of_a_pipeline_stage_holds_its_half_of_the_stages_experts(batch):
    _, errors, _, (_, found) = batch
    assert not errors[-1], errors[-1][-3000:]
    ranks = json.loads(found.read_text())  # ranks 0, 1: stage 0 (layer 0); ranks 2, 3: stage 1 (layer 1)
    for rank, layer in zip(ranks, (0, 0, 1, 1)):
        assert sorted(rank) == [f"model.layers.{layer}.mlp.experts.{name}" for name in ("down_proj", "gate_up_proj")]
        assert rank[f"model.layers.{layer}.mlp.experts.gate_up_proj"]["local"] == [2, 64, 16]
        assert all(entry["global"][0] == 4 and entry["values"] for entry in rank.values()), rank


def test_each_rank_holds_its_half_of_the_experts_with_the_single_device_values(batch):
    _, errors, _, (found, _) = batch
    assert not errors[-2], errors[-2][-3000:]
    ranks = json.loads(found.read_text())
    assert len(ranks) == 4 and all(len(rank) == 4 for rank in ranks)  # 2 layers x gate_up_proj, down_proj
    for rank in ranks:
        assert rank["model.layers.0.mlp.experts.gate_up_proj"]["global"] == [4, 64, 16]
        assert rank["model.layers.0.mlp.experts.gate_up_proj"]["local"] == [2, 64, 16]
        assert all(entry["values"] for entry in rank.values()), rank
