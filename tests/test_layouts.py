"""Loss parity of every layout the solver can choose (tensor parallel as the search plans it: sequence
parallel, vocabulary-parallel embedding and head, loss parallel), on a GPT written from scratch
(examples/gpt.py, tied lm_head) and on a Hugging Face Llama from a config (examples/llama.py),
against the single-device reference; checkpoint save at step k + resume = an uninterrupted run;
a model with its own make_dataloader (DistributedSampler).

Process start-up costs more than these tiny models' training, so everything runs in ONE launch of 8
CPU processes (tests/helpers/verify_many.py): each generated train.py's main runs on the first
world-size ranks of a window, in a process group of its own; the idle ranks run other jobs.
Plans are built by hand (no solver) with chain modules as the module chain gives them.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.plan import Plan
from autoplan.verify import GRADIENT_TOLERANCE, PARITY_TOLERANCE
from helpers.plans import pinned_plan
from helpers.verify_many import BatchJob, verify_many

pytestmark = pytest.mark.slow  # one 8-process torchrun launch (~80 s on 2 cores)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 2

TINY_GPT = f'''
"""examples/gpt.py (tied lm_head, head count hard-coded in its views) at tiny sizes."""
import importlib.util
import torch

_spec = importlib.util.spec_from_file_location("autoplan_example_gpt", {str(EXAMPLES / "gpt.py")!r})
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
VOCAB, SEQ = 64, 8

def build_model():
    return gpt.GPT(vocab=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, n_embd=16)

def example_batch(batch_size):
    idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return idx[:, :-1], idx[:, 1:]

loss_fn = gpt.loss_fn
'''

TINY_LLAMA = f'''
"""examples/llama.py (HF LlamaForCausalLM from a LlamaConfig, grouped-query attention) at tiny sizes."""
import importlib.util

_spec = importlib.util.spec_from_file_location("autoplan_example_llama", {str(EXAMPLES / "llama.py")!r})
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.VOCAB, llama.HIDDEN, llama.INTERMEDIATE, llama.LAYERS, llama.HEADS, llama.KV_HEADS, llama.SEQ_LEN = (
    64, 16, 32, 2, 4, 2, 8)

build_model = llama.build_model
example_batch = llama.example_batch
loss_fn = llama.loss_fn
'''

SKIP_NET = '''
"""Dict inputs; h and the input `scale` skip from the first stage over the second one's chain modules."""
import torch
from torch import nn

class SkipNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x, scale):
        h = torch.tanh(self.embed(x))
        return self.head(self.mid(h) + h) * scale

def build_model():
    return SkipNet()

def example_batch(batch_size):
    return {"x": torch.randn(batch_size, 6), "scale": torch.rand(batch_size, 1) + 0.5}, torch.randn(batch_size, 3)
'''

LOADER_NET = '''
"""Its own data: make_dataloader shards a fixed dataset with a DistributedSampler."""
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

def build_model():
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))

def example_batch(batch_size):
    return torch.randn(batch_size, 5), torch.randn(batch_size, 2)

def make_dataloader(rank, world_size, batch_size):
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(40, 5, generator=generator), torch.randn(40, 2, generator=generator))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=1, drop_last=True)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
'''


@dataclass(frozen=True)
class ModelCase:
    source: str
    chain_modules: tuple[str, ...]
    """The module chain's chain modules in order."""
    four_stages: tuple[tuple[str, ...], ...]
    """The chain modules cut in four stages (pp=4, or pp=2 with 2 virtual stages)."""
    tensor_parallel_plan: dict[str, str]


def gpt_case() -> ModelCase:
    chain_modules = ("wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head")
    plan = {}
    for i in range(2):
        plan.update({f"blocks.{i}.attn.qkv": "colwise", f"blocks.{i}.attn.proj": "rowwise",
                     f"blocks.{i}.mlp.fc": "colwise", f"blocks.{i}.mlp.proj": "rowwise"})
    plan.update({"wte": "rowwise", "lm_head": "colwise"})  # vocabulary-parallel, tied
    four = (chain_modules[:2], chain_modules[2:3], chain_modules[3:4], chain_modules[4:])
    return ModelCase(TINY_GPT, chain_modules, four, plan)


def llama_case() -> ModelCase:
    chain_modules = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    plan = {}
    for i in range(2):
        layer = f"model.layers.{i}"
        plan.update({f"{layer}.self_attn.{p}_proj": "colwise" for p in "qkv"})
        plan.update({f"{layer}.self_attn.o_proj": "rowwise", f"{layer}.mlp.gate_proj": "colwise",
                     f"{layer}.mlp.up_proj": "colwise", f"{layer}.mlp.down_proj": "rowwise"})
    plan.update({"model.embed_tokens": "rowwise", "lm_head": "colwise"})  # vocabulary-parallel
    four = (chain_modules[:1], chain_modules[1:2], chain_modules[2:3], chain_modules[3:])
    return ModelCase(TINY_LLAMA, chain_modules, four, plan)


MODELS = {"gpt": gpt_case(), "llama": llama_case()}


def mb(count: int, size: int) -> dict:
    return dict(microbatches=count, microbatch=size)


# every layout of issue 5's list, then HSDP, ZeRO-1, DDP-style replication with TP and selective recompute
LAYOUTS = {
    "dp=4": dict(dp_replicate=4, **mb(1, 2)),
    "dp=4,zero=3": dict(dp_shard=4, reshard=True, **mb(1, 2)),
    "pp=4,gpipe": dict(pp=4, schedule="gpipe", **mb(4, 2)),
    "pp=4,1f1b": dict(pp=4, schedule="1f1b", **mb(4, 2)),
    "pp=2,interleaved": dict(pp=2, virtual_stages=2,
                             schedule="interleaved", **mb(4, 2)),
    "tp=2": dict(tp=2, **mb(2, 4)),
    "dp=2,pp=2": dict(dp_replicate=2, pp=2, **mb(2, 2)),
    "dp=2,zero=3,tp=2": dict(dp_shard=2, reshard=True, tp=2, **mb(1, 4)),
    "pp=2,tp=2": dict(pp=2, tp=2, **mb(4, 2)),
    "dp=2,pp=2,tp=2": dict(dp_replicate=2, pp=2, tp=2,
                           **mb(2, 2)),
    "pp=2,recompute=full": dict(pp=2, recompute="full", **mb(4, 2)),
}
EXTRA_LAYOUTS = {
    ("gpt", "hsdp=2x2"): dict(dp_replicate=2, dp_shard=2, reshard=True, **mb(1, 2)),
    ("llama", "dp=2,zero=1,recompute=selective"): dict(dp_shard=2,
                                                      recompute="selective", **mb(2, 2)),
    ("llama", "dp=2,tp=2,zero=0"): dict(dp_replicate=2, tp=2, **mb(1, 4)),
    ("gpt", "tp=2,recompute=selective"): dict(tp=2, recompute="selective", **mb(1, 8)),
    ("gpt", "dp=2,zero=3,pp=2,interleaved,recompute=full"): dict(
        dp_shard=2, reshard=True, pp=2, virtual_stages=2,
        schedule="interleaved", recompute="full", **mb(2, 2)),
}
OTHER_MODELS = {
    "skip net dict inputs pp=2,1f1b,recompute=full": (SKIP_NET, [("embed",), ("mid", "head")], dict(
        pp=2, recompute="full", **mb(4, 2))),
    "make_dataloader dp=2, 2 accumulated micro-batches": (LOADER_NET, [("0", "1", "2")], dict(
        dp_replicate=2, **mb(2, 2))),
}
RESUMED = [("llama", "dp=2,zero=3,tp=2"), ("gpt", "dp=2,pp=2")]
"""Layouts whose checkpoint (saved after step 2) must resume into the uninterrupted run's losses."""


def make_plan(model_file: Path, stages, tensor_parallel_plan=None, **parallelism) -> Plan:
    parallelism.setdefault("sp", parallelism.get("tp", 1) > 1)
    return pinned_plan(model_file, stages, tokens_per_sample=8, tensor_parallel_plan=tensor_parallel_plan,
                       **parallelism)


def write_case(root: Path, name: str, source: str, stages, tensor_parallel_plan=None, **parallelism) -> Path:
    folder = root / name.replace(",", "_").replace("=", "").replace(" ", "_")
    folder.mkdir(parents=True)
    model_file = folder / "user_model.py"
    model_file.write_text(source)
    plan = make_plan(model_file, stages, tensor_parallel_plan, **parallelism)
    write_program(plan, folder / "out", model_file)
    (folder / "out" / "plan.json").write_text(plan.to_json())
    return folder / "out"


def model_layout(root: Path, model: str, layout: str, parallelism: dict) -> Path:
    case = MODELS[model]
    pp = parallelism.get("pp", 1) * parallelism.get("virtual_stages", 1)
    half = len(case.chain_modules) // 2
    modules = case.chain_modules
    stages = {1: [modules], 2: [modules[:half], modules[half:]], 4: case.four_stages}[pp]
    return write_case(root, f"{model} {layout}", case.source, stages, case.tensor_parallel_plan, **parallelism)


def resume_jobs(out: Path, world: int, first: int) -> list[BatchJob]:
    """Uninterrupted 4 steps; 2 steps of the same 4-step schedule saving a checkpoint; resume to step 4 on the same
    ranks."""
    common = ("--device", "cpu", "--checkpoint-dir", str(out / "checkpoints"))
    return [BatchJob(out, ("--device", "cpu", "--steps", "4", "--losses-out", str(out / "uninterrupted.json")), world),
            BatchJob(out, (*common, "--steps", "2", "--decay-steps", "4", "--losses-out", str(out / "first_half.json")),
                     world),
            BatchJob(out, (*common, "--steps", "4", "--resume", "--losses-out", str(out / "resumed.json")), world,
                     same_ranks_as=first + 1)]


def check_resumed(out: Path) -> None:
    """The resume_jobs' losses: the first half and the resumed run continue the uninterrupted one bit for bit
    (same weights, optimizer state and batches), from the checkpoint saved at step 2."""
    uninterrupted, first_half, resumed = (json.loads((out / f"{name}.json").read_text())
                                          for name in ("uninterrupted", "first_half", "resumed"))
    assert len(uninterrupted) == 4 and first_half == uninterrupted[:2]
    assert resumed == uninterrupted[2:]
    assert (out / "checkpoints" / "step_2" / ".metadata").is_file()


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    folders = {(m, layout): model_layout(root, m, layout, par) for m in MODELS for layout, par in LAYOUTS.items()}
    folders.update({key: model_layout(root, *key, par) for key, par in EXTRA_LAYOUTS.items()})
    folders.update({("other", name): write_case(root, name, source, stages, **par)
                    for name, (source, stages, par) in OTHER_MODELS.items()})
    folders[HALVED] = halved_gradients_case(root)
    extra, resumed = [], {}
    for key in RESUMED:
        world = Plan.from_json((folders[key] / "plan.json").read_text()).parallelism.world_size
        resumed[key] = len(extra)
        extra += resume_jobs(folders[key], world, len(extra))
    keys = list(folders)
    result = verify_many([folders[k] for k in keys], steps=STEPS, timeout_s=600, nproc=8, extra_jobs=extra)
    return dict(zip(keys, result.results)), folders, result.extra_errors, resumed


def check_parity(result) -> None:
    """Loss parity and the first step's gradients of every parameter on every rank, against the reference."""
    assert not result.error, result.error[-3000:]
    gradients = result.gradients
    print(f"parity max |diff| = {result.parity_max_abs_diff:.3g}, gradient max rel diff = "  # shown by pytest -rP
          f"{gradients.max_rel_diff:.3g} ({gradients.worst})")
    assert result.parity_max_abs_diff <= PARITY_TOLERANCE, (result.reference_losses, result.losses)
    assert not gradients.problem and gradients.max_rel_diff <= GRADIENT_TOLERANCE, gradients
    assert result.passed
    assert len(result.losses) == STEPS and result.reference_losses[0] != result.reference_losses[1]


HALVED = ("gpt", "dp=2,zero=3,tp=2 mlp.fc gradients halved")
"""A copy of the gpt dp=2,zero=3,tp=2 layout whose train.py halves the gradients of every mlp.fc after
forward_backward (as expert parallelism once halved every expert gradient): the losses match under AdamW,
the gradient check must fail."""
HALVE_LINE = "local_loss = parallel.forward_backward(inputs, targets)  # and tied weights' gradients summed\n"


def halved_gradients_case(root: Path) -> Path:
    out = model_layout(root, HALVED[0], HALVED[1], LAYOUTS["dp=2,zero=3,tp=2"])
    program = (out / "train.py").read_text()
    assert HALVE_LINE in program
    indent = " " * 12
    halve = (f"{indent}for name, param in parts[0].named_parameters():\n"
             f"{indent}    if '.mlp.fc.' in name:\n{indent}        param.grad.mul_(0.5)\n")
    (out / "train.py").write_text(program.replace(HALVE_LINE, HALVE_LINE + halve))
    return out


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_the_single_device_model(batch, model, layout):
    check_parity(batch[0][model, layout])


@pytest.mark.parametrize("key", list(EXTRA_LAYOUTS), ids=lambda key: " ".join(key))
def test_more_layouts_train_like_the_single_device_model(batch, key):
    check_parity(batch[0][key])


@pytest.mark.parametrize("name", list(OTHER_MODELS))
def test_other_models_train_like_the_single_device_model(batch, name):
    check_parity(batch[0]["other", name])


def test_a_gradient_halved_trains_to_the_same_losses_but_fails_the_gradient_check(batch):
    result = batch[0][HALVED]
    assert not result.error, result.error[-3000:]
    assert result.parity_max_abs_diff <= PARITY_TOLERANCE  # AdamW: the loss parity cannot see it
    gradients = result.gradients
    assert not result.passed and not gradients.problem
    assert gradients.max_rel_diff == pytest.approx(0.5, rel=1e-3) and ".mlp.fc." in gradients.worst, gradients


@pytest.mark.parametrize("key", RESUMED, ids=lambda key: " ".join(key))
def test_resuming_a_checkpoint_continues_the_uninterrupted_run(batch, key):
    _, folders, errors, resumed = batch
    first = resumed[key]
    failures = [e for e in errors[first:first + 3] if e]
    assert not failures, failures[0][-3000:]
    check_resumed(folders[key])
