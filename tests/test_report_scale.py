"""Outputs that stay small at any scale (issue 29): a schedule past schedule.DRAWN_EVENTS blocks draws whole
micro-batches (first, steady state, last) block by block and aggregates the rest, and what it aggregates still adds
up to the whole schedule; the 1T GPT on 3072 A100s (512 micro-batches x 64 ranks) writes an output folder under 5 MB."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from report_fixtures import make_plan

from autoplan.report.html import write_report
from autoplan.report.schedule import DRAWN_EVENTS, LANES, schedule_view, step_schedule
from autoplan.report.trace import ELIDED, write_trace

FOLDER_BOUND_BYTES = 5 * 2**20
"""The 1T / 3072-GPU output folder (issue 29's bound)."""


def deep_plan():
    """8 ranks x 2 chunks x 128 micro-batches: about 12,000 blocks, past DRAWN_EVENTS."""
    return make_plan(pp=8, microbatches=128, schedule="interleaved", chunks=2, layers=30)


def read_trace(tmp_path: Path, plan) -> dict:
    write_trace(plan, tmp_path)
    return json.loads((tmp_path / "trace.json").read_text())


def totals(trace: dict) -> tuple[dict, dict]:
    """(stage, thread) -> busy microseconds and (rank, thread) -> blocks, drawn and elided events together."""
    busy, blocks = defaultdict(float), defaultdict(int)
    for e in trace["traceEvents"]:
        if e["ph"] != "X":
            continue
        if e["cat"] == ELIDED:
            for stage, us in e["args"]["busy_us_by_stage"].items():
                busy[int(stage), e["tid"]] += us
            blocks[e["pid"], e["tid"]] += e["args"]["blocks"]
        else:
            busy[e["args"].get("stage"), e["tid"]] += e["dur"]
            blocks[e["pid"], e["tid"]] += 1
    return dict(busy), dict(blocks)


def schedule_totals(plan) -> tuple[dict, dict, dict]:
    """totals() of the whole schedule, and (stage, thread) -> blocks."""
    busy, blocks, per_stage = defaultdict(float), defaultdict(int), defaultdict(int)
    for e in step_schedule(plan):
        busy[e.stage, LANES.index(e.lane)] += e.duration_s * 1e6
        blocks[e.rank, LANES.index(e.lane)] += 1
        per_stage[e.stage, LANES.index(e.lane)] += 1
    return dict(busy), dict(blocks), dict(per_stage)


def assert_totals_match(trace: dict, plan) -> None:
    busy, blocks = totals(trace)
    full_busy, full_blocks, per_stage = schedule_totals(plan)
    assert blocks == full_blocks
    assert busy.keys() == full_busy.keys()
    for key, us in full_busy.items():  # trace.json rounds to nanoseconds (0.001 us) once or twice a block
        assert busy[key] == pytest.approx(us, rel=1e-9, abs=2e-3 * per_stage[key]), key


def test_a_deep_schedule_draws_first_middle_and_last_microbatches_and_aggregates_the_rest(tmp_path):
    plan = deep_plan()
    full = step_schedule(plan)
    assert len(full) > DRAWN_EVENTS
    trace = read_trace(tmp_path, plan)
    drawn = trace["otherData"]["drawn_microbatches"]
    assert 0 in drawn and 127 in drawn and any(40 < mb < 88 for mb in drawn) and len(drawn) < 128
    assert "elided" in trace["otherData"]["elided"]
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    elided = [e for e in complete if e["cat"] == ELIDED]
    assert elided and len(complete) < len(full) / 2
    for mb in drawn:  # a drawn micro-batch has every one of its blocks
        assert sum(1 for e in complete if e["args"].get("microbatch") == mb) == sum(
            1 for e in full if e.microbatch == mb)
    assert all(e["args"]["microbatches"][0] not in drawn for e in elided)
    lanes = defaultdict(list)
    for e in complete:  # elided runs sit between the drawn blocks of their lane, never over them
        lanes[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for lane, spans in lanes.items():
        spans.sort()
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(spans, spans[1:])), lane


def test_the_elided_trace_adds_up_to_the_whole_schedule_per_stage(tmp_path):
    plan = deep_plan()
    trace = read_trace(tmp_path, plan)
    assert any(e["ph"] == "X" and e["cat"] == ELIDED for e in trace["traceEvents"])
    assert_totals_match(trace, plan)
    view = schedule_view(plan)
    busy = view.lane_busy_s()
    for (rank, lane), seconds in busy.items():  # busy + idle = the step on every lane
        assert 0 < seconds <= view.makespan_s + 1e-12, (rank, lane)


def test_the_report_labels_what_it_elides_and_draws_the_trace_events(tmp_path):
    plan = deep_plan()
    trace = read_trace(tmp_path, plan)
    write_report(SimpleNamespace(plan=plan, profile=None, candidates=()), tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<strong>Elided</strong>: micro-batches 0" in page and "elided (aggregated)" in page
    gantt = re.search(r'<svg[^>]*aria-label="pipeline schedule".*?</svg>', page, re.S).group(0)
    blocks = re.findall(r"<title>rank (\d+): ([^\n<(]*[^\n<( ])", gantt)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(blocks) == sorted((str(e["pid"]), e["name"]) for e in complete)
    table = re.search(r"Totals per pipeline rank.*?</table>", page, re.S).group(0)
    assert len(re.findall(r"<tr><td", table)) == 8


def test_a_small_schedule_is_drawn_whole(tmp_path):
    plan = make_plan(pp=4, microbatches=8, schedule="interleaved", chunks=2, layers=14)
    trace = read_trace(tmp_path, plan)
    assert "elided" not in trace["otherData"] and "drawn_microbatches" not in trace["otherData"]
    assert all(e["cat"] != ELIDED for e in trace["traceEvents"] if e["ph"] == "X")
    write_report(SimpleNamespace(plan=plan, profile=None, candidates=()), tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "Elided" not in page and "Totals per pipeline rank" not in page


@pytest.mark.slow
def test_the_1t_gpt_on_3072_gpus_writes_an_output_folder_under_5_mb(tmp_path):
    """The published layout (tp=8, pp=64, dp=6, interleaved, 512 micro-batches) through write_outputs, planned with
    the search's MILP time limit; its trace still adds up to the whole schedule."""
    from chain_fixtures import read_runs, run_cluster, run_pins, run_profile

    from autoplan.api import PlanResult, write_outputs
    from autoplan.layout import ALL_FEATURES
    from autoplan.plan import ClusterRef, ModelRef, Plan, Training
    from autoplan.solve.pins import parse_pins
    from autoplan.solve.search import ILP_TIME_LIMIT_S, SearchOptions, search

    tests = Path(__file__).parent
    one_t = next(r for r in read_runs(tests / "fixtures" / "published_runs.csv") if r["pp"] == "64")
    profile, cluster = run_profile(one_t), run_cluster(one_t)
    training = Training(global_batch_size=int(one_t["global_batch_seqs"]), dtype="bf16")
    result = search(profile, cluster, training, parse_pins(run_pins(one_t)),
                    options=SearchOptions(time_limit_s=ILP_TIME_LIMIT_S, features=ALL_FEATURES))
    best = result.best
    assert (best.parallelism.pp, best.parallelism.microbatches) == (64, 512)
    model_file = tests.parent / "benchmarks" / "models" / "megatron_gpt.py"
    plan = Plan(model=ModelRef(str(model_file), "build_model", profile.param_count),
                cluster=ClusterRef(cluster.gpu.name, cluster.num_gpus, cluster.gpus_per_node,
                                   cluster.usable_memory_bytes),
                training=training, parallelism=best.parallelism, stages=best.stages, predicted=best.predicted,
                solver=result.solver, tensor_parallel_plan=dict(best.tensor_parallel_plan),
                activation_checkpoint_modules=tuple(best.activation_checkpoint_modules))
    out = tmp_path / "out"
    write_outputs(PlanResult(plan, profile, tuple(result.candidates)), out, model_file)
    sizes = {str(f.relative_to(out)): f.stat().st_size for f in out.rglob("*") if f.is_file()}
    assert sum(sizes.values()) < FOLDER_BOUND_BYTES, sizes
    trace = json.loads((out / "trace.json").read_text())
    assert_totals_match(trace, plan)


def test_modules_csv_counts_each_parameter_under_every_enclosing_module():
    """modules.csv's param_count, summed in one pass over the parameter names, equals the count by prefix for every
    module (a module "blocks.1" does not count "blocks.10"'s parameters)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from chain_fixtures import gpt_profile

    from autoplan.report.csv import modules_frame

    profile = gpt_profile(n_layer=12)
    frame = modules_frame(profile)
    for module, count in zip(frame.module, frame.param_count):
        prefix = "" if module == "(model)" else module + "."
        assert count == sum(n for name, n in profile.parameters.items() if name.startswith(prefix)), module
    counts = dict(zip(frame.module, frame.param_count))
    assert 0 < counts["blocks.1"] < counts["blocks.1"] + counts["blocks.10"] < counts["(model)"]
