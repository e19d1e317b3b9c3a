"""autoplan.parallelize, autoplan.init_mesh and autoplan.load_plan: a plan in a user's own training loop.

The slow tests train a model autoplan's examples do not hold (tests/models/tiny_gpt.py: tied head, blocks
in `self.h`) under dp=2 (DDP), pp=2, tp=2 and FSDP2 over 2 ranks, with the generated train.py of each plan
and with the recipes in examples/recipes/ (a hand-written loop; PyTorch Lightning's ModelParallelStrategy;
accelerate), all in one torchrun launch (tests/helpers/batch.py): the per-step losses agree. The Lightning
and accelerate recipes run when those packages are installed (the test extra installs them) and their
tests skip, saying so, when not. The fast tests cover the loader, the config and the one-line errors.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import autoplan
from autoplan.errors import UserError
from autoplan.layout import Parallelism
from autoplan.runtime.distributed.config import ParallelConfig, as_config

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from plans import pinned_plan  # noqa: E402
from verify_many import BatchJob, run_batch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "tiny_gpt.py"
RECIPES = ROOT / "examples" / "recipes"
STEPS = 3
RELATIVE_TOLERANCE = 1e-5
"""The recipes run train.py's arithmetic (AdamW in the plan's kernels, the same micro-batches and reductions):
their losses came out identical to train.py's (difference 0) on torch 2.13 CPU/gloo; the tolerance leaves
room for kernels that another torch build picks."""

LAYOUTS = {"dp": "dp=2,microbatch=2", "pp": "pp=2,schedule=1f1b,microbatch=2", "tp": "tp=2", "fsdp": "dp=2,zero=3"}
"""Layout name -> pin: 2 data-parallel ranks (DDP) accumulating 2 micro-batches, a 2-stage 1F1B pipeline of 2
micro-batches (the tied embedding and head on different stages), 2 tensor-parallel ranks, FSDP2 over 2 ranks."""


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, Path]:
    """Layout name -> the output folder of its plan (global batch 8 on 2 CPU ranks)."""
    root = tmp_path_factory.mktemp("parallelize")
    folders = {}
    for name, pin in LAYOUTS.items():
        folders[name] = root / name
        autoplan.plan(str(MODEL), gpus=2, gpu="cpu", pin=pin, global_batch=8, out=str(folders[name]))
    return folders


PROGRAMS = {"custom_loop": RECIPES / "custom_loop.py", "lightning": RECIPES / "lightning_recipe.py",
            "accelerate": RECIPES / "accelerate_recipe.py"}
"""The recipes that train with autoplan.parallelize; the last two run only when their package is installed."""


PLAIN_ADAMW = ("--clip-grad-norm", "0", "--warmup-steps", "0", "--weight-decay", "0.01", "--betas", "0.9", "0.999")
"""train.py's flags for the recipes' optimizer (torch.optim.AdamW's defaults at the plan's rate, no clipping); with
--min-lr at the plan's rate the schedule is constant."""


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@dataclass(frozen=True)
class Launched:
    """One torchrun launch: every layout's train.py and each installed recipe on the same plan."""

    losses: dict[tuple[str, str], Path]
    """(layout, program) -> its losses file ("train.py" or a PROGRAMS key)."""
    errors: dict[tuple[str, str], str]
    """(layout, program) -> the first failing rank's traceback, or ""."""


@pytest.fixture(scope="module")
def launched(planned, tmp_path_factory) -> Launched:
    """Every job in one launch of 2 processes (tests/helpers/batch.py): start-up costs more than training."""
    out = tmp_path_factory.mktemp("losses")
    programs = ["train.py", *(name for name in PROGRAMS if name == "custom_loop" or installed(name))]
    jobs, keys = [], []
    for program in programs:  # the framework recipes last: they set process-wide state (Lightning's rank)
        for name, folder in planned.items():
            losses = out / f"{name}-{program}.json"
            common = ("--steps", str(STEPS), "--device", "cpu", "--losses-out", str(losses))
            if program == "train.py":  # the recipes' optimizer: AdamW as torch sets it, a constant rate, no clipping
                rate = str(autoplan.load_plan(folder).training.learning_rate)
                jobs.append(BatchJob(folder, (*common, *PLAIN_ADAMW, "--min-lr", rate), 2))
            else:
                extra = ("--clip-grad-norm", "0") if program == "custom_loop" else ()
                jobs.append(BatchJob(folder, (str(folder), *common, *extra), 2, program=PROGRAMS[program]))
            keys.append((name, program))
    errors = run_batch(jobs, nproc=2, timeout_s=1200)
    return Launched(losses={key: out / f"{key[0]}-{key[1]}.json" for key in keys}, errors=dict(zip(keys, errors)))


def _losses(path: Path) -> list[float]:
    return json.loads(path.read_text())


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == STEPS, (what, got, want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    print(f"{what}: max relative difference {worst:.3g}")  # shown by pytest -rP
    assert worst <= RELATIVE_TOLERANCE, (what, got, want)


def _check_program(launched: Launched, program: str) -> None:
    for name in LAYOUTS:
        for key in ((name, "train.py"), (name, program)):
            assert not launched.errors[key], f"{key}:\n{launched.errors[key][-3000:]}"
        want = _losses(launched.losses[name, "train.py"])
        assert want[0] != want[-1], want  # it trains
        _assert_close(_losses(launched.losses[name, program]), want, f"{name}: {program} vs train.py")


@pytest.mark.slow
def test_a_hand_written_loop_trains_like_the_generated_program(launched):
    _check_program(launched, "custom_loop")


@pytest.mark.slow
def test_the_lightning_recipe_trains_like_the_generated_program(request):
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install 'torch-autoplan[recipes]')")
    _check_program(request.getfixturevalue("launched"), "lightning")  # after the check: no launch to skip


@pytest.mark.slow
def test_the_accelerate_recipe_trains_like_the_generated_program(request):
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'torch-autoplan[recipes]')")
    _check_program(request.getfixturevalue("launched"), "accelerate")


# ---------------------------------------------------------------------------------------------------------
# fast: the loader, the config and the one-line errors (no torchrun)


def test_import_autoplan_and_load_plan_leave_torch_unimported(tmp_path):
    import subprocess

    (tmp_path / "plan.json").write_text(make_plan().to_json())
    code = (f"import sys, autoplan; autoplan.load_plan({str(tmp_path)!r}); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr

TINY_GPT_CHAIN = ("tok", *(f"h.{i}.{m}" for i in range(4) for m in ("norm1", "attn", "norm2", "ff")), "norm", "head")


def make_plan(stages=(TINY_GPT_CHAIN,), **parallelism) -> "autoplan.Plan":
    dp = parallelism.get("dp_replicate", 1) * parallelism.get("dp_shard", 1)
    parallelism.setdefault("microbatch",
                           8 // (dp * parallelism.get("microbatches", 1)))
    return pinned_plan(MODEL, stages, **parallelism)


def tiny_gpt():
    """tests/models/tiny_gpt.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_gpt_for_parallelize", MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(UserError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_load_plan_reads_an_output_folder_or_its_plan_json(tmp_path):
    plan = make_plan(dp_replicate=2)
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert autoplan.load_plan(tmp_path) == plan
    assert autoplan.load_plan(str(tmp_path / "plan.json")) == plan


@pytest.mark.parametrize("change, expected", [
    (lambda raw: raw.update(schema_version=999), "schema_version 999, but this autoplan reads version"),
    (lambda raw: raw["parallelism"].update(tensor_parallel_degree="two"), "parallelism.tensor_parallel_degree must be"),
    (lambda raw: raw["parallelism"].update(data_parallel_replicate_degree=3), "the layout breaks its rules"),
    (lambda raw: raw.pop("stages"), "stages must be a list"),
    (lambda raw: raw["training"].update(optimiser="sgd"), "unknown field(s) in 'training': optimiser"),
])
def test_load_plan_refuses_a_plan_json_of_another_schema_in_one_line(tmp_path, change, expected):
    raw = make_plan(dp_replicate=2).to_dict()
    change(raw)
    (tmp_path / "plan.json").write_text(json.dumps(raw))
    message = one_line_error(autoplan.load_plan, tmp_path / "plan.json")
    assert expected in message and str(tmp_path / "plan.json") in message


@pytest.mark.parametrize("text, expected", [(None, "has no plan.json: is it an autoplan output folder?"),
                                            ("{not json", "plan.json is not valid JSON")])
def test_load_plan_of_a_folder_without_a_plan_or_a_file_that_is_not_json(tmp_path, text, expected):
    if text is not None:
        (tmp_path / "plan.json").write_text(text)
    assert expected in one_line_error(autoplan.load_plan, tmp_path)
    assert "no such plan.json" in one_line_error(autoplan.load_plan, tmp_path / "missing.json")


def test_the_config_of_a_plan_holds_its_layout_and_modules():
    plan = make_plan(stages=(TINY_GPT_CHAIN[:9], TINY_GPT_CHAIN[9:]), pp=2,
                     dp_shard=2, reshard=True,
                     microbatches=2, microbatch=2)
    config = as_config(plan)
    assert config.parallelism is plan.parallelism  # the one layout type, not a copy in other names
    p = config.parallelism
    assert (p.pp, p.dp_replicate, p.dp_shard, p.tp, p.world_size) == (2, 1, 2, 1, 4)
    assert (p.reshard, p.microbatches, p.microbatch) == (True, 2, 2)
    assert config.stages == (TINY_GPT_CHAIN[:9], TINY_GPT_CHAIN[9:]) and config.chain_modules == TINY_GPT_CHAIN
    assert as_config(config) is config


def test_the_config_holds_the_layout_once():
    """ParallelConfig is one Parallelism and the module lists: none of its own fields is a layout field again (a
    second spelling of microbatch, sp or reshard would be one)."""
    from dataclasses import fields

    own = {f.name for f in fields(ParallelConfig)} - {"parallelism"}
    assert not own & {f.name for f in fields(Parallelism)}


def test_a_config_whose_stages_do_not_match_its_pipeline_shows_the_arithmetic():
    message = one_line_error(ParallelConfig, Parallelism(pp=2, virtual_stages=2), stages=(("a",), ("b",)))
    assert "pp 2 x virtual_stages 2 = 4 stages, but stages lists 2" in message
    assert "tp must be a positive integer, got 0" in one_line_error(ParallelConfig, Parallelism(tp=0))


def test_parallelize_refuses_what_is_not_a_model_or_a_plan():
    import torch

    assert "takes the model as a torch.nn.Module, got function" in one_line_error(
        autoplan.parallelize, lambda x: x, make_plan())
    assert "plan must be an autoplan.Plan" in one_line_error(autoplan.parallelize, torch.nn.Linear(2, 2), {"tp": 2})


def test_a_pipeline_plan_needs_example_inputs():
    message = one_line_error(autoplan.parallelize, tiny_gpt().build_model(),
                             make_plan(stages=(TINY_GPT_CHAIN[:9], TINY_GPT_CHAIN[9:]), pp=2))
    assert "2-rank pipeline: pass example_inputs=" in message


def test_a_context_parallel_plan_needs_example_inputs_and_a_config_with_ep_across_replicas_is_refused():
    from autoplan.runtime.apply_plan import _check_runnable

    model = tiny_gpt().build_model()
    message = one_line_error(autoplan.parallelize, model, make_plan(cp=2))
    assert "splits sequences over 2 context-parallel ranks: pass example_inputs=" in message
    config = ParallelConfig(Parallelism(cp=2, pp=2), stages=(TINY_GPT_CHAIN[:9], TINY_GPT_CHAIN[9:]))
    assert config.parallelism.world_size_arithmetic().endswith("cp 2 x tp 1 = 4 processes")
    _check_runnable(config.parallelism)  # cp inside pipeline stages runs (tests/test_context_parallel_program.py)
    _check_runnable(Parallelism(cp=2, tp=2))  # and cp with tp
    _check_runnable(Parallelism(cp=2, dp_shard=2, ep=4))  # ep folded over dp_shard x cp
    message = one_line_error(autoplan.parallelize, model, ParallelConfig(Parallelism(cp=2, dp_replicate=2, ep=4),
                                                                         stages=(TINY_GPT_CHAIN,)),
                             example_inputs=tiny_gpt().example_batch(1)[0])
    assert "ep=4 does not divide dp_shard=1 x cp=2 x tp=1 = 2 (2 % 4 = 2)" in message


def test_a_plan_for_another_model_names_the_module_it_lacks():
    import torch

    message = one_line_error(autoplan.parallelize, torch.nn.Sequential(torch.nn.Linear(2, 2)), make_plan())
    assert "the plan names 19 module(s) this Sequential does not have (e.g. 'h.0.attn')" in message


@pytest.fixture
def one_process():
    """A process group of this pytest process alone (gloo, world size 1)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_plan_for_another_number_of_processes_says_how_many_to_launch(one_process):
    message = one_line_error(autoplan.init_mesh, make_plan(dp_replicate=2), "cpu")
    assert message == ("the plan is for pp 1 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 = 2 processes but 1 are "
                       "running: launch it with 2 processes (torchrun --nproc-per-node 2 on one machine)")
    message = one_line_error(autoplan.init_mesh, make_plan(dp_shard=2, cp=2),
                             "cpu")
    assert message.startswith("the plan is for pp 1 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 1 = 4 processes but 1 "
                              "are running: launch it with 4 processes"), message


def test_a_mesh_that_is_not_the_plans_is_refused(one_process):
    from torch.distributed.device_mesh import init_device_mesh

    other = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    message = one_line_error(autoplan.parallelize, tiny_gpt().build_model(), make_plan(), other)
    assert message == ("the mesh is data_parallel 1 x tensor_parallel 1, the plan needs pp 1 x dp_replicate 1 x "
                       "dp_shard 1 x cp 1 x tp 1 = 1 process in dims ('pp', 'dp_replicate', 'dp_shard', 'cp', 'tp'): "
                       "build it with autoplan.init_mesh(plan)")


def test_a_model_on_meta_needs_its_initial_values(one_process):
    import torch

    with torch.device("meta"):
        model = tiny_gpt().build_model()
    message = one_line_error(autoplan.parallelize, model, make_plan(), device="cpu")
    assert message.startswith("52 of the model's 52 tensors are on the meta device (no values)")


def test_one_process_trains_the_model_it_was_given(one_process):
    """World size 1: the parallel model is the user's model, with its values, and trains like it."""
    import copy

    import torch

    source = tiny_gpt()
    torch.manual_seed(0)
    model = source.build_model()
    original = copy.deepcopy(model)
    inputs, targets = source.example_batch(4)
    parallel = autoplan.parallelize(model, make_plan(), device="cpu")
    assert isinstance(parallel, autoplan.Parallelized) and parallel.rank.dp == 1
    assert all(p.device.type == "cpu" for p in parallel.parameters())
    assert torch.equal(parallel.model(inputs), original(inputs))
    assert parallel.model is model  # parallelized in place (here: nothing to wrap in one process)
    loss = parallel.forward_backward(inputs, targets)
    expected = torch.nn.functional.cross_entropy(original(inputs).flatten(0, 1), targets.flatten())
    assert math.isclose(parallel.global_loss(loss), expected.item(), rel_tol=1e-6)
    expected.backward()
    assert parallel.model.tok.weight is parallel.model.head.weight  # the tie holds (Module.to("meta") broke it)
    for (name, got), (_, want) in zip(parallel.model.named_parameters(), original.named_parameters()):
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-7), name
