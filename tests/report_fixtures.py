"""A small but realistic planning result (plan, profile, candidates) for the report tests, no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from autoplan.plan import Alternative, ClusterRef, ModelRef, Parallelism, Plan, Prediction, SolverInfo, Stage, Training
from autoplan.profile_data import ModelProfile, OpProfile

EVIL = "<script>alert(1)</script>"
"""A module name that must never reach the page unescaped."""
GIB = 2.0**30


@dataclass(frozen=True)
class FakeCandidate:
    """Duck-typed stand-in for autoplan.cost.evaluate.Candidate."""

    parallelism: Parallelism
    stages: tuple[Stage, ...]
    predicted: Prediction | None
    fits: bool
    reason: str
    activation_checkpoint_modules: tuple[str, ...] = ()


def make_op(index: int, module_stack: tuple[str, ...], time_fwd_s: float) -> OpProfile:
    return OpProfile(node=f"op{index}", op="aten.linear.default", module=module_stack[-1] if module_stack else "",
                     module_stack=module_stack, inputs=(), params=(), input_shapes=((2, 64),), dtype="float32",
                     flops_fwd=1e6, flops_bwd=2e6, input_bytes=512, output_bytes=512, saved_bytes=512,
                     time_fwd_s=time_fwd_s, time_bwd_s=2 * time_fwd_s, source="measured")


def _modules(layers: int) -> list[str]:
    return ["wte"] + [f"blocks.{i}" for i in range(layers)] + [EVIL, "lm_head"]


def make_profile(layers: int = 6) -> ModelProfile:
    ops = []
    for name in _modules(layers):
        stack = ("blocks", name) if name.startswith("blocks.") else (name,)
        for sub in ("attn", "mlp"):
            ops.append(make_op(len(ops), stack + (f"{name}.{sub}",), 2e-3 if sub == "mlp" else 1.5e-3))
    ops.append(make_op(len(ops), (), 3e-4))  # the loss, at the root
    return ModelProfile(model="tests/tiny_gpt.py:build_model", batch_size=2, dtype="float32", device="cpu",
                        ops=tuple(ops), parameters={"wte.weight": 64 * 100}, tokens_per_sample=32)


def _prediction(step: float, memory: float, dp_comm: float, pipe_comm: float) -> Prediction:
    return Prediction(step_time_s=step, samples_per_s=32 / step, tokens_per_s=32 * 32 / step,
                      model_flops_per_step=4.2e12, mfu=0.41, peak_memory_bytes=memory,
                      memory_breakdown={"parameters": memory * 0.2, "activations": memory * 0.5},
                      time_breakdown={"compute": step * 0.7, "bubble": step * 0.18,
                                      "pipeline_comm": pipe_comm, "data_parallel_comm": dp_comm})


def make_plan(pp: int = 2, microbatches: int = 4, schedule: str = "1f1b", dp: int = 2, chunks: int = 1,
              layers: int = 6) -> Plan:
    modules = _modules(layers)
    num_stages = pp * chunks
    per_stage = -(-len(modules) // num_stages)
    stages = []
    for i in range(num_stages):
        owned = tuple(modules[i * per_stage:(i + 1) * per_stage])
        memory = (9 + 2 * (num_stages - i)) * GIB
        stages.append(Stage(i, owned, 0.012 + 0.002 * (i == 0), memory,
                            {"parameters": 2 * GIB, "gradients": 2 * GIB, "optimizer": 4 * GIB,
                             "activations": memory - 8.5 * GIB, "buffers": 0.5 * GIB}))
    par = Parallelism(dp_replicate=dp, pp=pp,
                      schedule=schedule, microbatches=microbatches,
                      virtual_stages=chunks)
    predicted = _prediction(0.02 * (microbatches + pp), stages[0].predicted_memory_bytes, 0.008, 0.004)
    alternatives = (Alternative(parallelism=replace(par, schedule="gpipe"), step_time_s=0.2,
                                peak_memory_bytes=40 * GIB, fits=True, reason=f"GPipe keeps all {microbatches} "
                                f"micro-batches' activations: 40 GiB vs 13 GiB, and is 1.1x slower"),
                    Alternative(parallelism=Parallelism(dp_replicate=dp * pp), step_time_s=0.1,
                                peak_memory_bytes=93.1 * GIB, fits=False,
                                reason=f"needs 93.1 GiB per GPU, has 80 GiB ({EVIL})"))
    return Plan(model=ModelRef("examples/gpt.py", "build_model", 124_000_000),
                cluster=ClusterRef("h100-sxm5-80gb", dp * pp, 8, 80 * GIB),
                training=Training(global_batch_size=32, dtype="bf16", tokens_per_sample=32),
                parallelism=par, stages=tuple(stages), predicted=predicted,
                solver=SolverInfo("highs", "optimal", 0.42, 24), alternatives=alternatives)


def make_candidates(plan: Plan) -> tuple[FakeCandidate, ...]:
    out = [FakeCandidate(plan.parallelism, plan.stages, plan.predicted, True, "")]
    for i in range(1, 24):
        step = plan.predicted.step_time_s * (1 + 0.15 * i) * (0.6 if i % 5 == 0 else 1)
        memory = plan.predicted.peak_memory_bytes * (0.5 + (i * 7 % 11) / 2.2)
        par = Parallelism(dp_replicate=max(1, 4 // (1 + i % 3)), pp=1 + i % 3,
                          microbatches=2 + i % 4)
        fits = memory <= plan.cluster.memory_per_gpu_bytes
        reason = f"{step / plan.predicted.step_time_s:.2f}x slower" if fits else \
            f"needs {memory / GIB:.1f} GiB per GPU, has 80 GiB"
        pred = replace(plan.predicted, step_time_s=step, peak_memory_bytes=memory, samples_per_s=32 / step)
        out.append(FakeCandidate(par, plan.stages, pred, fits, reason))
    out.append(FakeCandidate(Parallelism(tp=3), (), None, False, "tp 3 does not divide 12 heads"))
    return tuple(out)


def make_result(**plan_options) -> SimpleNamespace:
    """A PlanResult look-alike (plan, profile, candidates)."""
    plan = make_plan(**plan_options)
    return SimpleNamespace(plan=plan, profile=make_profile(plan_options.get("layers", 6)),
                           candidates=make_candidates(plan))


def moe_result():
    """make_result's plan priced as for a model with experts (expert compute in every breakdown): the chosen layout
    with ep=4 and two ep=1 layouts, the faster of which does not fit."""
    result = make_result(pp=1, dp=8, microbatches=2)
    plan = result.plan
    parts = {**plan.predicted.time_breakdown, "expert_compute": 0.011, "expert_parallel_comm": 0.004}
    memory = {"parameters": 2 * GIB, "gradients": 2 * GIB, "optimizer": 4 * GIB, "activations": 9 * GIB}
    chosen = replace(result.candidates[0], parallelism=replace(plan.parallelism, ep=4),
                     predicted=replace(plan.predicted, time_breakdown=parts, memory_breakdown=memory))
    whole = []
    for slower, peak, fits in ((1.1, 90 * GIB, False), (1.3, 30 * GIB, True)):
        pred = replace(plan.predicted, step_time_s=plan.predicted.step_time_s * slower, peak_memory_bytes=peak,
                       time_breakdown={"compute": 0.05, "expert_compute": 0.017 * slower},
                       memory_breakdown={"parameters": peak / 4, "activations": peak / 2})
        whole.append(FakeCandidate(replace(plan.parallelism, dp_replicate=8), (), pred, fits, "x"))
    plan = replace(plan, parallelism=chosen.parallelism, predicted=chosen.predicted)
    candidates = (chosen, *whole, replace(whole[1], predicted=None))  # and one that could not be priced
    return SimpleNamespace(**{**vars(result), "plan": plan, "candidates": candidates}), chosen, whole[1]


VERIFY = {"nproc": 4, "steps": 6, "reference_losses": [4.61, 4.2, 3.81, 3.52, 3.3, 3.12],
          "losses": [4.61, 4.2000001, 3.8099999, 3.52, 3.3000002, 3.12], "parity_max_abs_diff": 2.1e-7,
          "predicted_step_time_s": 0.31, "measured_step_time_s": 0.36}
SCALING = [(2, 180.0), (4, 350.0), (8, 660.0), (16, 1150.0)]
