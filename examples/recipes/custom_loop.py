"""A hand-written training loop that trains with an autoplan plan (autoplan.parallelize).

Plan the model first, then launch this with the plan's number of processes:

    autoplan examples/gpt.py --gpus 2 --gpu cpu --pin dp=2 --out autoplan_out
    torchrun --standalone --nproc-per-node 2 examples/recipes/custom_loop.py autoplan_out --steps 5

The model comes from the copy of the model file the plan's folder holds (model_code/: build_model,
example_batch, and loss_fn if it has one). Its data are synthetic batches drawn as the generated train.py draws them (step t:
torch.manual_seed(seed + 1000 + t), then example_batch(global batch)), so the losses of the two programs
compare; put your own data loader there, each rank taking its slice of the global batch (shard_batch).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist

import autoplan
from autoplan.contract import load_source


def load_model_file(path: Path):
    """The model file as a module (build_model, example_batch, optional loss_fn), loaded as autoplan loads it:
    the local files it imports (model_code/ holds them beside the copy) import as they did at planning."""
    return load_source(str(path)).module


def to_device(batch, device: torch.device):
    """A tensor, or a tuple, list or dict of them, on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", type=Path, help="the autoplan output folder (or its plan.json)")
    parser.add_argument("--model", type=Path, help="the model file (default: the plan folder's copy, model_code/)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--clip-grad-norm", type=float, default=1.0,
                        help="clip the gradients to this global norm (0: no clipping)")
    parser.add_argument("--losses-out", type=Path, help="write the per-step losses here (JSON list)")
    args = parser.parse_args(argv)

    plan = autoplan.load_plan(args.plan)
    model_file = load_model_file(args.model or autoplan.model_copy(args.plan))
    seed, global_batch = plan.training.seed, plan.training.global_batch_size
    device = torch.device(args.device)

    # 1. build the model as usual (rank 0's values are the ones every rank starts from)
    torch.manual_seed(seed)
    model = model_file.build_model()
    # 2. apply the plan: this rank's stages and shards, wrapped as planned
    micro_batch = model_file.example_batch(plan.parallelism.microbatch)[0]
    parallel = autoplan.parallelize(model, plan, device=device, example_inputs=micro_batch,
                                    loss_fn=getattr(model_file, "loss_fn", None))
    # 3. an optimizer over this rank's parameters (grouped by tensor kind for torch's fused/foreach kernels),
    #    with the plan's AdamW kernels as train.py runs them (training.optimizer_implementation)
    kernels = plan.training.optimizer_implementation
    optimizer = torch.optim.AdamW(parallel.param_groups(), lr=plan.training.learning_rate, fused=kernels == "fused",
                                  foreach=kernels == "foreach")

    # 4. the loop
    losses = []
    for step in range(args.steps):
        torch.manual_seed(seed + 1000 + step)  # the generated train.py's synthetic batch of this step
        inputs, targets = parallel.shard_batch(*model_file.example_batch(global_batch))
        optimizer.zero_grad(set_to_none=True)
        local_loss = parallel.forward_backward(to_device(inputs, device), to_device(targets, device))
        if args.clip_grad_norm > 0:  # the global norm over every rank's share, as on one device
            parallel.clip_grad_norm_(args.clip_grad_norm)
        optimizer.step()
        losses.append(parallel.global_loss(local_loss))  # the mean over the global batch, on every rank
        if parallel.rank.rank == 0:
            print(f"step {step} | loss {losses[-1]:.6f}")

    if parallel.rank.rank == 0 and args.losses_out:
        args.losses_out.write_text(json.dumps(losses))
    # free the wrappers before the process group: their hooks hold it in reference cycles
    del parallel, optimizer
    gc.collect()
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
