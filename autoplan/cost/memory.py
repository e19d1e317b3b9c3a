"""Peak memory of one rank of a pipeline stage.

memory(stage) = model states (parameters + gradients + AdamW state, sharded by ZeRO)
              + unsharded copies FSDP holds (one unit when pp = 1; the whole stage when pp > 1)
              + activations (saved bytes x micro-batch size x micro-batches in flight)
              + the stage's outputs kept for backward (pipeline boundary, same in-flight count)
              + buffers: the transient working set of back-propagating the largest unit.
Allocator fragmentation and the CUDA context are not modelled here: they are
Gpu.memory_reserved_bytes, already taken out of Cluster.usable_memory_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.dtypes import activation_scale, bytes_per_element, training_dtype
from autoplan.cost.pipeline import microbatches_in_flight
from autoplan.plan import Parallelism
from autoplan.solve.layers import LayerChain

MODEL_STATE_BYTES_PER_PARAM = {
    "fp32": {"parameters": 4, "gradients": 4, "optimizer": 8},
    "bf16": {"parameters": 2, "gradients": 2, "optimizer": 12},
}
"""Bytes per parameter, AdamW. fp32: weights, gradients, exp_avg + exp_avg_sq (4 + 4 + 8).
bf16 mixed precision: bf16 weights and gradients, fp32 master weights + exp_avg + exp_avg_sq
(2 + 2 + 12; Rajbhandari et al., ZeRO, K = 12). Both total 16 bytes per parameter."""

STATE_CATEGORIES = ("parameters", "gradients", "optimizer")


def model_state_bytes(numel: float, train_dtype: str, zero_stage: int, data_parallel: int) -> dict[str, float]:
    """Parameters, gradients and optimizer state of `numel` parameters on one rank.

    ZeRO stage >= 1 shards the optimizer state over the data-parallel ranks, >= 2 also the
    gradients, 3 (FSDP) also the parameters: 16 Psi replicated, 16 Psi / Nd at stage 3.
    """
    per_param = MODEL_STATE_BYTES_PER_PARAM[training_dtype(train_dtype)]
    sharded_from = {"optimizer": 1, "gradients": 2, "parameters": 3}
    return {
        c: numel * per_param[c] / (data_parallel if zero_stage >= sharded_from[c] else 1)
        for c in STATE_CATEGORIES
    }


@dataclass(frozen=True)
class StageMemoryModel:
    """Memory of a rank of stage `stage_index` as a function of the contiguous units [a, b) it holds:

        memory = sum_{u in [a,b)} per_unit[c][u]  +  sum_{g touching [a,b)} per_tied_group[c][g]
               + max_{u in [a,b)} largest_unit[c][u]  +  outgoing_cut[c][b-1]  (when b < n)

    summed over categories c. The solvers (dp.py, ilp.py) use the flattened vectors."""

    stage_index: int
    per_unit: dict[str, tuple[float, ...]]
    """category -> bytes each unit adds (linear in the units held)."""
    per_tied_group: dict[str, tuple[float, ...]]
    """category -> bytes of each tied group, counted once if the stage holds any of its units."""
    tied_group_units: tuple[tuple[int, ...], ...]
    """Units of each tied group (LayerChain.tied_groups order)."""
    largest_unit: dict[str, tuple[float, ...]]
    """category -> per-unit bytes of which the stage adds the maximum over its units."""
    outgoing_cut: dict[str, tuple[float, ...]]
    """category -> bytes added when the stage ends after unit i (i < n - 1)."""

    @property
    def unit_bytes(self) -> tuple[float, ...]:
        return tuple(map(sum, zip(*self.per_unit.values())))

    @property
    def group_bytes(self) -> tuple[float, ...]:
        return tuple(map(sum, zip(*self.per_tied_group.values()))) if self.tied_group_units else ()

    @property
    def max_vectors(self) -> tuple[tuple[float, ...], ...]:
        return tuple(self.largest_unit.values())

    @property
    def cut_bytes(self) -> tuple[float, ...]:
        return tuple(map(sum, zip(*self.outgoing_cut.values()))) if self.outgoing_cut else ()

    def breakdown(self, start: int, end: int) -> dict[str, float]:
        """Bytes per category for units [start, end)."""
        out: dict[str, float] = {}
        for c, vec in self.per_unit.items():
            out[c] = out.get(c, 0.0) + sum(vec[start:end])
        for c, vec in self.per_tied_group.items():
            touched = sum(v for v, us in zip(vec, self.tied_group_units) if any(start <= u < end for u in us))
            out[c] = out.get(c, 0.0) + touched
        for c, vec in self.largest_unit.items():
            out[c] = out.get(c, 0.0) + max(vec[start:end])
        for c, vec in self.outgoing_cut.items():
            out[c] = out.get(c, 0.0) + (vec[end - 1] if end - 1 < len(vec) else 0.0)
        return out

    def total(self, start: int, end: int) -> float:
        return sum(self.breakdown(start, end).values())


def stage_memory_model(chain: LayerChain, par: Parallelism, train_dtype: str, stage_index: int) -> StageMemoryModel:
    """The memory model of stage `stage_index` of `par` (degrees, ZeRO stage, schedule, micro-batching)."""
    dtype = training_dtype(train_dtype)
    dp, pp, zero = par.data_parallel_degree, par.pipeline_parallel_degree, par.zero_stage
    mbs = par.pipeline_parallel_microbatch_size
    in_flight = microbatches_in_flight(
        par.pipeline_parallel_schedule, pp, par.pipeline_parallel_num_microbatches, stage_index)
    act = activation_scale(chain.capture_dtype, dtype) * mbs
    element = bytes_per_element(dtype)

    def states(numels) -> dict[str, tuple[float, ...]]:
        per = [model_state_bytes(n, dtype, zero, dp) for n in numels]
        out = {c: tuple(p[c] for p in per) for c in STATE_CATEGORIES}
        if zero == 3 and pp > 1:
            # torch.distributed.pipelining keeps FSDP parameters unsharded and gradients unreduced
            # across micro-batches (stage.py backward_maybe_with_nosync: set_reshard_after_backward
            # (False), set_requires_gradient_sync(False)), so the whole stage is held unsharded.
            out["gathered_parameters"] = tuple(n * element for n in numels)
            out["unsharded_gradients"] = tuple(n * element for n in numels)
        return out

    per_unit = states([u.exclusive_parameter_numel for u in chain.units])
    per_unit["activations"] = tuple(u.saved_bytes * act * in_flight for u in chain.units)
    largest = {"buffers": tuple(u.saved_bytes * act for u in chain.units)}
    if zero == 3 and pp == 1:
        # FSDP gathers one unit (its wrapping granularity) at a time for forward and backward.
        largest["gathered_parameters"] = tuple(u.parameter_numel * element for u in chain.units)
    return StageMemoryModel(
        stage_index=stage_index,
        per_unit=per_unit,
        per_tied_group=states([g.numel for g in chain.tied_groups]),
        tied_group_units=tuple(g.units for g in chain.tied_groups),
        largest_unit=largest,
        outgoing_cut={"activations": tuple(b * act * in_flight for b in chain.cut_bytes)},
    )
