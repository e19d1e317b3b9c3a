"""Layout search: choices under ample and tight memory, pins, errors with arithmetic, Infeasible."""

import re
import subprocess
import sys
import time
from dataclasses import replace
from functools import lru_cache

import pytest
from chain_fixtures import GIB, cluster, gpt_profile

from autoplan.errors import Infeasible, UserError
from autoplan.plan import Parallelism, Training
from autoplan.solve.layers import build_chain
from autoplan.solve.pins import Pins, parse_pins
from autoplan.solve.search import estimate, search


@lru_cache(maxsize=None)
def gpt2_small():
    """About GPT-2 small: 124M parameters, 16 units."""
    return gpt_profile(n_layer=12, n_embd=768, vocab=50257, seq=1024, batch=1)


def capped(num_gpus: int, gib: float):
    return replace(cluster(num_gpus), memory_per_gpu_bytes=gib * GIB)


TRAINING = Training(global_batch_size=64, dtype="bf16")


def test_parse_pins_reads_every_key():
    pins = parse_pins("tp=8, pp=4,dp=2,zero=3,schedule=1F1B,microbatch=1,recompute=full")
    assert pins == Pins(dp=2, tp=8, pp=4, zero=3, schedule="1f1b", microbatch=1, recompute="full")
    assert parse_pins("") == Pins()


def test_parse_pins_lists_every_problem_at_once():
    with pytest.raises(UserError) as error:
        parse_pins("tp=x,foo=1,zero=5,schedule=zb,pp=0,dp,dp=2,dp=4")
    message = str(error.value)
    for part in ("tp=x is not an integer", "unknown key 'foo'", "zero=5 is not a ZeRO stage",
                 "schedule=zb is not one of", "pp=0 must be at least 1", "'dp' is not key=value",
                 "'dp' is given twice"):
        assert part in message


def test_ample_memory_picks_pure_data_parallelism_without_sharding():
    result = search(gpt2_small(), cluster(8), TRAINING)
    par = result.best.parallelism
    assert (par.data_parallel_replicate_degree, par.pipeline_parallel_degree, par.zero_stage) == (8, 1, 0)
    assert result.best.fits and result.best.reason == "" and len(result.best.stages) == 1
    assert result.solver.status == "optimal" and result.solver.candidates_evaluated == len(result.candidates)
    assert all(c.reason for c in result.candidates[1:])


def test_memory_below_the_replicated_model_state_forces_fsdp_or_a_pipeline():
    replicated = 16 * build_chain(gpt2_small()).parameter_numel
    cap_gib = 0.75 * replicated / GIB
    result = search(gpt2_small(), capped(8, cap_gib), TRAINING)
    par = result.best.parallelism
    assert par.zero_stage == 3 or par.pipeline_parallel_degree > 1
    assert result.best.predicted.peak_memory_bytes <= cap_gib * GIB
    ddp = [c for c in result.candidates
           if c.parallelism.zero_stage == 0 and c.parallelism.pipeline_parallel_degree == 1]
    assert ddp and all(not c.fits and c.reason.startswith("OOM by") for c in ddp)


def test_pins_are_respected():
    pins = Pins(pp=2, zero=3, schedule="gpipe", microbatch=2)
    result = search(gpt2_small(), cluster(8), TRAINING, pins)
    for c in result.candidates:
        par = c.parallelism
        assert (par.pipeline_parallel_degree, par.zero_stage, par.pipeline_parallel_schedule,
                par.pipeline_parallel_microbatch_size) == (2, 3, "gpipe", 2)
    best = result.best
    assert best.parallelism.data_parallel_shard_degree == 4 and best.parallelism.pipeline_parallel_num_microbatches == 8
    assert [m for s in best.stages for m in s.modules] == list(result.chain.fqns)


def test_fully_pinned_layout_reports_pinned_and_runs_the_milp_on_its_split():
    result = search(gpt2_small(), cluster(8), TRAINING, Pins(dp=2, pp=4, microbatch=4))
    assert result.solver.name == "pinned" and result.solver.status == "optimal"
    assert len(result.best.stages) == 4 and all(s.modules for s in result.best.stages)


@pytest.mark.parametrize("pins, num_gpus, batch, message", [
    (Pins(pp=3), 8, 64, "pp=3 does not divide 8 GPUs"),
    (Pins(dp=16), 16, 8, "dp=16 does not divide the global batch of 8"),
    (Pins(pp=32), 32, 64, "pp=32 exceeds the 16 layers"),
    (Pins(tp=2), 8, 64, "tensor parallelism is not supported yet"),
    (Pins(dp=2, pp=2), 8, 64, "dp=2 x pp=2 x tp=1 = 4, not 8 GPUs"),
    (Pins(dp=2, microbatch=3), 8, 64, "microbatch=3 does not divide the 32 samples per data-parallel rank"),
    (Pins(dp=2, pp=4, microbatch=16, schedule="1f1b"), 8, 64, "global batch 64 / dp=2 / microbatch=16 = 2"),
])
def test_pin_errors_show_the_arithmetic(pins, num_gpus, batch, message):
    with pytest.raises(UserError, match=re.escape(message)):
        search(gpt2_small(), cluster(num_gpus), Training(global_batch_size=batch), pins)


def test_pin_errors_are_gathered():
    with pytest.raises(UserError) as error:
        search(gpt2_small(), cluster(8), Training(global_batch_size=64), Pins(pp=3, dp=5, zero=2))
    message = str(error.value)
    assert "pp=3 does not divide 8 GPUs" in message and "dp=5 does not divide 8 GPUs" in message
    assert "zero=2 is not supported yet" in message


def test_infeasible_names_the_memory_needed_and_a_gpu_count_that_fits():
    with pytest.raises(Infeasible) as error:
        search(gpt2_small(), capped(8, 0.3), TRAINING)
    message = str(error.value)
    needed = float(re.search(r"needs ([\d.]+) GiB per GPU", message).group(1))
    count = int(re.search(r"; (\d+) GPUs would fit", message).group(1))
    assert needed > 0.3 and count > 8
    assert search(gpt2_small(), capped(8, needed + 0.1), TRAINING).best.fits
    with pytest.raises(Infeasible):
        search(gpt2_small(), capped(8, needed - 0.1), TRAINING)
    assert search(gpt2_small(), capped(count, 0.3), TRAINING).best.fits
    if count // 2 > 8:
        with pytest.raises(Infeasible):
            search(gpt2_small(), capped(count // 2, 0.3), TRAINING)


def test_infeasible_without_a_larger_count_says_so():
    with pytest.raises(Infeasible, match=r"no GPU count up to \d+ fits at global batch 64"):
        search(gpt2_small(), capped(8, 0.01), TRAINING)


def test_search_is_deterministic_and_fast():
    profile = gpt_profile(n_layer=12)
    started = time.perf_counter()
    first = search(profile, cluster(8), Training(global_batch_size=32), Pins(pp=4))
    assert time.perf_counter() - started < 1.0
    started = time.perf_counter()
    search(profile, cluster(8), Training(global_batch_size=32))
    assert time.perf_counter() - started < 1.0
    second = search(profile, cluster(8), Training(global_batch_size=32), Pins(pp=4))
    assert first.best == second.best and first.candidates == second.candidates


def test_pruned_layouts_are_listed_with_their_reason():
    result = search(gpt2_small(), capped(8, 1.0), TRAINING)
    pruned = [c for c in result.candidates if c.predicted is None]
    assert pruned and all("memory lower bound" in c.reason and not c.fits for c in pruned)


def test_estimate_prices_one_layout_with_the_optimal_or_given_split():
    par = Parallelism(data_parallel_replicate_degree=4, pipeline_parallel_degree=2,
                      pipeline_parallel_microbatch_size=4, pipeline_parallel_num_microbatches=4)
    chosen = estimate(gpt2_small(), cluster(8), TRAINING, par)
    assert chosen.parallelism == par and chosen.fits and len(chosen.stages) == 2
    fqns = chosen.stages[0].modules + chosen.stages[1].modules
    lopsided = (fqns[:2], fqns[2:])
    given = estimate(gpt2_small(), cluster(8), TRAINING, par, stage_modules=lopsided)
    assert given.stages[0].modules == fqns[:2]
    assert given.predicted.step_time_s > chosen.predicted.step_time_s
    with pytest.raises(UserError, match="in order"):
        estimate(gpt2_small(), cluster(8), TRAINING, par, stage_modules=(fqns[2:], fqns[:2]))


def test_cost_and_solve_never_import_torch():
    code = ("import sys, autoplan.solve.search, autoplan.solve.ilp, autoplan.cost.comm, autoplan.cost.compute; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
