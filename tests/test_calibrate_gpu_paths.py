"""calibrate's paths for a GPU machine, checked on the CPU: every tensor a probe hands to a collective is
allocated where the process group communicates (NCCL has no CPU backend), TF32 is switched through torch's
fp32_precision setting (never mixed with the legacy flag), and a one-rank run (a one-GPU machine) measures the
device alone and keeps its base profile's links, saying why."""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import yaml

from autoplan.calibrate import calibrate, frameworks, measure
from autoplan.calibrate.worker import ONE_RANK
from autoplan.calibrate.writer import write_profile
from autoplan.errors import UserError
from autoplan.hardware.profiles import load_hardware

from test_calibrate import _gpu_measurements


class _RecordingClock(measure.Clock):
    """A CPU clock that remembers every tensor it allocated for a collective."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.allocated: list[torch.Tensor] = []  # kept alive: their memory is not reused

    def numbers(self, values):
        tensor = super().numbers(values)
        self.allocated.append(tensor)
        return tensor

    def owns(self, tensor: torch.Tensor) -> bool:
        """`tensor` is (a view of) one this clock allocated."""
        return any(tensor.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr() for mine in self.allocated)


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collective_tensors_come_from_the_clock(one_rank_group, monkeypatch):
    """Under NCCL a CPU tensor in a collective fails ("No backend type associated with device type cpu"), so
    the probes' timing tensors must be the clock's (on its GPU there): checked by identity here."""
    clock = _RecordingClock()
    handed: list[torch.Tensor] = []
    for name in ("all_reduce", "broadcast"):
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda tensor, *a, _real=real, **k: (handed.append(tensor),
                                                                             _real(tensor, *a, **k))[1])
    monkeypatch.setattr(measure, "SLOWDOWN_TRIALS", 2)
    pairs = frameworks._paired_times(clock, lambda: None, lambda: None, 3)
    slowdown = measure.concurrent_slowdown(clock)
    slowest = measure._slowest(clock, [1.0, 2.0, 3.0], None)
    assert len(pairs) == 3 and slowdown >= 1.0 and slowest == 2.0
    assert len(handed) == 1 + 2 * 2 + 1 and all(clock.owns(tensor) for tensor in handed)


def test_tf32_switch_never_mixes_torch_apis():
    """Once anything set torch's fp32_precision, reading the legacy allow_tf32 flag raises ("mix of the legacy
    and new APIs"): the matmul probe must switch TF32 with the setting torch has, and restore it."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision setting (only the legacy flag)")
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"  # as a user's script (or torch.compile's config) may have
    try:
        rates = measure.matmul_flops_per_s(measure.Clock(torch.device("cpu")), ("fp32", "tf32"), (32,))
        assert set(rates) == {"fp32", "tf32"} and matmul.fp32_precision == "tf32"
        with measure.tf32_matmuls(False):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = before


def _one_rank(found):
    return dataclasses.replace(found, world_size=1, ranks_per_node=1, devices_per_node=1, tiers={},
                               links_not_measured=ONE_RANK)


def test_one_rank_profile_keeps_the_base_links_and_says_why(tmp_path):
    base = load_hardware("h100-sxm5-80gb")
    profile = write_profile(_one_rank(_gpu_measurements()), tmp_path / "one.yaml", base, "h100-sxm5-80gb")
    for tier in ("intra_node", "inter_node"):
        kept, have = getattr(base, tier), getattr(profile, tier)
        assert have.bus_bandwidth_bytes_per_s == pytest.approx(kept.bus_bandwidth_bytes_per_s)
        assert have.latency_s == pytest.approx(kept.latency_s) and have.name == kept.name
        assert "not measured" in have.source and "one rank" in have.source
    # the single-device numbers are the measurement's: 650 TFLOP/s at n = 2048/4096 over the 989 peak
    assert profile.gpu.matmul_efficiency == pytest.approx(650e12 / 989e12, rel=1e-3)
    assert profile.gpu.fsdp_unit_overhead_s == base.gpu.fsdp_unit_overhead_s
    text = (tmp_path / "one.yaml").read_text()
    assert "not measured: one rank" in yaml.safe_load(text)["measurements"]["links"]
    with pytest.raises(UserError, match="no base profile supplies them"):
        write_profile(_one_rank(_gpu_measurements()), tmp_path / "none.yaml", None, None)


@pytest.mark.slow
def test_calibrate_on_one_rank_measures_the_device_alone(tmp_path):
    """`autoplan calibrate --nproc 1` (what a one-GPU machine runs): single-device probes only."""
    out = tmp_path / "one-rank.yaml"
    profile = calibrate(out, nproc=1, timeout_s=240)
    cpu = load_hardware("cpu")
    assert profile.intra_node.bus_bandwidth_bytes_per_s == pytest.approx(cpu.intra_node.bus_bandwidth_bytes_per_s)
    assert "not measured" in profile.intra_node.source
    raw = yaml.safe_load(out.read_text())["measurements"]
    assert raw["world_size"] == 1 and raw["matmul_tflops"]["fp32"] and raw["kernel_overhead_us"] > 0
    assert os.environ.get("WORLD_SIZE") is None  # the launch did not leak torchrun's environment
