"""A plan.json for a layout fixed by hand (no search), for tests that run or load generated programs: the
cluster is this machine's CPUs with one process per rank, and the predictions are placeholders."""

from __future__ import annotations

from pathlib import Path

from autoplan.plan import ClusterRef, ModelRef, Parallelism, Plan, Prediction, SolverInfo, Stage, Training


def pinned_plan(model_file: Path, stages, global_batch: int = 8, tokens_per_sample: int | None = None,
                tensor_parallel_plan=None, **parallelism) -> Plan:
    """`stages`: the chain modules of each pipeline stage; `parallelism`: Parallelism fields. With recompute, every
    chain module is recomputed; the tensor-parallel plan applies only with tp > 1."""
    par = Parallelism(**parallelism)
    return Plan(
        model=ModelRef(path=str(model_file)),
        cluster=ClusterRef(gpu="cpu", num_gpus=par.world_size, gpus_per_node=8, memory_per_gpu_bytes=2**30),
        training=Training(global_batch_size=global_batch, learning_rate=1e-2, seed=3,
                          tokens_per_sample=tokens_per_sample),
        parallelism=par,
        stages=tuple(Stage(index=i, modules=tuple(m), predicted_time_s=0.01, predicted_memory_bytes=1e6)
                     for i, m in enumerate(stages)),
        predicted=Prediction(step_time_s=0.05, samples_per_s=160.0, tokens_per_s=None, model_flops_per_step=1e6,
                             mfu=0.1, peak_memory_bytes=1e6),
        solver=SolverInfo(name="pinned", status="optimal", time_s=0.0, candidates_evaluated=1),
        tensor_parallel_plan=dict(tensor_parallel_plan or {}) if par.tp > 1 else {},
        activation_checkpoint_modules=() if par.recompute == "none" else tuple(m for s in stages for m in s),
    )
