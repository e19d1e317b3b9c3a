"""benchmarks/gpu_check.sh, the prepared first GPU run, cannot rot: its CPU dry run (--device cpu: the shrunken
Llama, one CPU process) runs every step of the same script here and ends with the summary of ratios."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ("detect", "kernels", "plan", "train_moe", "train_moe_compiled", "train_long", "train_compile", "train_eager",
         "train_selective", "train_full", "calibrate", "offload", "checkpoint", "profile", "summary")


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    results, log = tmp_path / "results", tmp_path / "gpu_check.log"
    # a CPU shared with other jobs starts torch slowly: the dry run's limits are not what it checks
    env = {**os.environ, "GPU_CHECK_RESULTS": str(results), "GPU_CHECK_LOG": str(log), "GPU_CHECK_SLACK": "40",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    for step in STEPS:
        assert f"=== {step}: done in" in text, f"{step} did not finish:\n{text[-4000:]}"
    summary = json.loads((results / "summary.json").read_text())
    for run in ("compile", "eager", "selective", "full", "moe", "moe_compiled", "long"):
        assert float(summary[f"train {run} step time"]) > 0 and float(summary[f"train {run} peak memory"]) > 0
    assert (results / "traces" / "moe" / "rank0.trace.json").is_file()  # train.py --profile wrote its trace
    assert summary["offload"] == "PASS" and summary["checkpoint"] == "PASS"
    assert float(summary["calibrate gemm_flops_per_s"]) > 0
    assert float(summary["profile gemm measured / roofline"]) > 0
    assert (results / "calibrated.yaml").is_file()
    kernels = json.loads((results / "kernels.json").read_text())
    assert kernels["gemm"]["flops_per_s"] > 0 and kernels["grouped"]["tiny"]["forward_backward_s"] > 0
    assert "gpu_check: 0 step(s) failed or timed out" in text


@pytest.mark.slow
def test_gpu_check_only_runs_the_named_steps(tmp_path):
    """--only reruns some steps (a second try on a GPU machine): detect and summary still run, nothing else."""
    results, log = tmp_path / "results", tmp_path / "gpu_check.log"
    env = {**os.environ, "GPU_CHECK_RESULTS": str(results), "GPU_CHECK_LOG": str(log), "GPU_CHECK_SLACK": "40",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--only", "kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    ran = [line.split()[1].rstrip(":") for line in text.splitlines() if line.startswith("=== ") and " done in " in line]
    assert ran == ["detect", "kernels", "summary"]


def test_gpu_check_refuses_bad_arguments():
    done = subprocess.run(["bash", str(SCRIPT), "--device", "tpu"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--device must be cuda or cpu" in done.stderr


def test_traced_kernels_are_summed_per_cost_kind_and_per_traced_step(tmp_path):
    """gpu_check's kernel summary of a --profile trace: device time per kind (GEMM, attention, optimizer, memory,
    copies as memory), divided by the traced steps; CPU ops are not kernels."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("autoplan_gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    events = [{"name": "ProfilerStep#8", "cat": "user_annotation", "dur": 1000},
              {"name": "ProfilerStep#9", "cat": "user_annotation", "dur": 1000},
              {"name": "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "cat": "kernel", "dur": 300},
              {"name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "cat": "kernel", "dur": 200},
              {"name": "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", "cat": "kernel",
               "dur": 100},
              {"name": "triton_poi_fused_add_mul_0", "cat": "kernel", "dur": 40},
              {"name": "Memcpy DtoD (Device -> Device)", "cat": "gpu_memcpy", "dur": 20},
              {"name": "aten::mm", "cat": "cpu_op", "dur": 5000}]
    trace = tmp_path / "rank0.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    found = check.traced_kernels(trace)
    assert found["steps"] == 2
    assert found["kinds_s"] == pytest.approx({"gemm": 150e-6, "attention": 100e-6, "optimizer": 50e-6,
                                              "memory": 30e-6})
    assert found["busy_s"] == pytest.approx(330e-6) and found["top"][0]["kind"] == "gemm"
