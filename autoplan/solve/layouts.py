"""Which layouts the search tries, and pins checked with their arithmetic.

Scope today: data parallel (DDP = zero 0, FSDP = zero 3) x pipeline (GPipe, 1F1B) x micro-batch
size; tensor parallelism, interleaving, ZeRO 1/2 and recomputation are refused when pinned.
"""

from __future__ import annotations

from autoplan.errors import UserError
from autoplan.plan import Parallelism
from autoplan.solve.pins import Pins

SEARCHED_ZERO = (0, 3)
SEARCHED_SCHEDULES = ("1f1b", "gpipe")
"""Order is the preference among equal step times (1F1B holds fewer micro-batches)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def unsupported_pins(pins: Pins) -> list[str]:
    problems = []
    if pins.tp is not None and pins.tp > 1:
        problems.append(f"tensor parallelism is not supported yet (tp={pins.tp}; use tp=1)")
    if pins.zero is not None and pins.zero not in SEARCHED_ZERO:
        problems.append(f"zero={pins.zero} is not supported yet (supported: 0 = DDP, 3 = FSDP)")
    if pins.schedule is not None and pins.schedule not in SEARCHED_SCHEDULES:
        problems.append(f"schedule={pins.schedule} is not supported yet (supported: {', '.join(SEARCHED_SCHEDULES)})")
    if pins.recompute is not None and pins.recompute != "none":
        problems.append(f"recompute={pins.recompute} is not supported yet (supported: none)")
    return problems


def check_pins(pins: Pins, num_gpus: int, global_batch: int, num_units: int) -> None:
    """UserError listing every pin that cannot hold, with the arithmetic."""
    problems = unsupported_pins(pins)
    tp = pins.tp or 1
    if pins.pp is not None:
        if num_gpus % pins.pp:
            problems.append(f"pp={pins.pp} does not divide {num_gpus} GPUs")
        if pins.pp > num_units:
            problems.append(f"pp={pins.pp} exceeds the {num_units} layers the model splits into")
    if pins.dp is not None:
        if num_gpus % pins.dp:
            problems.append(f"dp={pins.dp} does not divide {num_gpus} GPUs")
        if global_batch % pins.dp:
            problems.append(f"dp={pins.dp} does not divide the global batch of {global_batch}")
    if pins.dp is not None and pins.pp is not None and pins.dp * pins.pp * tp != num_gpus:
        problems.append(f"dp={pins.dp} x pp={pins.pp} x tp={tp} = {pins.dp * pins.pp * tp}, not {num_gpus} GPUs")
    if pins.microbatch is not None:
        if pins.dp is not None and global_batch % pins.dp == 0 and (global_batch // pins.dp) % pins.microbatch:
            per_rank = global_batch // pins.dp
            problems.append(f"microbatch={pins.microbatch} does not divide the {per_rank} samples per "
                            f"data-parallel rank (global batch {global_batch} / dp={pins.dp})")
        elif pins.microbatch > global_batch:
            problems.append(f"microbatch={pins.microbatch} exceeds the global batch of {global_batch}")
    if (pins.schedule == "1f1b" and None not in (pins.dp, pins.pp, pins.microbatch) and pins.pp > 1
            and global_batch % (pins.dp * pins.microbatch) == 0):
        m = global_batch // (pins.dp * pins.microbatch)
        if m < pins.pp:
            problems.append(f"schedule=1f1b needs at least pp={pins.pp} micro-batches, but global batch "
                            f"{global_batch} / dp={pins.dp} / microbatch={pins.microbatch} = {m}")
    if problems:
        raise UserError("pins cannot hold: " + "; ".join(problems))


def enumerate_layouts(pins: Pins, num_gpus: int, global_batch: int, num_units: int) -> list[Parallelism]:
    """Every layout within scope that satisfies the pins (deterministic order)."""
    layouts = []
    for pp in divisors(num_gpus):
        dp = num_gpus // pp
        if pp > num_units or global_batch % dp or (pins.pp or pp) != pp or (pins.dp or dp) != dp:
            continue
        zeros = [pins.zero] if pins.zero is not None else [z for z in SEARCHED_ZERO if z == 0 or dp > 1]
        schedules = [pins.schedule] if pins.schedule else (list(SEARCHED_SCHEDULES) if pp > 1 else ["1f1b"])
        per_rank = global_batch // dp
        sizes = [pins.microbatch] if pins.microbatch else divisors(per_rank)
        for zero in zeros:
            for schedule in schedules:
                for mbs in sizes:
                    if per_rank % mbs:
                        continue
                    m = per_rank // mbs
                    if schedule == "1f1b" and pp > 1 and m < pp:
                        continue  # 1F1B needs at least as many micro-batches as stages
                    layouts.append(Parallelism(
                        data_parallel_replicate_degree=dp if zero == 0 else 1,
                        data_parallel_shard_degree=dp if zero == 3 else 1,
                        tensor_parallel_degree=1,
                        pipeline_parallel_degree=pp,
                        pipeline_parallel_schedule=schedule,
                        pipeline_parallel_microbatch_size=mbs,
                        pipeline_parallel_num_microbatches=m,
                        activation_checkpoint="none",
                        zero_stage=zero,
                    ))
    return layouts


def describe(par: Parallelism) -> str:
    text = f"dp={par.data_parallel_degree} pp={par.pipeline_parallel_degree} zero={par.zero_stage}"
    if par.pipeline_parallel_degree > 1:
        text += f" schedule={par.pipeline_parallel_schedule}"
    return text + f" microbatch={par.pipeline_parallel_microbatch_size} x{par.pipeline_parallel_num_microbatches}"
