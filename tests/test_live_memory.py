"""PeakLiveMemory on CPU: exact byte counts for known allocations, and for training steps (plain,
FSDP2, tensor parallel) agreement with PyTorch's own MemTracker plus closed-form baselines."""

import gc
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from autoplan.runtime.components.memory import PeakLiveMemory

CPU = torch.device("cpu")
MiB = 2**20


def empty_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def live_now() -> int:
    """Bytes of Python-visible tensor storage alive right now (what a baseline would say)."""
    with PeakLiveMemory(CPU) as probe:
        pass
    return probe.baseline_bytes


def test_peak_is_the_largest_moment_not_the_sum_of_allocations():
    with PeakLiveMemory(CPU) as tracker:
        big = empty_bytes(8 * MiB)
        del big
        small = empty_bytes(4 * MiB)
    assert tracker.peak_bytes - tracker.baseline_bytes == 8 * MiB
    del small


def test_baseline_counts_tensors_alive_before_entering():
    background = live_now()
    kept = empty_bytes(16 * MiB)
    view = kept[MiB:]  # a view of the same storage: counted once
    with PeakLiveMemory(CPU) as tracker:
        pass
    assert tracker.baseline_bytes - background == 16 * MiB
    assert tracker.peak_bytes == tracker.baseline_bytes
    del kept, view


def test_tensor_freed_inside_lowers_the_live_count():
    doomed = empty_bytes(16 * MiB)
    with PeakLiveMemory(CPU) as tracker:
        del doomed
        replacement = empty_bytes(8 * MiB)  # fits in what was freed: no new peak
    assert tracker.peak_bytes == tracker.baseline_bytes
    del replacement


def test_storage_resized_in_place_is_counted():
    # FSDP2 allocates unsharded parameters by resizing a 0-byte storage: no op a dispatch mode sees
    holder = empty_bytes(0)
    with PeakLiveMemory(CPU) as tracker:
        holder.untyped_storage().resize_(8 * MiB)
        holder.untyped_storage().resize_(0)
        after = empty_bytes(2 * MiB)
    assert tracker.peak_bytes - tracker.baseline_bytes == 8 * MiB
    del after, holder


def test_reusable_leaves_nothing_behind_even_after_an_error():
    tracker = PeakLiveMemory(CPU)
    had_resize = "resize_" in torch.UntypedStorage.__dict__
    increases = []
    for _ in range(3):
        with tracker:
            inside = empty_bytes(3 * MiB)
        increases.append(tracker.peak_bytes - tracker.baseline_bytes)
        storage_ref = weakref.ref(inside.untyped_storage())
        del inside
        gc.collect()
        assert storage_ref() is None, "the tracker kept a storage alive"
    assert increases == [3 * MiB] * 3
    with pytest.raises(ValueError, match="boom"):
        with tracker:
            raise ValueError("boom")
    assert torch._C._len_torch_dispatch_stack() == 0, "dispatch mode left on the stack"
    assert ("resize_" in torch.UntypedStorage.__dict__) == had_resize, "UntypedStorage.resize_ not restored"


def mem_tracker_increase(step, *external) -> int:
    """MemTracker's peak minus what it counted at entry, for one call of `step`."""
    tracker = MemTracker()
    tracker.track_external(*external)
    before = tracker.get_tracker_snapshot()[CPU]["Total"]
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"] - before


def assert_close(ours: int, reference: int, rel: float) -> None:
    assert abs(ours - reference) <= rel * reference, (
        f"PeakLiveMemory increase {ours} B vs MemTracker {reference} B: off by {ours - reference} B "
        f"({(ours - reference) / reference:+.2%}, allowed ±{rel:.0%})")


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())


def adamw_state_bytes(model: nn.Module) -> int:
    """exp_avg and exp_avg_sq shaped like each (local) parameter, plus one float32 step counter each."""
    return 2 * parameter_bytes(model) + 4 * len(list(model.parameters()))


def training_step(model: nn.Module, inputs: torch.Tensor, loss_of) -> tuple:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss_of(model(inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on, as in a steady-state step
    return step, optimizer


def test_transformer_step_matches_mem_tracker_and_closed_form_baseline():
    background = live_now()
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), nn.Linear(32, 8))
    inputs, targets = torch.randn(4, 16, 32), torch.randint(0, 8, (4, 16))
    step, optimizer = training_step(
        model, inputs, lambda out: nn.functional.cross_entropy(out.reshape(-1, 8), targets.reshape(-1)))
    with PeakLiveMemory(CPU) as tracker:
        step()
    expected_baseline = parameter_bytes(model) + adamw_state_bytes(model) + inputs.nbytes + targets.nbytes
    assert tracker.baseline_bytes - background == expected_baseline  # grads are None between steps
    increase = tracker.peak_bytes - tracker.baseline_bytes
    assert increase > parameter_bytes(model)  # at least the gradients, seen through backward
    assert_close(increase, mem_tracker_increase(step, model, optimizer, inputs, targets), rel=0.02)


@pytest.fixture
def one_rank_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def mlp(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 2 * width), nn.ReLU(),
                         nn.Linear(2 * width, width))


def test_fsdp2_step_counts_local_shards_and_unsharded_parameters(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard

    background = live_now()
    model = mlp(128)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=one_rank_mesh)
    fully_shard(model, mesh=one_rank_mesh)
    inputs = torch.randn(32, 128)
    step, optimizer = training_step(model, inputs, lambda out: out.square().mean())
    with PeakLiveMemory(CPU) as tracker:
        step()
    assert tracker.baseline_bytes - background == parameter_bytes(model) + adamw_state_bytes(model) + inputs.nbytes
    increase = tracker.peak_bytes - tracker.baseline_bytes
    # the unsharded copy of the largest layer's parameters (a storage resize) plus its gradient at least
    biggest_layer = max(sum(p.to_local().nbytes for p in layer.parameters()) for layer in model[::2])
    assert increase >= 2 * biggest_layer
    assert_close(increase, mem_tracker_increase(step, model, optimizer, inputs), rel=0.02)


def assert_step_matches_mem_tracker(model: nn.Module) -> None:
    """A training step of `model` on a (32, 128) batch: its peak over the baseline exceeds the parameters
    and is MemTracker's within 2%."""
    inputs = torch.randn(32, 128)
    step, optimizer = training_step(model, inputs, lambda out: out.square().mean())
    with PeakLiveMemory(CPU) as tracker:
        step()
    increase = tracker.peak_bytes - tracker.baseline_bytes
    assert increase > parameter_bytes(model)
    assert_close(increase, mem_tracker_increase(step, model, optimizer, inputs), rel=0.02)


def test_tensor_parallel_step_matches_mem_tracker(one_rank_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = mlp(128)
    parallelize_module(model, one_rank_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert_step_matches_mem_tracker(model)


def test_ddp_step_matches_mem_tracker(one_rank_mesh):
    # DDP's gradient buckets live in C++: they count from the first op that touches them
    from torch.nn.parallel import DistributedDataParallel

    assert_step_matches_mem_tracker(DistributedDataParallel(mlp(128)))


def _parts_of_a_step(width: int, batch: int) -> tuple[dict[str, int], int, nn.Module]:
    """The peak's parts and bytes of one AdamW step of a 4-layer MLP, less what the process held besides it."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)))
    model.register_buffer("scale", torch.ones(width))
    inputs = torch.randn(batch, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():  # as train.py: gradients set to None first, so the step's own are alive at its end
        optimizer.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        optimizer.step()

    step()  # optimizer state exists from here on
    optimizer.zero_grad(set_to_none=True)  # as the step will: its gradients are not part of what was there before
    gc.collect()  # other tests' garbage: collected now, not between the two
    with PeakLiveMemory(CPU) as before:  # the model, its optimizer and whatever else the process holds
        pass
    with PeakLiveMemory(CPU) as tracker:
        step()
    parts = {k: v - before.peak_parts[k] for k, v in tracker.peak_parts.items()}
    assert sum(tracker.peak_parts.values()) == tracker.peak_bytes
    return parts, tracker.peak_bytes - before.peak_bytes, model


def test_peak_parts_say_what_the_peak_held_and_add_up_to_it():
    """Wide activations, small weights: the peak is the loss's (start of backward), before any gradient exists
    (they were set to None): parameters, optimizer state and buffer as they are, no gradients. Wide weights, one
    row of activations: the peak comes once the gradients exist (end of backward, optimizer step)."""
    parts, _, model = _parts_of_a_step(width=16, batch=4096)
    assert set(parts) == {"parameters", "gradients", "optimizer", "buffers", "activations"}
    assert parts["optimizer"] == parts["buffers"] == parts["gradients"] == 0  # as before the step: no gradient yet
    assert parts["activations"] > 4 * 4096 * 16 * 4  # each layer's output kept for backward
    parts, _, model = _parts_of_a_step(width=512, batch=1)
    assert parts["gradients"] == parameter_bytes(model)
    assert parts["activations"] < parameter_bytes(model)


def test_a_gradient_at_the_peak_counts_as_gradients_though_it_is_gone_by_exit():
    """FSDP2's unsharded gradients accumulated across micro-batches are the gathered parameter's .grad until the last
    micro-batch's reduce-scatter lets them go: at __exit__ nothing holds them, yet at the peak they were gradients
    (sorted by what held them at __exit__, they were counted as activations)."""
    import torch

    from autoplan.runtime.components.memory import PeakLiveMemory

    import gc

    linear = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256)
    gc.collect()
    # parameters other tests of this process left alive count as parameters too (the tracker sees every one)
    others = {id(p.untyped_storage()): p.untyped_storage().nbytes() for p in gc.get_objects()
              if isinstance(p, torch.nn.Parameter) and p is not linear.weight and type(p) is torch.nn.Parameter
              and p.device.type == "cpu"}
    with PeakLiveMemory(torch.device("cpu")) as tracker:
        linear(x).sum().backward()
        peak = torch.empty(300_000)  # the peak, with the gradient alive
        del peak
        linear.weight.grad = None
    assert tracker.peak_parts["gradients"] == 256 * 256 * 4
    assert tracker.peak_parts["parameters"] - sum(others.values()) == 256 * 256 * 4
