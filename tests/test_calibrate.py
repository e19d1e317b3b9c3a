"""autoplan calibrate: one real 2-rank CPU/gloo run shared by the tests (its profile loads, is sane and
plans a small GPT), the fits and the GPU-path writer on synthetic numbers, --refit on synthetic
verify.json files, and the errors a user can cause."""

import datetime
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from autoplan.api import PlanOptions, load_cluster, plan_model
from autoplan.solve.refusals import pins_for_capture
from autoplan.calibrate import calibrate, refit
from autoplan.calibrate.fit import bus_factor, fit_alpha_beta, link_points
from autoplan.calibrate.frameworks import overhead_matching_step, pipeline_overheads
from autoplan.calibrate.types import Measurements, TierTimes
from autoplan.calibrate.writer import default_base, write_profile
from autoplan.cli import main
from autoplan.cost.pipeline import StageCost, simulate
from autoplan.errors import UserError
from autoplan.hardware.profiles import HOST_OVERHEADS, load_hardware, profiles_dir
from autoplan.solve.pins import parse_pins
from autoplan.solve.search import search

TINY_GPT = Path(__file__).resolve().parent / "models" / "tiny_gpt.py"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calibrate") / "cpu-calibrated.yaml"
    profile = calibrate(out, nproc=2, timeout_s=240)
    assert profile is not None and out.is_file()
    return out


@pytest.fixture(scope="module")
def planned(calibrated):
    return plan_model(str(TINY_GPT), 2, "cpu", PlanOptions(hardware=str(calibrated)))


@pytest.mark.slow
def test_calibrated_profile_loads_with_sane_numbers(calibrated):
    profile = load_hardware(str(calibrated))
    gpu = profile.gpu
    assert gpu.name == "cpu"  # keeps --gpu cpu semantics: ops are timed on this machine
    assert set(gpu.peak_flops) == {"fp32", "bf16"}
    assert 1e8 < gpu.peak_flops["fp32"] < 1e13, gpu.peak_flops  # one core: 0.1 GFLOP/s .. 10 TFLOP/s
    assert 0 < gpu.matmul_efficiency <= 1 and 0 < gpu.memory_efficiency <= 1
    assert 1e8 < gpu.memory_bandwidth_bytes_per_s < 1e13
    assert 1e-8 < gpu.kernel_overhead_s < 1e-3
    assert 0 < gpu.memory_reserved_bytes < gpu.memory_bytes
    # pipelining's extra time per stage and micro-batch: milliseconds plus a share of the compute
    assert 0 <= gpu.pipeline_microbatch_overhead_s < 0.05 and 0 <= gpu.pipeline_compute_slowdown < 2, gpu
    assert gpu.pipeline_microbatch_overhead_s > 0 or gpu.pipeline_compute_slowdown > 0, gpu
    link = profile.intra_node
    assert 1e6 < link.bus_bandwidth_bytes_per_s < 1e12, link
    assert 0 <= link.latency_s < 0.1, link
    assert profile.inter_node.bus_bandwidth_bytes_per_s == link.bus_bandwidth_bytes_per_s
    assert "copied from intra_node" in profile.inter_node.source


@pytest.mark.slow
def test_calibrated_profile_records_the_run(calibrated):
    raw = yaml.safe_load(calibrated.read_text())
    assert raw["gpu"]["memory_gib"] == "auto"
    found = raw["measurements"]
    assert datetime.datetime.fromisoformat(found["date"]).year >= 2024
    assert found["torch_version"] == str(torch.__version__)
    assert (found["world_size"], found["threads_per_rank"], found["backend"]) == (2, 1, "gloo")
    assert set(found["matmul_tflops"]["fp32"]) == {128, 256, 512, 1024}
    times = found["links"]["intra_node"]["times_us"]
    assert set(times) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    assert all(len(by_size) == 7 and min(by_size.values()) > 0 for by_size in times.values())
    assert found["links"]["inter_node"]["copied_from"] == "intra_node"
    assert "# inter_node is a copy of intra_node" in calibrated.read_text()


@pytest.mark.slow
def test_calibrated_profile_plans_a_small_gpt(planned, calibrated):
    plan = planned.plan
    assert plan.cluster.gpu == "cpu" and plan.cluster.num_gpus == 2
    assert plan.parallelism.world_size == 2
    assert 0 < plan.predicted.step_time_s < 10


@pytest.mark.slow
def test_cli_plans_with_the_calibrated_profile(calibrated, capsys):
    assert main(["plan", str(TINY_GPT), "--gpus", "2", "--gpu", "cpu", "--hardware", str(calibrated), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["gpu"] == "cpu"


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    latency, bandwidth, n = 50e-6, 2e9, 4
    seconds = {op: {s: latency + s * bus_factor(op, 2 if op == "p2p" else n) / bandwidth
                    for s in (4096, 65536, 2**20, 2**24)} for op in ("all_reduce", "all_gather", "p2p")}
    fit = fit_alpha_beta(link_points(seconds, n))
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bus_bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fit.relative_rms < 1e-9
    noisy = fit_alpha_beta([(1e3, 1e-6), (1e6, 1.1e-3), (1e7, 1e-2)])  # intercept < 0: refit through zero
    assert noisy.latency_s == 0 and 0.9e9 < noisy.bus_bandwidth_bytes_per_s < 1.1e9
    points = link_points(seconds, n)
    points[3] = (points[3][0], points[3][1] * 20)  # a descheduled rank: left out of the second fit
    robust = fit_alpha_beta(points)
    assert robust.points == len(points) - 1
    assert robust.bus_bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)


def _gpu_measurements(date="2025-01-01T00:00:00+00:00") -> Measurements:
    times = {op: {s: 20e-6 + s * bus_factor(op, 2 if op == "p2p" else 8) / 400e9 for s in (2**12, 2**20, 2**28)}
             for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    return Measurements(
        date=date, torch_version="2.x", device="cuda", device_name="NVIDIA H100 80GB HBM3", backend="nccl",
        world_size=8, ranks_per_node=8, threads_per_rank=1,
        matmul_flops_per_s={"bf16": {1024: 300e12, 2048: 600e12, 4096: 700e12, 8192: 750e12}},
        copy_bytes_per_s={16 * 2**20: 2000e9, 2**30: 2800e9}, kernel_overhead_s=4e-6,
        tiers={"intra_node": TierTimes(8, times), "inter_node": TierTimes(8, times, copied_from="intra_node")},
        resident_bytes=0.5 * 2**30, device_memory_bytes=80 * 2**30, peak_allocated_bytes=2**30, devices_per_node=8)


@pytest.mark.parametrize("ranks, send_s", [(2, 0.0005), (4, 0.0002), (2, 0.0)])
def test_pipeline_overhead_is_what_makes_the_simulated_gpipe_step_match(ranks, send_s):
    h = overhead_matching_step(0.03, ranks, 8, send_s)
    assert simulate("gpipe", ranks, 8, [StageCost(h / 2, h / 2, send_s)] * ranks).makespan_s == pytest.approx(0.03)
    # the sends on the critical path are not host time; a step faster than its sends has none
    assert h <= 0.03 / (8 + ranks - 1) + 1e-12
    assert overhead_matching_step(1e-4, ranks, 8, 0.01) == 0.0
    # the stages' own compute is not overhead: the same step with computing stages leaves less of it
    computing = overhead_matching_step(0.03, ranks, 8, send_s, forward_s=0.0005, backward_s=0.001)
    stage = StageCost(0.0005 + computing / 2, 0.001 + computing / 2, send_s)
    assert simulate("gpipe", ranks, 8, [stage] * ranks).makespan_s == pytest.approx(0.03)
    assert computing < h


def test_pipeline_overheads_are_a_line_through_two_stage_sizes():
    constant, slowdown = pipeline_overheads((0.005, 0.002), (0.025, 0.006))
    assert slowdown == pytest.approx(0.2) and constant == pytest.approx(0.001)
    assert pipeline_overheads((0.025, 0.006), (0.005, 0.002)) == pytest.approx((0.001, 0.2))  # either order
    # a line that would cross below 0 goes through the origin instead (least squares)
    constant, slowdown = pipeline_overheads((0.005, 0.0005), (0.025, 0.010))
    assert constant == 0.0 and slowdown == pytest.approx((0.005 * 0.0005 + 0.025 * 0.010) / (0.005**2 + 0.025**2))
    assert pipeline_overheads((0.005, 0.004), (0.025, 0.001)) == pytest.approx((0.004, 0.0))  # no growth: a constant


def test_gpu_measurements_keep_datasheet_peaks(tmp_path):
    assert default_base("cuda", "NVIDIA H100 80GB HBM3") == "h100-sxm5-80gb"
    assert default_base("cuda", "NVIDIA A100-SXM4-40GB") == "a100-sxm4-40gb"
    assert default_base("cuda", "NVIDIA L40S") is None
    base = load_hardware("h100-sxm5-80gb")
    profile = write_profile(_gpu_measurements(), tmp_path / "h100.yaml", base, "h100-sxm5-80gb")
    assert profile.gpu.name == "h100-sxm5-80gb" and profile.gpu.peak_flops == base.gpu.peak_flops
    assert profile.gpu.matmul_efficiency == pytest.approx(650e12 / 989e12, rel=1e-3)  # n = 2048/4096 over peak
    assert profile.gpu.memory_efficiency == pytest.approx(2800 / 3350, rel=1e-3)
    assert profile.gpu.memory_bytes == 80 * 2**30 and profile.default_gpus_per_node == 8
    assert profile.intra_node.bus_bandwidth_bytes_per_s == pytest.approx(400e9, rel=1e-3)
    assert profile.intra_node.latency_s == pytest.approx(20e-6, rel=1e-3)
    assert profile.intra_node.name == "nvlink"


def _verify_dir(tmp_path: Path, measured: float, predicted: float, **extra) -> Path:
    folder = tmp_path / "verified"
    folder.mkdir(exist_ok=True)
    report = {"measured_step_time_s": measured, "predicted_step_time_s": predicted, **extra}
    (folder / "verify.json").write_text(json.dumps(report))
    return folder


def test_refit_slower_run_lowers_efficiencies(tmp_path):
    breakdown = {"compute": 0.6, "data_parallel_comm": 0.3, "optimizer": 0.1}
    folder = _verify_dir(tmp_path, 2.0, 1.0, predicted_for="h100-sxm5-80gb", predicted_time_breakdown=breakdown)
    result = refit(folder, "h100-sxm5-80gb", tmp_path / "new.yaml")
    assert result.compute_factor == pytest.approx(2.0) and result.comm_factor == pytest.approx(2.0)
    assert result.predicted_after_s == pytest.approx(2.0)
    old, new = load_hardware("h100-sxm5-80gb"), load_hardware(str(tmp_path / "new.yaml"))
    assert new.gpu.matmul_efficiency == pytest.approx(old.gpu.matmul_efficiency / 2)
    assert new.gpu.memory_efficiency == pytest.approx(old.gpu.memory_efficiency / 2)
    assert new.intra_node.bus_bandwidth_bytes_per_s == pytest.approx(old.intra_node.bus_bandwidth_bytes_per_s / 2)
    assert new.intra_node.latency_s == pytest.approx(old.intra_node.latency_s * 2)
    assert new.gpu.peak_flops == old.gpu.peak_flops
    assert yaml.safe_load((tmp_path / "new.yaml").read_text())["refits"][0]["compute_factor"] == 2.0


def test_refit_splits_compute_and_comm_when_measured_apart(tmp_path):
    predicted = {"compute": 0.5, "data_parallel_comm": 0.5}
    measured = {"compute": 0.4, "data_parallel_comm": 1.5}
    folder = _verify_dir(tmp_path, 1.9, 1.0, predicted_time_breakdown=predicted, measured_time_breakdown=measured)
    result = refit(folder, "h100-sxm5-80gb", tmp_path / "new.yaml")
    assert result.compute_factor == pytest.approx(0.8) and result.comm_factor == pytest.approx(3.0)
    old, new = load_hardware("h100-sxm5-80gb"), load_hardware(str(tmp_path / "new.yaml"))
    assert new.gpu.matmul_efficiency > old.gpu.matmul_efficiency
    assert new.intra_node.bus_bandwidth_bytes_per_s < old.intra_node.bus_bandwidth_bytes_per_s


def test_refit_scales_each_host_overhead_with_its_side(tmp_path):
    raw = yaml.safe_load((profiles_dir() / "h100-sxm5-80gb.yaml").read_text())
    raw["gpu"].update({f"{name}_us": 100.0 for name in HOST_OVERHEADS})
    source = tmp_path / "with_host.yaml"
    source.write_text(yaml.safe_dump(raw))
    predicted = {"compute": 0.5, "data_parallel_comm": 0.4, "loss_all_reduce": 0.1}
    measured = {"compute": 1.0, "data_parallel_comm": 0.25, "loss_all_reduce": 0.25}  # comm side 0.5 -> 0.5
    folder = _verify_dir(tmp_path, 1.5, 1.0, predicted_time_breakdown=predicted, measured_time_breakdown=measured)
    result = refit(folder, str(source), tmp_path / "new.yaml")
    assert result.compute_factor == pytest.approx(2.0) and result.comm_factor == pytest.approx(1.0)
    new = load_hardware(str(tmp_path / "new.yaml"))
    for name, side in HOST_OVERHEADS.items():
        assert getattr(new.gpu, f"{name}_s") == pytest.approx(100e-6 * (2.0 if side == "compute" else 1.0)), name


def test_refit_clamps_factors_and_efficiencies(tmp_path):
    folder = _verify_dir(tmp_path, 0.001, 1.0, predicted_time_breakdown={"compute": 1.0})
    result = refit(folder, "h100-sxm5-80gb", tmp_path / "new.yaml")
    assert result.compute_factor == pytest.approx(0.1)
    new = load_hardware(str(tmp_path / "new.yaml"))
    assert new.gpu.matmul_efficiency == 1.0
    assert any("clamped" in note for note in result.notes)
    old = load_hardware("h100-sxm5-80gb")  # no communication was predicted: no evidence about the links
    assert new.intra_node.bus_bandwidth_bytes_per_s == old.intra_node.bus_bandwidth_bytes_per_s
    assert result.comm_factor == 1.0


@pytest.mark.slow
def test_refit_of_a_cpu_plan_moves_the_next_prediction_toward_the_measurement(planned, calibrated, tmp_path):
    plan = planned.plan
    predicted = plan.predicted.step_time_s
    folder = tmp_path / "verified"
    folder.mkdir()
    (folder / "plan.json").write_text(plan.to_json())
    measured = predicted * 1.05
    (folder / "verify.json").write_text(json.dumps({"measured_step_time_s": measured,
                                                    "predicted_step_time_s": predicted}))
    out = tmp_path / "refitted.yaml"
    assert main(["calibrate", "--refit", str(folder), "--hardware", str(calibrated), "--out", str(out)]) == 0
    old, new = load_hardware(str(calibrated)), load_hardware(str(out))
    assert new.intra_node.bus_bandwidth_bytes_per_s < old.intra_node.bus_bandwidth_bytes_per_s
    assert new.gpu.memory_efficiency <= old.gpu.memory_efficiency

    # the same measured op times priced under each profile: timing the ops again on a busy machine would
    # move the prediction by more than the refit does
    def priced_under(hardware: Path) -> float:
        cluster = load_cluster(2, "cpu", None, None, str(hardware))
        pins = pins_for_capture(parse_pins(""), planned.profile, warn=False)  # as plan_model searched
        return search(planned.profile, cluster, plan.training, pins).best.predicted.step_time_s

    before, after = priced_under(calibrated), priced_under(out)
    assert before == pytest.approx(predicted, rel=1e-6)
    # one refit is a linear step; communication hidden behind compute makes the real response nonlinear
    assert predicted < after < 2 * measured, (predicted, after, measured)


@pytest.mark.parametrize("args, message", [
    (["--out", "profile.txt"], "must name a .yaml file"),
    (["--out", "p.yaml", "--nproc", "0"], "--nproc must be an integer >= 1"),
    (["--out", "p.yaml", "--nproc", "two"], "invalid int value"),
    (["--out", "p.yaml", "--gpu", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["--out", "p.yaml", "--timeout", "0"], "--timeout must be positive"),
    *([(["--out", "p.yaml", "--gpu", "h100-sxm5-80gb"], "describes a GPU, but this machine has none")]
      if not torch.cuda.is_available() else []),
    (["--refit", "somewhere", "--out", "p.yaml"], "--refit needs --hardware"),
])
def test_calibrate_bad_inputs_exit_2(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_calibrate_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    out = tmp_path / "never-written.yaml"
    # 3 s: torchrun and its ranks are up (importing torch), and far from done measuring (~10 s)
    with pytest.raises(UserError, match="did not finish within 3 s and was killed"):
        calibrate(out, nproc=2, timeout_s=3)
    assert not out.exists()
    assert _processes_mentioning(str(out)) == []


def test_refit_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="not a folder"):
        refit(tmp_path / "missing", "h100-sxm5-80gb", tmp_path / "x.yaml")
    with pytest.raises(UserError, match="verify.json not found"):
        refit(tmp_path, "h100-sxm5-80gb", tmp_path / "x.yaml")
    folder = _verify_dir(tmp_path, math.nan, 1.0)
    with pytest.raises(UserError, match="measured_step_time_s is nan.*--measure"):
        refit(folder, "h100-sxm5-80gb", tmp_path / "x.yaml")
    folder = _verify_dir(tmp_path, 1.0, 1.0, predicted_for="cpu")
    with pytest.raises(UserError, match="plan for 'cpu' but the profile is 'h100-sxm5-80gb'"):
        refit(folder, "h100-sxm5-80gb", tmp_path / "x.yaml")
    folder = _verify_dir(tmp_path, 1.0, 1.0, predicted_time_breakdown={"compute": "fast"})
    with pytest.raises(UserError, match="predicted_time_breakdown must map"):
        refit(folder, "h100-sxm5-80gb", tmp_path / "x.yaml")
    with pytest.raises(UserError, match="unknown hardware"):
        refit(folder, "no-such-gpu", tmp_path / "x.yaml")
    assert not (tmp_path / "x.yaml").exists()
