"""`autoplan verify DIR --device cuda --measure`: what a CPU can check (the refusals, the measured MFU's closed
form, verify.json's GPU form in the report and the CLI's lines) and, under the `gpu` marker, a one-GPU plan
trained on this machine's GPU."""

import json
import math
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from autoplan.cli import gpu_measurement_text, main
from autoplan.errors import UserError
from autoplan.report.html import verify_section
from autoplan.verify import GPU_PARITY_NOTE, VerifyResult, VerifySettings, _measured, verify

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = ROOT / "tests" / "models" / "tiny_gpt.py"


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory) -> Path:
    """A one-GPU H100 plan of a tiny GPT (planned here: no GPU needed to plan)."""
    out = tmp_path_factory.mktemp("gpu_plan") / "plan"
    plan_model(str(TINY_GPT), 1, "h100-sxm5-80gb", PlanOptions(out=out))
    return out


def test_cuda_verify_needs_measure_and_gpus(gpu_plan, capsys):
    with pytest.raises(UserError, match="--device cuda measures the program .* add --measure"):
        verify(gpu_plan, VerifySettings(device="cuda"))
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="sees none on this machine"):
            verify(gpu_plan, VerifySettings(device="cuda", measure=True))
        assert main(["verify", str(gpu_plan), "--device", "cuda", "--measure"]) == 2
        err = capsys.readouterr().err
        assert "sees none" in err and err.count("\n") == 1, err
    assert not (gpu_plan / "verify.json").exists()


def _metrics(step_times: list[float], peak: int) -> dict:
    return {"first_step": 0, "losses": [1.0] * len(step_times), "steps": [],
            "ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0, "tp_rank": 0, "stages": [0],
                       "step_times_s": step_times, "memory_tracked_step": len(step_times) - 1,
                       "peak_memory_bytes": peak, "baseline_memory_bytes": peak // 2}]}


def test_measured_mfu_is_the_predicted_one_scaled_by_the_step_times(gpu_plan):
    from autoplan.plan import load_plan

    plan = load_plan(gpu_plan / "plan.json")
    # steps 1..3 timed (step 0 warms up, step 4 tracks memory): median 0.02 s
    measured = _measured(plan, _metrics([5.0, 0.019, 0.020, 0.021, 0.5], 3 * 2**30), device="cuda")
    assert measured["measured_step_time_s"] == 0.020
    flops, peak = plan.predicted.model_flops_per_step, plan.predicted.model_flops_per_step / (
        plan.predicted.mfu * plan.predicted.step_time_s)  # one GPU's peak FLOP/s, from the prediction
    assert measured["measured_mfu"] == pytest.approx(flops / (0.020 * 1 * peak), rel=1e-9)
    assert measured["predicted_mfu"] == plan.predicted.mfu
    assert measured["measured_on"].startswith("cuda (nccl)")
    assert "measured_mfu" not in _measured(plan, _metrics([1.0, 1.0, 1.0], 1), device="cpu")


def _gpu_verify_json(passed: bool = True) -> dict:
    return {"device": "cuda", "nproc": 1, "steps": 20, "losses": [11.0, 10.5, 10.1], "passed": passed,
            "parity": GPU_PARITY_NOTE, "measured_step_time_s": 0.5, "predicted_step_time_s": 0.4,
            "measured_peak_memory_bytes": 30 * 2**30, "predicted_peak_memory_bytes": 28 * 2**30,
            "measured_mfu": 0.4, "predicted_mfu": 0.5, "measured_on": "cuda (nccl): ...",
            "predicted_for": "h100-sxm5-80gb"}


def test_report_shows_the_gpu_measurement_without_a_parity_verdict():
    html = verify_section(_gpu_verify_json())
    assert "trained on GPU" in html and "NO parity" not in html and "not checked on cuda" in html
    assert "MFU 40.0% measured, 50.0% predicted" in html
    assert "another device" not in html  # measured on a GPU, predicted for a GPU
    assert "GPU run failed" in verify_section(_gpu_verify_json(passed=False))


def test_cli_lines_give_measured_over_predicted():
    data = _gpu_verify_json()
    result = VerifyResult(nproc=1, steps=20, reference_losses=(), losses=(11.0, 10.1), parity_max_abs_diff=math.nan,
                          passed=True, measured=data, device="cuda")
    text = gpu_measurement_text(result)
    assert "500.0 ms measured, 400.0 ms predicted (measured / predicted 1.250)" in text
    assert "MFU        40.0% measured, 50.0% predicted" in text
    assert "peak memory 30.00 GiB measured, 28.00 GiB predicted (measured / predicted 1.071)" in text


@pytest.mark.gpu
@pytest.mark.slow
def test_a_one_gpu_plan_trains_on_this_gpu_beside_its_prediction(tmp_path):
    import torch

    name = torch.cuda.get_device_name().lower()
    gpu = "h200-sxm-141gb" if "h200" in name else "h100-sxm5-80gb"
    out = tmp_path / "plan"
    plan_model(str(TINY_GPT), 1, gpu, PlanOptions(out=out))
    result = verify(out, VerifySettings(steps=6, device="cuda", measure=True))
    report = json.loads((out / "verify.json").read_text())
    assert result.passed and report["device"] == "cuda" and len(report["losses"]) == 6
    assert report["measured_step_time_s"] > 0 and 0 < report["measured_peak_memory_bytes"]
    assert 0 < report["measured_mfu"] < 1
