"""report.html: one self-contained page (inline CSS and SVG, no scripts, no fonts, no network).

Every string that comes from the user's model or the planner (module names, reasons) goes through
html.escape; charts are drawn by autoplan.report.charts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from autoplan.layout import SCHEDULE_BY_NAME
from autoplan.plan import Alternative
from autoplan.report import charts, verify_view
from autoplan.report.rollup import (chosen_candidate, describe_layout, ideal_scaling, plural, memory_segments,
                                    module_times, ranked_candidates)
from autoplan.report.schedule import (COMMUNICATION, COMPUTE, RECEIVE, ScheduleView, number_ranges,
                                       schedule_view)
from autoplan.report.svg import ACCENT, esc, fmt_bytes, fmt_number, fmt_seconds
from autoplan.solve.alternatives import fastest_by_expert_split

PARITY_TOLERANCE = 1e-4
"""|loss difference| allowed between the distributed program and the reference, fp32 (autoplan.verify.PARITY_TOLERANCE)."""
TABLE_ROWS = 20
"""Candidates shown before the rest fold into <details>."""
VERIFY_BEGIN, VERIFY_END = "<!-- verify:begin -->", "<!-- verify:end -->"
NOT_VERIFIED = ('<section id="verification"><h2>Verification</h2><p class="lead">Not run yet: '
                "<code>autoplan verify OUT_DIR</code> runs the generated program on CPU processes and adds "
                "loss parity (and, with <code>--measure</code>, measured step time) here.</p></section>")

CSS = """
:root{--ink:#243b53;--muted:#627d98;--line:#e4e9ef;--bg:#f5f7fa;--accent:#4e79a7;--warn:#c0392b;--ok:#2f855a}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
 font:15px/1.55 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1040px;margin:0 auto;padding:28px 24px 64px}
header{margin:4px 0 18px}
h1{font-size:26px;margin:0;letter-spacing:-.01em}
h1 code{font-size:inherit;font-weight:inherit}
.u{font-size:13px;font-weight:500;color:var(--muted);margin-left:4px}
h2{font-size:18px;margin:0 0 2px}
.sub,.lead{color:var(--muted)}
.lead{margin:0 0 14px;font-size:14px}
nav{margin-top:10px;font-size:13px}
nav a{color:var(--accent);text-decoration:none;margin-right:14px}
section{background:#fff;border:1px solid var(--line);border-radius:10px;padding:20px 24px;margin:18px 0}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(180px,1fr));gap:12px;margin-bottom:16px}
.card{border:1px solid var(--line);border-radius:8px;padding:10px 14px}
.k{font-size:11.5px;text-transform:uppercase;letter-spacing:.05em;color:var(--muted)}
.v{font-size:22px;font-weight:650;font-variant-numeric:tabular-nums;line-height:1.3}
.card .sub{font-size:12.5px}
.layout{font-size:17px;font-weight:600;margin:0 0 14px}
.gauge{height:8px;background:var(--line);border-radius:4px;overflow:hidden;margin-top:6px}
.gauge span{display:block;height:100%;background:var(--accent)}
.gauge span.full{background:var(--warn)}
svg.chart{max-width:100%;height:auto;display:block;margin:6px 0 4px;font-family:inherit}
table{border-collapse:collapse;width:100%;font-size:13px;font-variant-numeric:tabular-nums}
th,td{padding:6px 8px;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
th{font-weight:600;color:var(--muted);font-size:11.5px;text-transform:uppercase;letter-spacing:.04em}
td.n,th.n{text-align:right;white-space:nowrap}
th.g{text-align:center}
tr.chosen td{background:#eef4fb;font-weight:600}
details summary{cursor:pointer;color:var(--accent);margin:8px 0;font-size:13px}
.badge{display:inline-block;padding:0 8px;border-radius:10px;font-size:12px;font-weight:600}
.ok{background:#e3f4ea;color:var(--ok)}.bad{background:#fbeaea;color:var(--warn)}
ol.why{padding-left:20px;margin:0}ol.why li{margin:0 0 10px}
.why .reason{color:var(--muted);font-size:14px}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
h3{font-size:15px;margin:22px 0 2px}
pre{white-space:pre-wrap;font-size:12px;color:var(--warn)}
footer{color:var(--muted);font-size:12.5px;text-align:center;margin-top:28px}
"""


def write_report(result, out_dir: Path, verify: dict | None = None, scaling: list[tuple] | None = None) -> None:
    """Write out_dir/report.html for a PlanResult (plan, profile, candidates).

    verify is the parsed verify.json (adds loss parity and predicted vs measured); scaling is
    [(num_gpus, samples_per_s), ...] or autoplan.solve.scaling.ScalingPoint from searching other GPU counts (adds the
    scaling curve; scaling_section).
    """
    Path(out_dir, "report.html").write_text(render_report(result, verify, scaling), encoding="utf-8")


def add_verification(out_dir: Path, verify: dict) -> None:
    """Put (or replace) the verification section of an existing out_dir/report.html (for `autoplan verify`,
    which has the output folder but not the profile and candidates the rest of the page needs)."""
    path = Path(out_dir, "report.html")
    page = path.read_text(encoding="utf-8")
    block = f"{VERIFY_BEGIN}{verify_section(verify)}{VERIFY_END}"
    pattern = re.compile(re.escape(VERIFY_BEGIN) + ".*?" + re.escape(VERIFY_END), re.S)
    path.write_text(pattern.sub(lambda _: block, page, count=1), encoding="utf-8")


def render_report(result, verify: dict | None = None, scaling: list[tuple] | None = None) -> str:
    plan = result.plan
    candidates = tuple(result.candidates or ())
    best = chosen_candidate(candidates, plan)
    sections = [
        ("summary", "Summary", summary_section(plan)),
        ("memory", "Memory", memory_section(plan)),
        ("experts", "Experts", experts_section(plan, candidates, best)),
        ("tensor-parallel", "Tensor parallel", tensor_parallel_section(plan)),
        ("modules", "Time per module", modules_section(result)),
        ("schedule", "Schedule", schedule_section(plan)),
        ("candidates", "Candidates", candidates_section(plan, candidates, best)),
        ("why-not", "Why not", why_not_section(plan, candidates, best, getattr(result, "parameter_server", None))),
        ("scaling", "Scaling", scaling_section(scaling) if scaling else ""),
    ]
    nav = "".join(f'<a href="#{key}">{title}</a>' for key, title, body in sections if body)
    body = "".join(f'<section id="{key}">{html}</section>' for key, _, html in sections if html)
    verify_html = verify_section(verify) if verify else NOT_VERIFIED
    model = Path(plan.model.path).name or plan.model.path
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>autoplan · {esc(model)}</title><style>{CSS}</style></head><body><main>"
        f"<header><h1>autoplan plan for <code>{esc(model)}</code></h1>"
        f'<div class="sub">{esc(plan.model.path)} · {fmt_number(plan.model.param_count)} parameters · '
        f"{plan.cluster.num_gpus} × {esc(plan.cluster.gpu)} ({plan.cluster.gpus_per_node} per node) · "
        f"global batch {plan.training.global_batch_size} · {esc(plan.training.dtype)}</div>"
        f'<nav>{nav}<a href="#verification">Verification</a></nav></header>'
        f"{body}{VERIFY_BEGIN}{verify_html}{VERIFY_END}"
        f"<footer>Predicted by autoplan (solver {esc(plan.solver.name)}, {esc(plan.solver.status)}, "
        f"{plan.solver.candidates_evaluated} candidates in {plan.solver.time_s:.2f} s). "
        "Data behind every chart: plan.json, ops.csv, modules.csv, candidates.csv, trace.json.</footer>"
        "</main></body></html>"
    )


def _card(key: str, value: str, sub: str = "", extra: str = "") -> str:
    return f'<div class="card"><div class="k">{key}</div><div class="v">{value}</div>' \
           f'<div class="sub">{sub}</div>{extra}</div>'


def summary_section(plan) -> str:
    pred, cap = plan.predicted, plan.cluster.memory_per_gpu_bytes
    used = pred.peak_memory_bytes / cap if cap > 0 else 0.0
    gauge = f'<div class="gauge"><span class="{"full" if used > 1 else ""}" ' \
            f'style="width:{min(100.0, used * 100):.1f}%"></span></div>'
    tokens = f"{fmt_number(pred.tokens_per_s)} tokens per second" if pred.tokens_per_s else ""
    cards = "".join([
        _card("Step time", fmt_seconds(pred.step_time_s), f"{plan.training.global_batch_size} samples per step"),
        _card("Throughput", f'{fmt_number(pred.samples_per_s)}<span class="u">samples/s</span>', tokens),
        _card("MFU", f"{pred.mfu * 100:.1f}%", f"{fmt_number(pred.model_flops_per_step, 'FLOP')} per step"),
        _card("Memory per GPU", fmt_bytes(pred.peak_memory_bytes),
              f"{used * 100:.0f}% of {fmt_bytes(cap)} (most loaded rank)", gauge),
    ])
    html = (f'<h2>Summary</h2><p class="lead">The chosen layout and what it is predicted to do.</p>'
            f'<p class="layout">{esc(describe_layout(plan.parallelism))}</p><div class="cards">{cards}</div>')
    breakdown = [(k, v) for k, v in pred.time_breakdown.items() if v > 0]
    if breakdown:
        row = charts.BarRow("one step", tuple(breakdown))
        html += '<p class="lead">Where the step time goes (hover for values).</p>' + charts.stacked_bars(
            [row], charts.Axis("seconds per optimizer step", fmt_seconds), "step time breakdown", row_height=34)
    return html


def tensor_parallel_section(plan) -> str:
    """With tp > 1: the Linears split (by style) and every block left whole, with the op and the reason."""
    from autoplan.chain.tensor_parallel import split_lines

    if plan.parallelism.tp <= 1:
        return ""
    split = "".join(f"<li>{esc(line)}</li>" for line in split_lines(plan.tensor_parallel_plan))
    rows = "".join(f"<tr><td>{esc(', '.join(b.modules))}</td><td><code>{esc(b.op)}</code> in "
                   f"{esc(b.op_module or 'the model')}</td><td>{esc(b.reason)}</td></tr>"
                   for b in plan.tensor_parallel_left_whole)
    whole = (f"<h3>Left whole (replicated on every tensor-parallel rank)</h3><table><thead><tr><th>Linears</th>"
             f"<th>op</th><th>why</th></tr></thead><tbody>{rows}</tbody></table>" if rows
             else "<p>Every Linear is split.</p>")
    return (f"<h2>Tensor parallelism</h2><p class=\"lead\">{plan.parallelism.tp}-way: the Linears "
            f"split (colwise by output features, rowwise by input features; replicate: a per-head norm between "
            f"them) and the blocks left whole, with the op that keeps them whole.</p><ul>{split}</ul>{whole}")


def memory_section(plan) -> str:
    rows = [charts.BarRow(f"stage {s.index}", memory_segments(s.memory_breakdown, s.predicted_memory_bytes),
                          note=f"{len(s.modules)} modules: " + ", ".join(s.modules[:6])
                          + (" …" if len(s.modules) > 6 else ""))
            for s in sorted(plan.stages, key=lambda s: s.index)]
    if not rows:
        return ""
    cap = plan.cluster.memory_per_gpu_bytes
    chart = charts.stacked_bars(rows, charts.Axis("bytes per GPU", fmt_bytes), "memory per stage",
                                cap=(cap, f"usable memory per GPU {fmt_bytes(cap)}"))
    without = plan.predicted.activations_without_sequence_parallel_bytes
    saving = ""
    if without is not None:
        with_sp = plan.predicted.memory_breakdown.get("activations", 0.0)
        saving = (f'<p class="lead">Sequence parallelism: the most loaded rank keeps {esc(fmt_bytes(with_sp))} of '
                  f"activations; the same layout without it (sp=off) would keep {esc(fmt_bytes(without))}.</p>")
    peak = plan.predicted.peak_memory_bytes
    for name, short, whole in (("Context parallelism", "cp", plan.predicted.peak_memory_without_context_parallel_bytes),
                               ("Expert parallelism", "ep", plan.predicted.peak_memory_without_expert_parallel_bytes)):
        if whole is not None:
            saving += (f'<p class="lead">{name}: the most loaded rank needs {esc(fmt_bytes(peak))}; the same layout '
                       f"with {short}=1 would need {esc(fmt_bytes(whole))}.</p>")
    return ('<h2>Memory per GPU, by pipeline stage</h2><p class="lead">Peak memory of one rank of each stage, '
            "split into model states and activations, against the usable memory per GPU (red).</p>" + chart + saving)


def modules_section(result) -> str:
    plan, profile = result.plan, result.profile
    if profile is None or not plan.stages:
        return ""
    b = plan.parallelism.microbatch
    times = module_times(profile, plan.stages, b)
    stage_time = {s.index: s.predicted_time_s for s in plan.stages}
    rows = [charts.BarRow(t.module, (("forward", t.forward_s), ("backward", t.backward_s)), t.stage,
                          (f"stage {t.stage} · " if t.stage >= 0 else "") + f"{t.ops} ops"
                          + (f", {t.glue_ops} of them glue ops outside the module" if t.glue_ops else ""))
            for t in times]
    names = {i: f"stage {i} · {fmt_seconds(t)} predicted" for i, t in stage_time.items()}
    names[-1] = "outside the stages"
    axis = charts.Axis(f"forward + backward seconds per micro-batch of {b} (profiled on {profile.device})",
                       fmt_seconds)
    chart = charts.stacked_bars(rows, axis, "time per module", group_names=names,
                                row_height=22 if len(rows) < 40 else 14)
    return ('<h2>Time per module, with stage boundaries</h2><p class="lead">Profiled time of each module of the '
            "model's chain, coloured by the pipeline stage it runs on (dashed lines are stage boundaries): darker is "
            "forward, lighter backward. Ops outside every module (residual adds, the loss) count with the "
            "module before them. A stage's predicted time also counts parallelism and communication.</p>" + chart)


def schedule_section(plan, view: ScheduleView | None = None) -> str:
    view = schedule_view(plan) if view is None else view
    if not view.events and not view.elided:
        return ""
    par = plan.parallelism
    ranks = view.ranks
    schedule = (SCHEDULE_BY_NAME[par.schedule].display_name
                if par.pp > 1 else "Gradient accumulation")
    chart = charts.gantt(list(view.events), ranks, "pipeline schedule", view.elided)
    microbatches = plural(par.microbatches, "micro-batch")
    return (f'<h2>Schedule of one step</h2><p class="lead">{esc(schedule)}, '
            f"{microbatches} on {plural(ranks, 'pipeline rank')}; numbers are "
            f"micro-batches. Simulated step: {fmt_seconds(view.makespan_s)} (predicted "
            f"{fmt_seconds(plan.predicted.step_time_s)}). The same events are in trace.json "
            "(open it in Perfetto or chrome://tracing).</p>" + _elided_html(view) + chart + _rank_totals_html(view))


def _elided_html(view: ScheduleView) -> str:
    """What a schedule too long to draw block by block shows (schedule.DRAWN_EVENTS); nothing when it is drawn whole."""
    if not view.elided:
        return ""
    shown = view.drawn_microbatches
    elided = view.microbatches - len(shown)
    blocks = sum(span.count for span in view.elided)
    return (f'<p class="lead"><strong>Elided</strong>: micro-batches {esc(number_ranges(shown))} (the first, a '
            f"steady-state window and the last) are drawn block by block; the {blocks:,} blocks of the "
            f"other {plural(elided, 'micro-batch')} are aggregated: each grey block is a run of them on one lane "
            "(hover for its count and its busy and idle time), and the totals per rank below count them.</p>")


def _rank_totals_html(view: ScheduleView) -> str:
    """Per pipeline rank: busy, idle and communication seconds of the whole step, drawn and elided blocks together
    (busy + idle = the simulated step); only for an elided schedule."""
    if not view.elided:
        return ""
    busy, stages, step = view.lane_busy_s(), view.rank_stages(), view.makespan_s
    rows = []
    for r in range(view.ranks):
        compute = busy.get((r, COMPUTE), 0.0)
        cells = [str(r), ", ".join(map(str, stages.get(r, []))), fmt_seconds(compute),
                 fmt_seconds(max(0.0, step - compute)), fmt_seconds(busy.get((r, COMMUNICATION), 0.0)),
                 fmt_seconds(busy.get((r, RECEIVE), 0.0))]
        rows.append("<tr>" + "".join(f'<td class="n">{esc(c)}</td>' if i != 1 else f"<td>{esc(c)}</td>"
                                     for i, c in enumerate(cells)) + "</tr>")
    head = ('<tr><th class="n">rank</th><th>stages</th><th class="n">compute busy</th><th class="n">compute idle</th>'
            '<th class="n">sends, collectives</th><th class="n">receives</th></tr>')
    return (f"<details><summary>Totals per pipeline rank over the whole step ({fmt_seconds(step)}: busy + idle)"
            f"</summary><table>{head}{''.join(rows)}</table></details>")



MODEL_STATES = ("parameters", "gradients", "optimizer")
"""Memory breakdown parts that are model states (the rest of the peak: activations, buffers, working memory)."""


def experts_section(plan, candidates: tuple[Any, ...], best: Any) -> str:
    """On a model with expert layers (a candidate priced with expert compute or ep > 1): the chosen layout and the
    fastest of the other kind (with ep > 1 / with ep = 1), each with its step time, its experts' compute and
    all-to-all per step (time_breakdown "expert_compute", "expert_parallel_comm") and its peak memory split into
    model states and activations."""
    priced = [c for c in candidates if c.predicted is not None]
    if not any("expert_compute" in c.predicted.time_breakdown or c.parallelism.ep > 1
               for c in priced):
        return ""
    chosen = best if best is not None and best.predicted is not None else None
    rows = ([chosen] if chosen else []) + fastest_by_expert_split(
        priced, exclude_ep=chosen.parallelism.ep if chosen else None)
    rows.sort(key=lambda c: c.parallelism.ep == 1)  # with ep > 1 first
    head = ('<tr><th>experts</th><th>layout</th><th class="n">step time</th><th class="n">expert compute</th>'
            '<th class="n">expert all-to-all</th><th class="n">peak memory/GPU</th><th class="n">model states</th>'
            '<th class="n">activations</th><th>fits</th></tr>')
    body = "".join(_expert_row(c, c is chosen) for c in rows)
    lead = ('<p class="lead">The fastest layout with expert parallelism (ep &gt; 1: each rank holds some of the '
            "experts and all-to-alls carry the tokens to them and back) and the fastest without (ep = 1: every rank "
            "holds every expert), from the candidates priced; times per optimizer step, the experts' compute on the "
            "busiest rank, memory on the most loaded rank.</p>")
    return f"<h2>Expert parallelism: why this layout</h2>{lead}{_expert_verdict(rows)}<table>{head}{body}</table>"


def _expert_row(c: Any, chosen: bool) -> str:
    pred, ep = c.predicted, c.parallelism.ep
    parts, memory = pred.time_breakdown, pred.memory_breakdown
    states = sum(memory.get(k, 0.0) for k in MODEL_STATES)
    fits = '<span class="badge ok">yes</span>' if c.fits else '<span class="badge bad">no</span>'
    cells = [f"<td>{'ep = ' + str(ep) if ep > 1 else 'ep = 1'}{' (chosen)' if chosen else ''}</td>",
             f"<td>{esc(describe_layout(c.parallelism))}</td>",
             f'<td class="n">{fmt_seconds(pred.step_time_s)}</td>',
             f'<td class="n">{fmt_seconds(parts["expert_compute"]) if "expert_compute" in parts else "–"}</td>',
             f'<td class="n">{fmt_seconds(parts.get("expert_parallel_comm", 0.0))}</td>',
             f'<td class="n">{fmt_bytes(pred.peak_memory_bytes)}</td>',
             f'<td class="n">{fmt_bytes(states)}</td>',
             f'<td class="n">{fmt_bytes(memory.get("activations", 0.0))}</td>', f"<td>{fits}</td>"]
    return f'<tr class="{"chosen" if chosen else ""}">{"".join(cells)}</tr>'


def _expert_verdict(rows: list[Any]) -> str:
    """One line: whether expert parallelism pays (both kinds priced), by step time among the layouts that fit."""
    split = [c for c in rows if c.parallelism.ep > 1]
    whole = [c for c in rows if c.parallelism.ep == 1]
    if not split or not whole:
        kind = "with" if split else "without"
        return f'<p class="lead">Only layouts {kind} expert parallelism were priced.</p>'
    a, b = split[0], whole[0]
    if a.fits != b.fits:
        winner, loser = (a, b) if a.fits else (b, a)
        text = (f"only the layout {'with' if winner is a else 'without'} expert parallelism fits: the other needs "
                f"{fmt_bytes(loser.predicted.peak_memory_bytes)} per GPU")
    else:
        ratio = b.predicted.step_time_s / a.predicted.step_time_s
        text = (f"expert parallelism pays: the layout without it takes {ratio:.2f}× the step time of the layout "
                f"with it" if ratio > 1 else f"expert parallelism does not pay: the layout with it takes "
                f"{1 / ratio:.2f}× the step time of the layout without it")
        if not a.fits:
            text += " (neither fits)"
    return f'<p class="lead">{esc(text[0].upper() + text[1:])}.</p>'


def candidates_section(plan, candidates: tuple[Any, ...], best: Any) -> str:
    if not candidates:
        return ""
    cap = plan.cluster.memory_per_gpu_bytes
    points = [charts.Point(c.predicted.peak_memory_bytes, c.predicted.step_time_s,
                           f"{describe_layout(c.parallelism)}\n{fmt_seconds(c.predicted.step_time_s)} per step, "
                           f"{fmt_bytes(c.predicted.peak_memory_bytes)} per GPU"
                           + ("" if c.fits else f"\ndoes not fit: {c.reason}"), c.fits, c is best)
              for c in candidates if c.predicted is not None and 0 < c.predicted.step_time_s < math.inf
              and 0 <= c.predicted.peak_memory_bytes < math.inf]
    chart = charts.scatter(points, cap, "candidates: step time vs memory") if points else ""
    rows = [_candidate_row(i, c, best) for i, c in enumerate(ranked_candidates(candidates, best), start=1)]
    head = ('<tr><th class="n">#</th><th>layout</th><th>fits</th><th class="n">step time</th>'
            '<th class="n">samples/s</th><th class="n">memory/GPU</th><th>why not</th></tr>')
    table = f"<table>{head}{''.join(rows[:TABLE_ROWS])}</table>"
    if len(rows) > TABLE_ROWS:
        table += (f"<details><summary>{len(rows) - TABLE_ROWS} more candidates</summary>"
                  f"<table>{head}{''.join(rows[TABLE_ROWS:])}</table></details>")
    return (f'<h2>Candidates</h2><p class="lead">{len(candidates)} layouts evaluated. Each dot is one; the '
            "dashed line joins the Pareto front (nothing is both faster and smaller); the shaded area "
            "does not fit in GPU memory.</p>" + chart + table)


def _candidate_row(rank: int, c: Any, best: Any) -> str:
    pred = c.predicted
    fits = '<span class="badge ok">yes</span>' if c.fits else '<span class="badge bad">no</span>'
    compiled = " · compile" if getattr(c, "compile", False) else ""
    cells = [f'<td class="n">{rank}</td>', f"<td>{esc(describe_layout(c.parallelism) + compiled)}</td>",
             f"<td>{fits}</td>",
             f'<td class="n">{fmt_seconds(pred.step_time_s) if pred else "–"}</td>',
             f'<td class="n">{fmt_number(pred.samples_per_s) if pred else "–"}</td>',
             f'<td class="n">{fmt_bytes(pred.peak_memory_bytes) if pred else "–"}</td>',
             f"<td>{'chosen' if c is best else esc(c.reason)}</td>"]
    return f'<tr class="{"chosen" if c is best else ""}">{"".join(cells)}</tr>'


def why_not_section(plan, candidates: tuple[Any, ...], best: Any, parameter_server: Any = None) -> str:
    """The runners-up and why they lost; with `parameter_server` (solve.parameter_server.ParameterServerLayout)
    also the parameter-server layout with its arithmetic."""
    alternatives = list(plan.alternatives)
    if not alternatives:
        alternatives = [Alternative.of(c) for c in ranked_candidates(candidates, best) if c is not best][:5]
    server = parameter_server_html(plan, parameter_server) if parameter_server is not None else ""
    if not alternatives:
        return f"<h2>Why not a parameter server?</h2>{server}" if server else ""
    chosen = plan.predicted.step_time_s
    items = []
    for alt in alternatives:
        step, memory = alt.step_time_s, alt.peak_memory_bytes
        facts = []
        if isinstance(step, (int, float)) and step > 0 and chosen > 0:
            facts.append(f"{fmt_seconds(step)} per step ({step / chosen:.2f}× the chosen layout's)")
        if isinstance(memory, (int, float)):
            facts.append(f"{fmt_bytes(memory)} per GPU")
        badge = ('<span class="badge ok">fits</span>' if alt.fits
                 else '<span class="badge bad">does not fit</span>')
        items.append(f"<li><strong>{esc(describe_layout(alt.parallelism))}</strong> {badge}"
                     f"<div>{esc(', '.join(facts))}</div>"
                     f"<div class=\"reason\">{esc(alt.reason)}</div></li>")
    return ('<h2>Why not the next best layouts?</h2><p class="lead">The closest runners-up and what ruled them '
            'out.</p><ol class="why">' + "".join(items) + "</ol>" + (f"<h3>Why not a parameter server?</h3>{server}"
                                                                     if server else ""))


def parameter_server_html(plan, ps: Any) -> str:
    """The parameter-server layout of the same model (solve/parameter_server.py): its step time term by term
    beside the ring all-reduce DDP runs over the same GPUs, and why it lost."""
    chosen = plan.predicted.step_time_s
    gb = 1e9
    rate = f"{ps.link_bytes_per_s / gb:.3g} GB/s"

    def moved(nbytes: float) -> str:  # the transfer's arithmetic at the end that bounds it
        if ps.sync.bottleneck == "server links":
            return f"{ps.workers} × {nbytes / gb:.3g} GB / ({plural(ps.servers, 'server link')} × {rate})"
        return f"{nbytes / gb:.3g} GB / {rate} (each worker's link)"

    badge = '<span class="badge ok">fits</span>' if ps.fits else '<span class="badge bad">does not fit</span>'
    rows = [
        ("workers' compute (forward, backward; the replica under DDP without its all-reduce and optimizer step)",
         ps.compute_s, ""),
        ("push: every worker's fp32 gradients to the servers", ps.sync.push_s, moved(ps.gradient_bytes)),
        ("pull: the updated weights to every worker", ps.sync.pull_s, moved(ps.parameter_bytes)),
        ("AdamW on the servers' CPUs", ps.server_update_s, f"1/{ps.servers} of the parameters each"),
        ("step", ps.step_time_s, f"{ps.step_time_s / chosen:.3g}× the chosen layout's {fmt_seconds(chosen)}"
         if chosen > 0 else ""),
        ("for comparison: ring all-reduce of the same gradients (DDP)", ps.ring_all_reduce_s,
         f"over the {ps.workers} GPUs; push + pull take {ps.sync.step_s / ps.ring_all_reduce_s:.3g}× as long"
         if ps.ring_all_reduce_s > 0 else ""),
    ]
    cells = "".join(f'<tr><td>{esc(what)}</td><td class="n">{fmt_seconds(seconds)}</td><td>{esc(note)}</td></tr>'
                    for what, seconds, note in rows)
    return (f'<p class="lead">The same model under a synchronous parameter server: {ps.workers} workers, each a '
            f"whole replica, and {plural(ps.servers, 'server shard')} holding the weights and AdamW state "
            f"({fmt_bytes(ps.peak_memory_bytes)} per GPU {badge}). A server's link carries every worker's share, so "
            "with fewer server links than workers it moves workers/servers times what a ring all-reduce moves per "
            "link; with one per worker it would be the reduce-scatter and all-gather that DDP's all-reduce and FSDP "
            "already run, without the server hosts. Horovod's ring all-reduce is that same collective (NCCL or MPI): "
            "the program uses PyTorch's own.</p>"
            '<table><tr><th>term</th><th class="n">seconds</th><th>arithmetic</th></tr>'
            f"{cells}</table><p class='lead'>Why it lost: {esc(ps.reason)}</p>")


def scaling_section(points: list[tuple]) -> str:
    """Points are (GPUs, samples/s) or autoplan.solve.scaling.ScalingPoint (GPUs, samples/s or None, layout, note):
    a note says the search at that count was bounded (the best of the first layouts it priced, SCALING_LAYOUTS)
    or why there is no point."""
    rows = sorted((int(p[0]), None if p[1] is None else float(p[1]), str(p[2]) if len(p) > 2 else "",
                   str(p[3]) if len(p) > 3 else "") for p in points)
    rated = [(g, r) for g, r, _, _ in rows if r is not None]
    series = [("predicted", ACCENT, [(float(g), r) for g, r in rated])]
    if len(rated) > 1:
        series.append(("linear from fewest GPUs", "#9fb3c8", [(float(g), r) for g, r in ideal_scaling(rated)]))
    chart = charts.line_chart(series, charts.Axis("GPUs", lambda v: f"{v:g}", log=True),
                              charts.Axis("samples per second", fmt_number, zero_based=True), "scaling curve",
                              dashed=("linear from fewest GPUs",)) if rated else ""
    bounded = sum(1 for _, r, _, note in rows if r is not None and note)
    lead = ("Predicted throughput of the best layout when planning the same model for other GPU counts with the "
            "same batch per GPU. Each point is a layout search at that count; away from the planned count it keeps "
            "the stage split of the fast packing (no MILP refinement, which could only make a step faster).")
    if bounded:
        lead += (f" At {plural(bounded, 'count')} the search stopped at its budget of layouts: the point there is the "
                 "best of the layouts priced by then, as the table says.")
    table = ""
    if any(layout or note for _, _, layout, note in rows):
        cells = "".join(
            f'<tr><td class="n">{g}</td><td class="n">{fmt_number(r) if r is not None else "–"}</td>'
            f"<td>{esc(layout)}</td><td>{esc(note or 'complete')}</td></tr>" for g, r, layout, note in rows)
        table = ('<table><tr><th class="n">GPUs</th><th class="n">samples/s</th><th>best layout</th>'
                 f"<th>search</th></tr>{cells}</table>")
    return f'<h2>Scaling</h2><p class="lead">{lead}</p>' + chart + table


def verify_section(verify: Any) -> str:
    """Loss and first-step gradient parity of the generated program against the single-process reference, and
    measured vs predicted (overall, per stage and per rank: autoplan.report.verify_view). verify.json is
    user-editable, so any value may be missing or malformed: such values are skipped, never trusted, never fatal."""
    verify = verify if isinstance(verify, dict) else {}
    if verify.get("device") == "cuda":
        return _gpu_measurement_section(verify)
    reference, losses = _steps(verify.get("reference_losses")), _steps(verify.get("losses"))
    tolerance = verify_view.finite(verify.get("parity_tolerance"))
    tolerance = tolerance if tolerance is not None and tolerance > 0 else PARITY_TOLERANCE
    diff = _parity_diff(verify)
    # verify.py writes passed=false (and a null difference) when a run failed or a loss was NaN
    ok = verify.get("passed") is not False and diff is not None and math.isfinite(diff) and diff <= tolerance
    badge = f'<span class="badge {"ok" if ok else "bad"}">{"parity" if ok else "NO parity"}</span>'
    if diff is None:
        detail = "no losses recorded"
    elif not math.isfinite(diff):
        detail = "the losses do not compare (a run failed, stopped early or diverged to NaN)"
    else:
        detail = f"max |difference| {diff:.2e} (tolerance {tolerance:g})"
    html = (f'<section id="verification"><h2>Verification {badge}</h2><p class="lead">The generated program on '
            f"{esc(verify.get('nproc', '?'))} CPU processes (gloo) against the single-process model, same weights and "
            f"batches: {esc(detail)}.</p>") + verify_view.gradients_html(verify) + verify_view.dropout_html(verify)
    error = verify.get("error")
    if isinstance(error, str) and error:
        html += f"<details><summary>The run failed</summary><pre>{esc(error)}</pre></details>"
    if reference or losses:
        html += charts.line_chart(
            [("single process (reference)", "#a0cbe8", reference), ("generated program", "#1f4e79", losses)],
            charts.Axis("optimizer step", lambda v: f"{v:g}"), charts.Axis("loss", lambda v: f"{v:.4g}"),
            "loss parity", dashed=("generated program",), halo=("single process (reference)",))
    return html + verify_view.comparison_html(verify) + "</section>"


def _gpu_measurement_section(verify: dict) -> str:
    """`autoplan verify --device cuda --measure`: the program trained on GPUs, measured against the prediction
    (no parity: verify.json's "parity" says why)."""
    losses = _steps(verify.get("losses"))
    ok = verify.get("passed") is True
    badge = f'<span class="badge {"ok" if ok else "bad"}">{"trained on GPU" if ok else "GPU run failed"}</span>'
    note = verify.get("parity") if isinstance(verify.get("parity"), str) else ""
    html = (f'<section id="verification"><h2>Verification {badge}</h2><p class="lead">The generated program '
            f"trained on {esc(verify.get('nproc', '?'))} GPU(s) for {esc(verify.get('steps', '?'))} steps. "
            f"Parity: {esc(note)}.</p>")
    mfu, predicted_mfu = verify_view.finite(verify.get("measured_mfu")), verify_view.finite(verify.get("predicted_mfu"))
    if mfu is not None and predicted_mfu is not None:
        html += f"<p>MFU {mfu * 100:.1f}% measured, {predicted_mfu * 100:.1f}% predicted.</p>"
    error = verify.get("error")
    if isinstance(error, str) and error:
        html += f"<details><summary>The run failed</summary><pre>{esc(error)}</pre></details>"
    if losses:
        html += charts.line_chart([("generated program on GPU", "#1f4e79", losses)],
                                  charts.Axis("optimizer step", lambda v: f"{v:g}"),
                                  charts.Axis("loss", lambda v: f"{v:.4g}"), "loss")
    return html + verify_view.comparison_html(verify) + "</section>"


def _parity_diff(verify: dict) -> float | None:
    """The recorded max |loss difference| (NaN or infinity included: they mean divergence), else the one the
    two loss lists give (NaN when a pair is not two numbers); None when there is nothing to compare."""
    diff = verify.get("parity_max_abs_diff")
    if isinstance(diff, (int, float)) and not isinstance(diff, bool):
        return float(diff)
    reference, losses = verify.get("reference_losses"), verify.get("losses")
    if not isinstance(reference, list) or not isinstance(losses, list) or not reference or not losses:
        return None
    pairs = [(verify_view.finite(a), verify_view.finite(b)) for a, b in zip(reference, losses)]
    if len(reference) != len(losses) or any(a is None or b is None for a, b in pairs):
        return math.nan
    return max(abs(a - b) for a, b in pairs)


def _steps(values: Any) -> list[tuple[int, float]]:
    """(step, value) for the finite numbers of a JSON list, steps from 1 (a diverged run may log NaN)."""
    if not isinstance(values, list):
        return []
    return [(step, float(v)) for step, v in enumerate(values, start=1)
            if isinstance(v, (int, float)) and math.isfinite(v)]
