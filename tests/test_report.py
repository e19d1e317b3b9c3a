"""report.html (self-contained, escaped, charts present) and trace.json (schedule semantics)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import replace
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
from report_fixtures import EVIL, SCALING, VERIFY, make_op, make_plan, make_profile, make_result, moe_result

from autoplan.plan import Stage
from autoplan.report.charts import Point, pareto_front
from autoplan.report.html import add_verification, write_report
from autoplan.report.rollup import OUTSIDE, module_times
from autoplan.report.schedule import makespan_s, step_schedule
from autoplan.report.svg import fmt_seconds
from autoplan.report.trace import write_trace


class PageParser(HTMLParser):
    """Collects start/end tags and attributes; fails on tags that would load or run anything."""

    def __init__(self):
        super().__init__()
        self.starts: list[str] = []
        self.ends: list[str] = []
        self.attributes: list[tuple[str, str, str]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.starts.append(tag)
        self.attributes += [(tag, name, value or "") for name, value in attrs]

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self.ends.append(tag)

    def handle_endtag(self, tag):
        self.ends.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def render(tmp_path, verify=VERIFY, scaling=SCALING, **plan_options) -> tuple[str, PageParser]:
    write_report(make_result(**plan_options), tmp_path, verify, scaling)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    parser = PageParser()
    parser.feed(page)
    parser.close()
    return page, parser


def test_report_parses_and_has_every_chart(tmp_path):
    page, parser = render(tmp_path)
    # summary breakdown, memory, modules, schedule, candidates, scaling, loss parity, predicted vs measured
    assert parser.starts.count("svg") == 8
    assert parser.starts.count("svg") == parser.ends.count("svg")
    for tag in ("html", "head", "body", "main", "table", "style"):
        assert parser.starts.count(tag) == parser.ends.count(tag) >= 1, tag
    ids = [value for _, name, value in parser.attributes if name == "id"]
    assert ids == ["summary", "memory", "modules", "schedule", "candidates", "why-not", "scaling", "verification"]
    assert "DP 2 × PP 2 (1F1B, 4 micro-batches of 1)" in page
    assert parser.starts.count("title") > 50  # tooltips on bars, blocks and dots


def test_report_is_offline(tmp_path):
    page, parser = render(tmp_path)
    for match in re.finditer(r"https?://", page):
        before = page[max(0, match.start() - 40):match.start()]
        assert re.search(r'xmlns(:\w+)?="$', before), f"network reference: {page[match.start():match.start() + 60]}"
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(parser.starts)
    assert not [a for a in parser.attributes if a[1] in ("src", "srcset") or a[1].startswith("on")]
    assert [value for _, name, value in parser.attributes if name == "href"] == [
        "#summary", "#memory", "#modules", "#schedule", "#candidates", "#why-not", "#scaling", "#verification"]
    assert "@import" not in page and "url(" not in page and "@font-face" not in page


def test_user_strings_are_escaped(tmp_path):
    page, parser = render(tmp_path)
    assert EVIL not in page
    assert "<script" not in page.lower()
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert page.count(escaped) >= 3  # module chart label and tooltip, why-not reason
    assert any(EVIL in chunk for chunk in parser.text)  # what the reader sees is the name itself


def test_sections_without_data_are_left_out(tmp_path):
    result = make_result()
    bare = SimpleNamespace(plan=replace(result.plan, alternatives=()), profile=None, candidates=())
    write_report(bare, tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    for section in ("modules", "candidates", "why-not", "scaling"):
        assert f'id="{section}"' not in page
    assert page.count("<svg") == 3  # summary breakdown, memory, schedule
    assert "Not run yet" in page


def test_add_verification_replaces_the_placeholder(tmp_path):
    write_report(make_result(), tmp_path)
    assert "Not run yet" in (tmp_path / "report.html").read_text(encoding="utf-8")
    add_verification(tmp_path, VERIFY)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "Not run yet" not in page and 'aria-label="loss parity"' in page and ">parity<" in page
    assert "predicted / measured = 0.86" in page
    diverged = {**VERIFY, "losses": [4.61, 4.3, 3.9, 3.6, 3.4, 3.2], "parity_max_abs_diff": 0.1}
    add_verification(tmp_path, diverged)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.count('id="verification"') == 1 and "NO parity" in page and "1.00e-01" in page


def test_module_times_roll_ops_up_to_stage_units():
    result = make_result()
    times = module_times(result.profile, result.plan.stages, microbatch=1)
    assert [t.module for t in times] == [m for s in result.plan.stages for m in s.modules]
    blocks0 = next(t for t in times if t.module == "blocks.0")
    # two ops (attn 1.5 ms + mlp 2 ms forward at batch 2), scaled to a micro-batch of 1
    assert blocks0.ops == 2
    assert blocks0.forward_s == pytest.approx(1.75e-3) and blocks0.backward_s == pytest.approx(3.5e-3)
    assert {t.stage for t in times if t.module in result.plan.stages[1].modules} == {1}
    assert times[-1].module == "lm_head" and times[-1].glue_ops == 1  # the root-level loss
    total = sum(op.time_fwd_s for op in result.profile.ops) / 2
    assert sum(t.forward_s for t in times) == pytest.approx(total)


def test_glue_ops_count_with_the_unit_before_them():
    stacks = [(), ("blocks", "blocks.0", "blocks.0.attn"), ("blocks", "blocks.0"),  # root glue, unit, residual add
              ("blocks", "blocks.0", "blocks.0.mlp"), ("blocks", "blocks.1", "blocks.1.attn"), ()]  # ..., loss
    ops = [make_op(i, stack, 2.0**i) for i, stack in enumerate(stacks)]
    profile = replace(make_profile(), ops=tuple(ops), batch_size=1)
    stages = (Stage(0, ("blocks.0.attn", "blocks.0.mlp"), 1.0, 1.0), Stage(1, ("blocks.1.attn",), 1.0, 1.0))
    times = module_times(profile, stages, microbatch=1)
    assert [(t.module, t.stage, t.forward_s, t.glue_ops) for t in times] == [
        ("blocks.0.attn", 0, 7.0, 2), ("blocks.0.mlp", 0, 8.0, 0), ("blocks.1.attn", 1, 48.0, 1)]
    assert module_times(profile, (Stage(0, (), 1.0, 1.0),), 1)[0].module == OUTSIDE


def test_pareto_front_keeps_only_undominated_points():
    points = [Point(1, 5, "a", True), Point(2, 3, "b", True), Point(3, 4, "c", True), Point(4, 1, "d", False),
              Point(2, 6, "e", True)]
    assert [p.tip for p in pareto_front(points)] == ["a", "b", "d"]


# ---- schedule and trace.json ----

def balanced(plan, stage_time_s=0.03, pipeline_comm_s=0.0):
    """The plan with equal stage times and only pipeline communication in the time breakdown."""
    stages = tuple(replace(s, predicted_time_s=stage_time_s) for s in plan.stages)
    predicted = replace(plan.predicted, time_breakdown={"pipeline_comm": pipeline_comm_s})
    return replace(plan, stages=stages, predicted=predicted)


def read_trace(tmp_path, plan):
    write_trace(plan, tmp_path)
    return json.loads((tmp_path / "trace.json").read_text())


def order_per_rank(trace) -> dict[int, list[str]]:
    order = defaultdict(list)
    for e in sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")),
                    key=lambda e: e["ts"]):
        order[e["pid"]].append(e["name"])
    return dict(order)


@pytest.mark.parametrize("schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_trace_is_valid_and_lanes_never_overlap(tmp_path, schedule, chunks):
    plan = make_plan(pp=4, microbatches=8, schedule=schedule, chunks=chunks, layers=14)
    trace = read_trace(tmp_path, plan)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == sorted({e["pid"] for e in complete}) == [0, 1, 2, 3]
    assert all(names[r].startswith(f"pipeline rank {r}") for r in names)
    assert {e["cat"] for e in complete} == {"forward", "backward", "send", "recv", "grad_sync"}
    assert {e["tid"] for e in complete if e["cat"] in ("forward", "backward")} == {0}
    assert {e["tid"] for e in complete if e["cat"] in ("send", "grad_sync")} == {1}
    assert {e["tid"] for e in complete if e["cat"] == "recv"} == {2}
    lanes = defaultdict(list)
    for e in complete:
        assert e["dur"] > 0 and e["ts"] >= 0
        lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for lane, spans in lanes.items():
        spans.sort()
        assert all(end <= nxt + 1e-6 for (_, end), (nxt, _) in zip(spans, spans[1:])), lane
    per_rank = 2 * 8 * chunks  # every micro-batch, forward and backward, on every chunk
    assert all(sum(1 for e in complete if e["pid"] == r and e["tid"] == 0) == per_rank for r in range(4))


def test_1f1b_runs_the_known_order(tmp_path):
    trace = read_trace(tmp_path, balanced(make_plan(pp=2, microbatches=4, schedule="1f1b"), pipeline_comm_s=0.004))
    assert order_per_rank(trace) == {
        0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    }


def test_gpipe_runs_all_forwards_first(tmp_path):
    trace = read_trace(tmp_path, balanced(make_plan(pp=2, microbatches=4, schedule="gpipe")))
    expected = ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert order_per_rank(trace) == {0: expected, 1: expected}


def test_schedule_respects_data_dependencies():
    plan = balanced(make_plan(pp=4, microbatches=6, schedule="1f1b"), pipeline_comm_s=0.006)
    events = step_schedule(plan)
    compute = {(e.kind, e.stage, e.microbatch): e for e in events if e.lane == "compute"}
    transfer = 0.006 / (2 * 6)
    for (kind, stage, mb), e in compute.items():
        if kind == "forward" and stage > 0:
            assert e.start_s >= compute[("forward", stage - 1, mb)].end_s + transfer - 1e-12
        if kind == "backward":
            before = compute[("backward", stage + 1, mb)] if stage < 3 else compute[("forward", stage, mb)]
            assert e.start_s >= before.end_s + (transfer if stage < 3 else 0) - 1e-12


@pytest.mark.parametrize("schedule, chunks, ranks, microbatches", [
    ("gpipe", 1, 4, 8), ("1f1b", 1, 4, 8), ("1f1b", 1, 2, 4), ("1f1b", 1, 1, 3), ("interleaved", 2, 4, 8),
    ("interleaved", 2, 2, 4)])
def test_step_time_matches_the_bubble_formula(schedule, chunks, ranks, microbatches):
    # Without communication a balanced pipeline takes (m + (p - 1) / v) stage times (formulas.md).
    per_rank_s = 0.03
    plan = balanced(make_plan(pp=ranks, microbatches=microbatches, schedule=schedule, chunks=chunks, layers=14),
                    stage_time_s=per_rank_s / chunks)
    expected = (microbatches + (ranks - 1) / chunks) * per_rank_s
    assert makespan_s(step_schedule(plan)) == pytest.approx(expected)


def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe():
    def in_flight(schedule):
        events = [e for e in step_schedule(balanced(make_plan(pp=4, microbatches=8, schedule=schedule)))
                  if e.rank == 0 and e.lane == "compute"]
        live = peak = 0
        for e in events:
            live += 1 if e.kind == "forward" else -1
            peak = max(peak, live)
        return peak

    assert in_flight("1f1b") == 4 and in_flight("gpipe") == 8


def test_gantt_draws_the_trace_events(tmp_path):
    plan = make_plan(pp=2, microbatches=4)
    trace = read_trace(tmp_path, plan)
    write_report(SimpleNamespace(plan=plan, profile=None, candidates=()), tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    gantt = re.search(r'<svg[^>]*aria-label="pipeline schedule".*?</svg>', page, re.S).group(0)
    blocks = re.findall(r"<title>rank (\d+): ([^\n<]*)", gantt)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(blocks) == sorted((str(e["pid"]), e["name"]) for e in complete)


def test_a_plan_with_uneven_stages_still_schedules_every_stage():
    plan = make_plan(pp=2, microbatches=4)
    plan = replace(plan, stages=plan.stages + (replace(plan.stages[-1], index=2),))
    events = step_schedule(plan)
    forwards = {(e.stage, e.microbatch) for e in events if e.kind == "forward"}
    assert forwards == {(s, m) for s in range(3) for m in range(4)}


def test_scaling_points_say_when_a_search_was_bounded_or_nothing_fits(tmp_path):
    scaling = [(2, None, "", "no layout fits"), (4, 350.0, "dp=4 tp=1 pp=1", ""),
               (8, 660.0, "dp=8 tp=1 pp=1", "bounded: best of the first 3 layouts by their time lower bound"),
               (16, 1150.0, "dp=16 tp=1 pp=1", "")]
    page, parser = render(tmp_path, scaling=scaling)
    section = page[page.index('id="scaling"'):page.index('id="verification"')]
    assert section.count("<svg") == 1 and "no layout fits" in section and "bounded: best of the first 3" in section
    assert "At 1 count the search stopped at its budget of layouts" in section
    assert section.count("<tr>") == 5  # header and one row per count, the one without a point included


def test_memory_section_shows_the_activations_the_layout_keeps_without_sequence_parallelism():
    from autoplan.report.html import memory_section

    plan = make_plan()
    assert "Sequence parallelism" not in memory_section(plan)
    predicted = replace(plan.predicted, memory_breakdown={**plan.predicted.memory_breakdown, "activations": 3 * 2**30},
                        activations_without_sequence_parallel_bytes=5 * 2**30)
    text = memory_section(replace(plan, predicted=predicted))
    assert "keeps 3 GiB of activations" in text and "(sp=off) would keep 5 GiB" in text


def test_experts_section_shows_the_best_layout_with_and_without_expert_parallelism(tmp_path):
    from autoplan.report.html import render_report

    result, chosen, whole = moe_result()
    page = render_report(result)
    start = page.index("Expert parallelism: why this layout")
    section = page[start:page.index("</section>", start)]
    rows = section.split("<tr")[2:]  # after the header
    assert len(rows) == 2 and "ep = 4 (chosen)" in rows[0] and "ep = 1" in rows[1]
    assert f">{fmt_seconds(0.011)}<" in rows[0] and f">{fmt_seconds(0.004)}<" in rows[0]  # compute, all-to-all
    assert ">8 GiB<" in rows[0] and ">9 GiB<" in rows[0]  # model states, activations
    # the fastest ep=1 layout that fits (1.3x, 30 GiB), not the faster one that does not
    assert fmt_seconds(whole.predicted.step_time_s) in rows[1] and ">30 GiB<" in rows[1]
    assert fmt_seconds(whole.predicted.time_breakdown["expert_compute"]) in rows[1]
    assert "Expert parallelism pays: the layout without it takes 1.30×" in section
    assert 'href="#experts"' in page


def test_experts_section_is_left_out_for_a_dense_model():
    from autoplan.report.html import experts_section, render_report

    result = make_result()
    assert "Expert parallelism: why this layout" not in render_report(result)
    assert experts_section(result.plan, result.candidates, result.candidates[0]) == ""


def test_experts_section_says_when_expert_parallelism_does_not_pay():
    from autoplan.report.html import experts_section

    result, chosen, whole = moe_result()
    faster = replace(whole, predicted=replace(whole.predicted, step_time_s=chosen.predicted.step_time_s / 2))
    section = experts_section(result.plan, (chosen, faster), chosen)
    assert "Expert parallelism does not pay: the layout with it takes 2.00× the step time of the layout without" \
        in section
    alone = experts_section(result.plan, (chosen,), chosen)
    assert "Only layouts with expert parallelism were priced" in alone and alone.count("<tr") == 2
