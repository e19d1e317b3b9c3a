"""Layout search: known results (ample memory -> DDP, tight -> sharding or pipeline, more DP beats
more PP or TP), pins, the switch list, errors with arithmetic, Infeasible, estimate."""

import re
from dataclasses import replace
from functools import lru_cache

import pytest
from chain_fixtures import GIB, a100_cluster, cluster, gpt_profile

from autoplan.chain.modules import build_chain
from autoplan.cost.evaluate import build_problem
from autoplan.errors import Infeasible, UserError
from autoplan.layout import SUPPORTED, Layout
from autoplan.plan import Parallelism, Training
from autoplan.solve.pins import parse_pins
from autoplan.solve import search as search_module
from autoplan.solve.ilp import IlpResult
from autoplan.solve.search import SearchOptions, search, solver_warning


@lru_cache(maxsize=None)
def gpt2_small():
    """About GPT-2 small: 124M parameters, 16 modules."""
    return gpt_profile(n_layer=12, n_embd=768, vocab=50257, seq=1024, batch=1, n_head=12)


def capped(num_gpus: int, gib: float):
    return replace(cluster(num_gpus), memory_per_gpu_bytes=gib * GIB)


TRAINING = Training(global_batch_size=64, dtype="bf16")


def test_parse_pins_reads_every_key():
    pins = parse_pins("tp=8, pp=4,dp=2,zero=3,schedule=1F1B,microbatch=1,recompute=full")
    assert pins == Layout(dp=2, tp=8, pp=4, zero=3, schedule="1f1b", microbatch=1, recompute="full")
    assert parse_pins("") == Layout()


def test_parse_pins_lists_every_problem_at_once():
    with pytest.raises(UserError) as error:
        parse_pins("tp=x,foo=1,zero=5,schedule=zb,pp=0,dp,dp=2,dp=4")
    message = str(error.value)
    for part in ("tp=x is not an integer", "unknown key 'foo'", "zero=5 is not one of 0, 1, 2, 3",
                 "schedule=zb is not one of", "pp=0 must be at least 1", "'dp' is not key=value",
                 "'dp' is given twice"):
        assert part in message


def test_pin_keys_and_their_value_kinds_come_from_the_vocabulary():
    """PIN_KEYS is VOCABULARY's pins in its order (the message and --help list them so); word values are Layout's
    str fields, read lower-cased, the others integers."""
    from autoplan.layout import VOCABULARY
    from autoplan.solve.pins import PIN_KEYS

    known = "dp, tp, sp, cp, ep, pp, zero, schedule, microbatch, recompute, offload, compile"
    assert ", ".join(PIN_KEYS) == known
    assert PIN_KEYS == tuple(t.short for t in VOCABULARY if t.pin)
    with pytest.raises(UserError, match=rf"unknown key 'foo' \(known: {known}\)"):
        parse_pins("foo=1")
    assert parse_pins("SP=ON,Schedule=ZBV,offload=CPU,compile=On,recompute=FULL,zero=3,microbatch=2") == Layout(
        sp="on", schedule="zbv", offload="cpu", compile="on", recompute="full", zero=3, microbatch=2)
    with pytest.raises(UserError, match="microbatch=two is not an integer"):
        parse_pins("microbatch=two")


def test_ample_memory_picks_pure_data_parallelism_without_resharding():
    result = search(gpt2_small(), cluster(8), TRAINING)
    par = result.best.parallelism
    assert (par.dp, par.pp, par.tp,
            par.recompute) == (8, 1, 1, "none")
    # parameters fit, so none are re-gathered per forward; sharding the optimizer state (ZeRO-1/2) may
    # still win: AdamW streams 28 B per parameter (fused), 8x less of it per rank
    assert not par.reshards_after_forward
    assert result.best.fits and result.best.reason == "" and len(result.best.stages) == 1
    assert result.solver.status == "optimal" and result.solver.candidates_evaluated >= len(result.candidates)
    assert all(c.reason for c in result.candidates[1:])


def test_memory_below_the_replicated_model_state_forces_sharding_or_a_pipeline():
    replicated = 16 * build_chain(gpt2_small()).parameter_numel
    cap_gib = 0.75 * replicated / GIB
    result = search(gpt2_small(), capped(8, cap_gib), TRAINING)
    par = result.best.parallelism
    assert par.fsdp_enabled or par.pp > 1 or par.tp > 1
    assert result.best.predicted.peak_memory_bytes <= cap_gib * GIB
    ddp = [c for c in result.candidates if not c.parallelism.fsdp_enabled and c.parallelism.world_size == 8
           and c.parallelism.dp == 8]
    assert ddp and all(not c.fits and c.reason.startswith("OOM by") for c in ddp)


def test_more_data_parallelism_beats_more_pipeline_or_tensor_parallelism_for_a_5_9b_gpt_on_64_gpus():
    """Narayanan et al. SC21 Fig. 13-14: at 64 A100s a 5.9B GPT trains fastest with the most data
    parallelism the memory allows."""
    profile = gpt_profile(n_layer=32, n_embd=3840, vocab=51200, seq=2048, batch=1, n_head=32, device="a100-sxm4-80gb")
    training = Training(global_batch_size=512, dtype="bf16")

    def best(**pins):
        return search(profile, a100_cluster(64), training, Layout(**pins)).best.predicted.step_time_s

    data = best(tp=1, pp=1)
    assert data < best(pp=2, tp=1) and data < best(tp=2, pp=1) and data < best(pp=4, tp=2)
    chosen = search(profile, a100_cluster(64), training).best.parallelism
    assert chosen.dp == 64


def test_pins_are_respected():
    pins = Layout(pp=2, zero=3, schedule="gpipe", microbatch=2)
    result = search(gpt2_small(), cluster(8), TRAINING, pins)
    for c in result.candidates:
        par = c.parallelism
        assert (par.pp, par.reshards_after_forward, par.schedule,
                par.microbatch) == (2, True, "gpipe", 2)
    best = result.best
    assert best.parallelism.dp == 4 and best.parallelism.microbatches == 8
    assert [m for s in best.stages for m in s.modules] == list(result.chain.fqns)


def test_interleaved_pins_give_p_times_v_stages_on_ranks_in_turn():
    result = search(gpt2_small(), cluster(8), TRAINING, Layout(pp=2, schedule="interleaved", microbatch=4, dp=4))
    par = result.best.parallelism
    v = par.virtual_stages
    assert v >= 2 and len(result.best.stages) == 2 * v
    assert par.microbatches % 2 == 0
    memory = [s.predicted_memory_bytes for s in result.best.stages]
    assert memory[0::2] == [memory[0]] * v  # stage s runs on rank s % p: its rank's memory


def test_the_switch_list_turns_features_off():
    without = SUPPORTED - {"zero2", "tp", "interleaved"}
    result = search(gpt2_small(), capped(8, 0.9), TRAINING, options=SearchOptions(features=without))
    assert all(not (c.parallelism.fsdp_enabled and not c.parallelism.reshards_after_forward)
               and c.parallelism.tp == 1
               and c.parallelism.schedule != "interleaved" for c in result.candidates)
    with pytest.raises(UserError, match="zero=2 is not supported yet"):
        search(gpt2_small(), cluster(8), TRAINING, Layout(zero=2), options=SearchOptions(features=without))


def test_fully_pinned_layout_reports_pinned_and_runs_the_milp_on_its_split():
    result = search(gpt2_small(), cluster(8), TRAINING, Layout(dp=2, pp=4, microbatch=4))
    assert result.solver.name == "pinned" and result.solver.status == "optimal"
    assert len(result.best.stages) == 4 and all(s.modules for s in result.best.stages)


def test_recompute_is_chosen_per_module_when_memory_needs_some():
    profile = gpt_profile(n_layer=12, n_embd=512, vocab=1024, seq=1024, batch=1, n_head=8, device="testgpu")
    # DDP pinned: with 20% less memory the layout must recompute (FSDP would fit by sharding instead)
    pins = Layout(dp=8, pp=1, microbatch=8, zero=0)
    roomy = search(profile, cluster(8), Training(global_batch_size=64, dtype="bf16"), pins)
    needed = roomy.best.predicted.peak_memory_bytes
    tight = replace(cluster(8), memory_per_gpu_bytes=0.8 * needed)
    result = search(profile, tight, Training(global_batch_size=64, dtype="bf16"), pins)
    best = result.best
    assert best.parallelism.recompute in ("selective", "full")
    assert 0 < len(best.activation_checkpoint_modules) < len(result.chain)  # some modules, not all
    assert best.predicted.time_breakdown["recompute"] > 0 and best.predicted.peak_memory_bytes <= 0.8 * needed


@pytest.mark.parametrize("pins, num_gpus, batch, message", [
    (Layout(pp=3), 8, 64, "pp=3 does not divide 8 GPUs"),
    (Layout(dp=16), 16, 8, "dp=16 does not divide the global batch of 8"),
    (Layout(pp=32), 32, 64, "pp=32 exceeds the 16 modules the model splits into"),
    (Layout(tp=8), 8, 64, "tp=8 does not divide 12 attention heads"),
    (Layout(tp=16), 16, 64, "tp=16 does not divide the 8 GPUs of a node"),
    (Layout(dp=2, pp=2, tp=1), 8, 64, "dp=2 x tp=1 x pp=2 = 4, not 8 GPUs"),
    (Layout(dp=2, microbatch=3), 8, 64, "microbatch=3 does not divide the 32 samples per data-parallel rank"),
    (Layout(dp=2, pp=4, microbatch=16, schedule="1f1b"), 8, 64, "global batch 64 / dp=2 / microbatch=16 = 2"),
    (Layout(dp=2, pp=4, microbatch=2, schedule="interleaved"), 8, 24, "needs a multiple of pp=4 micro-batches"),
])
def test_pin_errors_show_the_arithmetic(pins, num_gpus, batch, message):
    megatron_tp = SUPPORTED | {"tp_fused_split"}  # gpt2_small fuses q, k, v: its heads split as in Megatron-LM
    with pytest.raises(UserError, match=re.escape(message)):
        search(gpt2_small(), cluster(num_gpus), Training(global_batch_size=batch), pins,
               options=SearchOptions(features=megatron_tp))


def test_pin_errors_are_gathered():
    with pytest.raises(UserError) as error:
        search(gpt2_small(), cluster(8), Training(global_batch_size=64), Layout(pp=3, dp=5, tp=8),
               options=SearchOptions(features=SUPPORTED | {"tp_fused_split"}))
    message = str(error.value)
    assert "pp=3 does not divide 8 GPUs" in message and "dp=5 does not divide 8 GPUs" in message
    assert "tp=8 does not divide 12 attention heads" in message


def test_infeasible_names_the_memory_needed_and_a_gpu_count_that_fits():
    with pytest.raises(Infeasible) as error:
        search(gpt2_small(), capped(8, 0.5), TRAINING)
    message = str(error.value)
    needed = float(re.search(r"needs ([\d.]+) GiB per GPU", message).group(1))
    count = int(re.search(r"; (\d+) GPUs would fit", message).group(1))
    assert needed > 0.5 and count > 8
    assert search(gpt2_small(), capped(8, needed + 0.01), TRAINING).best.fits
    assert search(gpt2_small(), capped(count, 0.5), TRAINING).best.fits


def test_infeasible_without_a_larger_count_says_so():
    with pytest.raises(Infeasible, match=r"no GPU count up to \d+ fits at global batch 64"):
        search(gpt2_small(), capped(8, 0.001), TRAINING)


def test_search_is_deterministic():
    # how fast these searches are: benchmarks/search_time.py
    profile = gpt_profile(n_layer=12)
    first = search(profile, cluster(8), Training(global_batch_size=32), Layout(pp=4))
    assert search(profile, cluster(8), Training(global_batch_size=32)).best.fits
    second = search(profile, cluster(8), Training(global_batch_size=32), Layout(pp=4))
    assert first.best == second.best and first.candidates == second.candidates


def test_pruned_layouts_are_listed_with_their_reason():
    result = search(gpt2_small(), capped(8, 0.9), TRAINING)
    pruned = [c for c in result.candidates if c.predicted is None]
    assert pruned and all("memory lower bound" in c.reason and not c.fits for c in pruned)


def test_a_layout_whose_leanest_split_fits_is_planned_when_the_packing_finds_none(monkeypatch):
    """The fast packing is a heuristic: when it finds no split, the leanest split decides. If that one
    fits, the layout fits (priced at it), so "no layout fits" never names a layout within the memory. (Priced at
    their leanest splits, the pinned layout's variants, its ZeRO stage and schedule, may rank otherwise than the
    packing's splits rank them: the pinned degrees are what must hold.)"""
    pins = parse_pins("dp=4,pp=2,microbatch=4")
    monkeypatch.setattr(search_module, "greedy_split", lambda *args, **kwargs: None)
    found = search(gpt2_small(), cluster(8), TRAINING, pins)
    p = found.best.parallelism
    assert found.best.fits and found.best.predicted is not None
    assert (p.dp, p.pp, p.microbatch) == (4, 2, 4)
    with pytest.raises(Infeasible) as error:
        search(gpt2_small(), capped(8, 0.5), TRAINING, pins)
    needed = float(re.search(r"needs ([0-9.]+) GiB per GPU", str(error.value)).group(1))
    assert needed > 0.5


def test_no_plan_and_no_layout_called_fitting_is_over_the_memory_cap():
    """Issue 26: the packing took the largest per-module sum of the transient terms where the plan's memory takes
    each category's maximum: with FSDP's gathered parameters peaking on the widest block and the working set on
    the head, layouts with per-module recompute were called fitting and planned over the cap (Qwen3-30B-A3B on
    64 H100s: 74.99 GiB of 74.5). Caps between the leanest split and the no-recompute one plant the case."""
    profile = gpt_profile(n_layer=4, n_embd=2048, vocab=8192, seq=1024, batch=1, n_head=16)
    training = Training(global_batch_size=8, dtype="bf16")
    pins = parse_pins("dp=8,zero=3,pp=1,microbatch=1,offload=none")
    ample = search(profile, cluster(8), training, pins)
    problem = build_problem(ample.context, ample.best.parallelism, ("none", "selective", "full"))
    peaks = [max(range(problem.num_modules), key=vec.__getitem__) for vec in problem.memory[0].max_vectors]
    assert len(set(peaks)) == 2, "the two transient categories peak on different modules"
    lean, top = problem.memory_lower_bound(), ample.best.predicted.peak_memory_bytes
    for fraction in (0.1, 0.4, 0.85):
        cap = lean + (top - lean) * fraction
        result = search(profile, replace(cluster(8), memory_per_gpu_bytes=cap), training, pins)
        assert result.best.fits and result.best.predicted.peak_memory_bytes <= cap
        assert all(c.predicted.peak_memory_bytes <= cap for c in result.candidates if c.fits)


def test_a_milp_without_a_split_is_reported_as_what_it_said_not_as_a_time_limit(monkeypatch):
    """Issue 26: a MILP that found the layout infeasible was reported as "the solver hit the None s time limit ...
    within 100.0% of optimal". The status is what the MILP said; the gap, the kept split's to the lower bound; a
    time limit names the limit it ran under."""
    said = IlpResult(assignment=None, objective=None, status="infeasible", gap=0.0, solver="highs", backend="HiGHS",
                     time_s=0.1)
    monkeypatch.setattr(search_module, "solve_ilp", lambda *args, **kwargs: said)
    result = search(gpt2_small(), cluster(8), TRAINING, parse_pins("dp=4,pp=2,microbatch=4"))
    assert result.best.fits and result.solver.status == "infeasible" and 0.0 <= result.solver.gap < 1.0
    warning = solver_warning(result.solver, None)
    assert warning.startswith("the MILP reported no stage split within the memory cap, though the packing's split")
    assert "time limit" not in warning and "None" not in warning and f"{100 * result.solver.gap:.1f}%" in warning
    timed = replace(result.solver, status="time_limit", gap=0.02)
    assert solver_warning(timed, None) == ("the MILP stopped at its 10 s time limit (--time-limit): the stage split "
                                           "planned is the best found, its slowest rank's time within 2.0% of the optimum's")
    assert "its 2.5 s time limit" in solver_warning(timed, 2.5)
    assert solver_warning(replace(result.solver, status="optimal", gap=0.0), None) == ""


def test_ties_rank_a_layout_sharded_over_context_parallel_ranks_by_its_zero_stage():
    """_simplicity ranks sharding by Parallelism.zero (over fsdp_shard = dp_shard x cp): with cp=2 and dp_shard=1
    the model states are FSDP-sharded, so keeping the gathered parameters (ZeRO-2) is simpler than resharding
    after forward (ZeRO-3), and HSDP over dp_replicate counts as HSDP."""
    from types import SimpleNamespace

    from autoplan.cost.evaluate import Candidate
    from autoplan.solve.search import _simplicity

    def candidate(reshard: bool) -> Candidate:
        par = Parallelism(dp_replicate=2, cp=2, reshard=reshard)
        return Candidate(par, (), SimpleNamespace(step_time_s=1.0), True, "")

    kept, resharded = candidate(False), candidate(True)
    assert (kept.parallelism.zero, resharded.parallelism.zero) == (2, 3)
    assert _simplicity(kept) < _simplicity(resharded)
    assert _simplicity(kept)[6] is True  # HSDP: replicated over dp_replicate, sharded over dp_shard x cp
