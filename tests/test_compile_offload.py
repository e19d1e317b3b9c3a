"""Loss parity with torch.compile per chain module (inductor's CPU backend) at dp=2 (FSDP2), pp=2 and tp=2,
with foreach AdamW at tp=2 (the layout matrix, tests/test_layouts.py, runs fused), and with FSDP2's CPU
offload at dp=2 (on a CPU device its CPUOffloadPolicy runs unpinned: torch cannot pin
host memory without an accelerator), against the eager single-device reference: one shared launch
(tests/helpers/verify_many.py). Inductor compiles C++ with gcc for each distinct block: tiny model, 2 steps.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.plan import Compile
from autoplan.verify import PARITY_TOLERANCE
from helpers.verify_many import verify_many
from test_layouts import MODELS, STEPS, make_plan, mb

pytestmark = pytest.mark.slow  # one torchrun launch; inductor compiles on 2 cores (minutes)

CASES = {
    "compile dp=2,zero=3": (True, dict(dp_shard=2, reshard=True, **mb(1, 4))),
    "compile pp=2": (True, dict(pp=2, **mb(2, 4))),
    "compile tp=2": (True, dict(tp=2, **mb(1, 8))),
    # HF Llama: sequence parallel + vocabulary-parallel head + loss parallel; run twice on a machine it once
    # failed from AOTAutograd's cache (runtime/distributed/compile.py _no_autograd_cache)
    "compile tp=2 llama": (True, dict(tp=2, **mb(1, 8))),
    "offload dp=2,zero=3": (False, dict(dp_shard=2, reshard=True,
                                        offload=True, **mb(2, 2))),
    "foreach tp=2": (False, dict(tp=2, **mb(1, 8))),  # DTensor weights beside plain tensors
}
IMPLEMENTATION = {"foreach tp=2": "foreach"}


"""The optimizer implementation where not the default (fused)."""


def write(root: Path, name: str, compiled: bool, parallelism: dict) -> Path:
    case = MODELS["llama" if name.endswith("llama") else "gpt"]
    folder = root / name.replace(",", "_").replace("=", "").replace(" ", "_")
    folder.mkdir(parents=True)
    model_file = folder / "user_model.py"
    model_file.write_text(case.source)
    pp = parallelism.get("pp", 1)
    half = len(case.chain_modules) // 2
    stages = [case.chain_modules] if pp == 1 else [case.chain_modules[:half], case.chain_modules[half:]]
    plan = replace(make_plan(model_file, stages, case.tensor_parallel_plan, **parallelism), compile=Compile(compiled))
    plan = replace(plan, training=replace(plan.training, optimizer_implementation=IMPLEMENTATION.get(name, "fused")))
    write_program(plan, folder / "out", model_file)
    (folder / "out" / "plan.json").write_text(plan.to_json())
    return folder / "out"


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile_offload")
    folders = {name: write(root, name, compiled, par) for name, (compiled, par) in CASES.items()}
    result = verify_many(list(folders.values()), steps=STEPS, timeout_s=1500, nproc=4)
    return dict(zip(folders, result.results)), folders


@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_the_eager_single_device_model(batch, name):
    result = batch[0][name]
    assert not result.error, result.error[-3000:]
    print(f"parity max |diff| = {result.parity_max_abs_diff:.3g}, gradient max rel diff = "  # shown by pytest -rP
          f"{result.gradient_max_rel_diff:.3g} ({result.gradients.worst})")
    assert result.parity_max_abs_diff <= PARITY_TOLERANCE, (result.reference_losses, result.losses)
    assert result.passed and result.gradients.passed, result.gradients  # the first step's gradients too
    assert len(result.losses) == STEPS and result.reference_losses[0] != result.reference_losses[1]


def test_the_programs_compile_and_offload_as_planned(batch):
    folders = batch[1]
    for name, (compiled, par) in CASES.items():
        text = (folders[name] / "train.py").read_text()
        assert f"COMPILE = {compiled}" in text
        assert ("SP = True" in text) == (par.get("tp", 1) > 1)  # make_plan: on with tp
        assert f"OFFLOAD = {par.get('offload', False)}" in text
        assert f"OPTIMIZER_IMPLEMENTATION = {IMPLEMENTATION.get(name, 'fused')!r}" in text

