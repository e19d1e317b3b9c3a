"""Train with an autoplan plan inside PyTorch Lightning: ModelParallelStrategy, configure_model calling
autoplan.parallelize.

    autoplan examples/gpt.py --gpus 2 --gpu cpu --pin dp=2 --out autoplan_out
    torchrun --standalone --nproc-per-node 2 examples/recipes/lightning_recipe.py autoplan_out --steps 5

(or run it with python: Lightning then starts the processes itself.)

Lightning's ModelParallelStrategy starts the processes and leaves the model to configure_model; the plan
builds its own mesh there (pp, dp_replicate, dp_shard, tp: the strategy's own 2-D mesh cannot hold a
pipeline), so the strategy is told only how many processes there are. The optimization is manual: the
plan's forward_backward runs forward and backward itself (a pipeline schedule, gradient accumulation over
micro-batches, tensor-parallel loss), which Lightning's automatic optimization cannot drive. Each rank's
dataloader yields its slice of the global batch (shard_batch), so Lightning's distributed sampler is off.
The batches are the generated train.py's synthetic ones, so the losses compare.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

import autoplan
from autoplan.contract import load_source


class PlannedModule(L.LightningModule):
    """A model from a model file (build_model, example_batch, optional loss_fn), trained with a plan."""

    def __init__(self, model_file, plan: autoplan.Plan, steps: int) -> None:
        super().__init__()
        self.model_file, self.plan, self.steps = model_file, plan, steps
        self.automatic_optimization = False  # forward_backward runs the backward (see the module docstring)
        self.parallel = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.parallel is not None:  # Lightning may call it again (e.g. fit, then test)
            return
        torch.manual_seed(self.plan.training.seed)  # rank 0's values are the ones every rank starts from
        model = self.model_file.build_model()
        micro_batch = self.model_file.example_batch(self.plan.parallelism.microbatch)[0]
        self.parallel = autoplan.parallelize(model, self.plan, device=self.device, example_inputs=micro_batch,
                                             loss_fn=getattr(self.model_file, "loss_fn", None))
        self.parts = nn.ModuleDict({str(s): part for s, part in self.parallel.parts.items()})  # Lightning sees them

    def configure_optimizers(self) -> torch.optim.Optimizer:
        kernels = self.plan.training.optimizer_implementation  # as the generated train.py runs AdamW
        return torch.optim.AdamW(self.parallel.param_groups(), lr=self.plan.training.learning_rate,
                                 fused=kernels == "fused", foreach=kernels == "foreach")

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        seed, global_batch = self.plan.training.seed, self.plan.training.global_batch_size
        batches = []
        for step in range(self.steps):
            torch.manual_seed(seed + 1000 + step)  # the generated train.py's synthetic batch of this step
            batches.append(self.parallel.shard_batch(*self.model_file.example_batch(global_batch)))
        return torch.utils.data.DataLoader(batches, batch_size=None)

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = batch
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        local_loss = self.parallel.forward_backward(inputs, targets)
        optimizer.step()
        loss = self.parallel.global_loss(local_loss)  # the mean over the global batch, on every rank
        self.losses.append(loss)
        self.log("loss", loss, prog_bar=True)


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

    plan = autoplan.load_plan(args.plan)
    module = PlannedModule(load_model_file(args.model or autoplan.model_copy(args.plan)), plan, args.steps)
    processes = plan.parallelism.world_size  # Lightning's own mesh is only told the count: the plan makes its own
    per_node = min(processes, plan.cluster.gpus_per_node)
    trainer = L.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=per_node,
                        num_nodes=processes // per_node,
                        strategy=ModelParallelStrategy(data_parallel_size=processes, tensor_parallel_size=1),
                        max_steps=args.steps, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    if trainer.global_rank == 0 and args.losses_out:
        args.losses_out.write_text(json.dumps(module.losses))
    return module.losses


if __name__ == "__main__":
    main()
