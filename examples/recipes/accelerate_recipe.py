"""Train with an autoplan plan in an accelerate script: the plan parallelizes the model, accelerate runs the
rest of the loop (processes, device, the optimizer wrapper, printing on the main process).

    autoplan examples/gpt.py --gpus 2 --gpu cpu --pin dp=2 --out autoplan_out
    accelerate launch --num_processes 2 examples/recipes/accelerate_recipe.py autoplan_out --steps 5
    (or: torchrun --standalone --nproc-per-node 2 examples/recipes/accelerate_recipe.py autoplan_out)

The model does not go through accelerator.prepare: accelerate 1.15 wraps a prepared model in DDP on CPU and
on GPUs without a plugin (a second DDP around a DDP plan's model; a DDP over the DTensor parameters of
tensor-parallel and FSDP2 plans, which stops), and a pipeline's stages are not one model. Its FSDP2 plugin does return a model
whose root is already fully_shard-ed unchanged, but only on GPUs, and only for a plan without tensor or
pipeline parallelism (docs/own-loop.md, the accelerate recipe). So accelerate prepares the optimizer only, and the plan's
forward_backward runs forward and backward (instead of accelerator.backward).
The batches are the generated train.py's synthetic ones, so the losses compare.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import send_to_device

import autoplan
from autoplan.contract import load_source


def load_model_file(path: Path):
    """The model file as a module (build_model, example_batch, optional loss_fn), loaded as autoplan loads it:
    the local files it imports (model_code/ holds them beside the copy) import as they did at planning."""
    return load_source(str(path)).module


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", type=Path, help="the autoplan output folder (or its plan.json)")
    parser.add_argument("--model", type=Path, help="the model file (default: the plan folder's copy, model_code/)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--losses-out", type=Path, help="write the per-step losses here (JSON list)")
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=args.device == "cpu")  # starts the process group if none is running
    plan = autoplan.load_plan(args.plan)
    model_file = load_model_file(args.model or autoplan.model_copy(args.plan))
    seed, global_batch = plan.training.seed, plan.training.global_batch_size

    torch.manual_seed(seed)  # rank 0's values are the ones every rank starts from
    model = model_file.build_model()
    micro_batch = model_file.example_batch(plan.parallelism.microbatch)[0]
    parallel = autoplan.parallelize(model, plan, device=accelerator.device, example_inputs=micro_batch,
                                    loss_fn=getattr(model_file, "loss_fn", None))
    kernels = plan.training.optimizer_implementation  # as the generated train.py runs AdamW
    optimizer = accelerator.prepare(torch.optim.AdamW(parallel.param_groups(), lr=plan.training.learning_rate,
                                                      fused=kernels == "fused", foreach=kernels == "foreach"))

    losses = []
    for step in range(args.steps):
        torch.manual_seed(seed + 1000 + step)  # the generated train.py's synthetic batch of this step
        inputs, targets = parallel.shard_batch(*model_file.example_batch(global_batch))
        optimizer.zero_grad(set_to_none=True)
        local_loss = parallel.forward_backward(send_to_device(inputs, accelerator.device),
                                               send_to_device(targets, accelerator.device))
        optimizer.step()
        losses.append(parallel.global_loss(local_loss))  # the mean over the global batch, on every rank
        accelerator.print(f"step {step} | loss {losses[-1]:.6f}")

    if accelerator.is_main_process and args.losses_out:
        args.losses_out.write_text(json.dumps(losses))
    del parallel, optimizer  # free the wrappers before the process group: their hooks hold it
    gc.collect()
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
