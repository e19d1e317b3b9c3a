"""The body of the generated train.py. codegen/program.py fills in the docstring and the config
block (__DOCSTRING__, __CONFIG__); everything else is the same for every plan."""

TRAIN_PY = '''"""__DOCSTRING__"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan import runtime
from autoplan.source import load_source

# ----------------------------------------------------------------------------------------------
# The plan (numbers from plan.json)
__CONFIG__
DP = DP_REPLICATE * DP_SHARD
# ----------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--losses-out", type=Path, help="write the per-step losses here (JSON list)")
    parser.add_argument("--metrics-out", type=Path, help="write losses, step times and peak memory here (JSON)")
    parser.add_argument("--reference", action="store_true",
                        help="train the unsplit model on one device on the whole global batch (no torchrun)")
    return parser.parse_args()


def train_reference(model_source, device: torch.device, steps: int) -> list[float]:
    """The single-device baseline: same initial weights, same batches, same optimizer."""
    torch.manual_seed(SEED)
    model = model_source.build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(steps):
        inputs, targets = runtime.step_batch(model_source.example_batch, GLOBAL_BATCH, SEED, step)
        inputs, targets = runtime.to_device((inputs, targets), device)
        optimizer.zero_grad(set_to_none=True)
        loss = runtime.compute_loss(model_source.loss_fn, runtime.call_model(model, inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step} | loss {losses[-1]:.6f}")
    return losses


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    model_source = load_source(f"{MODEL_FILE}:{FACTORY}")
    if args.reference:
        losses = train_reference(model_source, device, args.steps)
        if args.losses_out:
            args.losses_out.write_text(json.dumps(losses))
        return

    # processes and the device mesh ("pp", "dp_replicate", "dp_shard")
    mesh, rank = runtime.init_mesh(device, pp=PP, dp_replicate=DP_REPLICATE, dp_shard=DP_SHARD)

    # the same initial weights on every rank (and in --reference)
    torch.manual_seed(SEED)
    model = model_source.build_model().to(device)

    # pipeline: cut this rank's stage out of the exported graph of the real model
    if PP > 1:
        example_inputs, _ = model_source.example_batch(MICROBATCH_SIZE)
        split = runtime.split_model(model, runtime.to_device(example_inputs, device), STAGES)
        module, units = split.stages[rank.pp_rank], split.units[rank.pp_rank]
        tied = runtime.TiedGradients(split, mesh, module, rank.pp_rank)  # weights used on 2+ stages
        split.drop_other_stages(rank.pp_rank)
    else:
        module, units, tied = model, [u for stage in STAGES for u in stage], None
    del model  # this rank keeps only its stage

    # activation checkpointing and data parallelism (DDP for zero 0, FSDP2 per unit then root)
    if ACTIVATION_CHECKPOINT == "full":
        module = runtime.checkpoint_units(module, units)
    module = runtime.data_parallel(module, mesh, ZERO_STAGE, units, device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)

    # forward + backward of one step over this rank's micro-batches
    if PP > 1:
        forward_backward = runtime.PipelineStep(module, split, mesh, rank, SCHEDULE, NUM_MICROBATCHES,
                                                model_source.loss_fn, device)
    else:
        forward_backward = runtime.AccumulationStep(module, NUM_MICROBATCHES, model_source.loss_fn)

    losses, step_times = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        # every rank draws the global batch and keeps its data-parallel slice
        batch = runtime.step_batch(model_source.example_batch, GLOBAL_BATCH, SEED, step)
        inputs, targets = runtime.to_device(runtime.shard(batch, rank.dp_rank, DP), device)
        optimizer.zero_grad(set_to_none=True)
        local_loss = forward_backward(inputs, targets)
        if tied is not None:
            tied.sum_gradients()
        optimizer.step()
        loss = runtime.global_mean_loss(local_loss, rank, device)  # mean over the global batch
        step_times.append(time.perf_counter() - start)
        losses.append(loss)
        if rank.rank == 0:
            print(f"step {step} | loss {loss:.6f} | {step_times[-1] * 1e3:.1f} ms | "
                  f"{GLOBAL_BATCH / step_times[-1]:.1f} samples/s", flush=True)

    peak_memory = runtime.peak_memory_bytes(device)
    if rank.rank == 0 and args.losses_out:
        args.losses_out.write_text(json.dumps(losses))
    if rank.rank == 0 and args.metrics_out:
        metrics = {"losses": losses, "step_times_s": step_times, "peak_memory_bytes": peak_memory}
        args.metrics_out.write_text(json.dumps(metrics, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
