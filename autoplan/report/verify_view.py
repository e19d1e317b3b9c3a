"""Predicted vs measured in report.html's verification section: the overall step time and peak memory,
per pipeline stage (table and chart) and per rank (table), from the verify.json `autoplan verify --measure`
writes.

verify.json is user-editable input, so nothing in it is trusted: numbers must be finite JSON numbers, lists
must be lists, rows must be objects. Whatever is missing or malformed shows as "–" (or its table or chart is
left out); it never fails the page. Every string from the file is escaped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autoplan.report import charts
from autoplan.report.rollup import memory_segments
from autoplan.report.svg import MUTED, Svg, color, esc, fmt_bytes, fmt_seconds, legend_height

TIME_TOLERANCE = 0.30
"""|predicted / measured - 1| of a step time still marked "ok": CPU timings are noisy, and the cost model
aims at the ranking of layouts more than at the last 10%."""
MEMORY_TOLERANCE = 0.15
"""|predicted / measured - 1| of a peak memory still marked "ok": memory is more predictable than time."""
ROWS_SHOWN = 20
"""Table rows shown before the rest fold into <details> (many ranks)."""
MODULES_SHOWN = 3
"""Module names listed per stage in the table (the full list is in the cell's tooltip)."""
MODULE_CHARS = 40
"""Longer module names are shortened in the table."""
MEASURED_COLOR = "#52606d"
"""Measured bars: a neutral dark grey, apart from the palette colours of the predicted categories."""
MISSING = "–"


# ---- reading untrusted values ----

def finite(value: Any) -> float | None:
    """A finite JSON number as float, else None (strings, booleans, null, NaN and infinities are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def amount(value: Any) -> float | None:
    """A time or a size: a finite, non-negative JSON number, else None."""
    number = finite(value)
    return number if number is not None and number >= 0 else None


def whole(value: Any) -> int | None:
    """A whole JSON number (3 or 3.0) as int, else None."""
    number = finite(value)
    return int(number) if number is not None and number.is_integer() else None


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1 (negative: the prediction is too low), or None without a positive measurement."""
    if predicted is None or measured is None or measured <= 0:
        return None
    return predicted / measured - 1


def fmt_error(error: float | None) -> str:
    return MISSING if error is None else f"{error * 100:+.1f}%"


def error_badge(error: float | None, tolerance: float) -> str:
    """The signed error in an ok/bad badge (bad beyond ±tolerance)."""
    if error is None:
        return MISSING
    verdict = "ok" if abs(error) <= tolerance else "bad"
    return f'<span class="badge {verdict}" title="predicted / measured - 1; ok within ±{tolerance:.0%}">' \
           f"{fmt_error(error)}</span>"


def _show(value: float | None, fmt) -> str:
    return MISSING if value is None else fmt(value)


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage of verify.json's "stages", checked."""

    index: int
    """Stage index (its position in the list when the file has no whole-number index)."""
    modules: tuple[str, ...]
    """Modules the stage owns, in order."""
    predicted_time_s: float | None
    """Predicted forward + backward of one micro-batch on the stage (there is no measured counterpart)."""
    predicted_memory_bytes: float | None
    """Predicted peak memory of one rank of the stage."""
    measured_memory_bytes: float | None
    """Measured peak memory of the ranks holding the stage."""
    breakdown: tuple[tuple[str, float], ...]
    """Predicted memory by category (parameters, gradients, ...), non-negative finite values only."""

    @property
    def memory_error(self) -> float | None:
        return relative_error(self.predicted_memory_bytes, self.measured_memory_bytes)


@dataclass(frozen=True)
class RankRow:
    """One process of verify.json's "ranks", checked."""

    rank: int
    """Global rank (its position in the list when the file has none)."""
    pp_rank: int | None
    """Pipeline-parallel rank."""
    dp_rank: int | None
    """Data-parallel rank."""
    tp_rank: int | None
    """Tensor-parallel rank."""
    stages: tuple[int, ...]
    """Stage indices the rank runs (several with interleaved schedules)."""
    measured_step_time_s: float | None
    """Median step time this rank measured."""
    predicted_step_time_s: float | None
    """Predicted step time (the plan's, unless the row carries its own)."""
    measured_memory_bytes: float | None
    """Peak memory this rank measured."""
    predicted_memory_bytes: float | None
    """Predicted peak memory of this rank."""


def _rows(value: Any) -> list[dict]:
    return [row for row in value if isinstance(row, dict)] if isinstance(value, list) else []


def _modules(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(m) for m in value) if isinstance(value, list) else ()


def _breakdown(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict):
        return ()
    return tuple((str(name), number) for name, raw in value.items()
                 if (number := amount(raw)) is not None)


def parse_stages(verify: dict) -> list[StageRow]:
    out = []
    for position, row in enumerate(_rows(verify.get("stages"))):
        index = whole(row.get("index"))
        out.append(StageRow(position if index is None else index, _modules(row.get("modules")),
                            amount(row.get("predicted_time_s")), amount(row.get("predicted_memory_bytes")),
                            amount(row.get("measured_peak_memory_bytes")), _breakdown(row.get("memory_breakdown"))))
    return out


def parse_ranks(verify: dict) -> list[RankRow]:
    plan_step = amount(verify.get("predicted_step_time_s"))
    out = []
    for position, row in enumerate(_rows(verify.get("ranks"))):
        rank = whole(row.get("rank"))
        stages = row.get("stages")
        stages = tuple(s for s in map(whole, stages) if s is not None) if isinstance(stages, list) else ()
        own_step = amount(row.get("predicted_step_time_s"))
        out.append(RankRow(position if rank is None else rank, whole(row.get("pp_rank")), whole(row.get("dp_rank")),
                           whole(row.get("tp_rank")), stages, amount(row.get("measured_step_time_s")),
                           plan_step if own_step is None else own_step, amount(row.get("measured_peak_memory_bytes")),
                           amount(row.get("predicted_peak_memory_bytes"))))
    return out


# ---- the section's parts ----

def dropout_html(verify: dict) -> str:
    """How the check handled dropout (verify.json's "dropout", written by `autoplan verify`), or "" without it."""
    dropout = verify.get("dropout")
    if not isinstance(dropout, str) or not dropout:
        return ""
    return f'<p class="dropout">Dropout: {esc(dropout)}.</p>'


def gradients_html(verify: dict) -> str:
    """The first-step gradient check (verify.json's "gradient_*" keys, written by `autoplan verify`), or "" without
    it (a verify.json from before the check)."""
    problem, worst = verify.get("gradient_problem"), verify.get("gradient_worst")
    if isinstance(problem, str) and problem:
        return f'<p class="gradients">First-step gradients: FAIL, {esc(problem)}.</p>'
    diff, tolerance = finite(verify.get("gradient_max_rel_diff")), finite(verify.get("gradient_tolerance"))
    where = f" at {esc(worst)}" if isinstance(worst, str) and worst else ""
    if diff is None:
        if "gradient_max_rel_diff" in verify and verify["gradient_max_rel_diff"] is None:  # inf or NaN: written null
            return f'<p class="gradients">First-step gradients: FAIL, an infinite or NaN difference{where}.</p>'
        return ""
    verdict = "" if tolerance is None else f" ({'within' if diff <= tolerance else 'ABOVE'} tolerance {tolerance:g})"
    return (f'<p class="gradients">First-step gradients of every parameter on every rank against the reference: '
            f"max relative difference {diff:.2e}{where}{verdict}.</p>")


def comparison_html(verify: dict) -> str:
    """Everything measured: overall errors (text and bars), then per stage and per rank when present."""
    return overall_html(verify) + stages_html(parse_stages(verify)) + ranks_html(parse_ranks(verify))


def overall_html(verify: dict) -> str:
    """One line and one pair of bars each for step time and peak memory."""
    html = ""
    for what, key, fmt, tolerance in (("step time", "step_time_s", fmt_seconds, TIME_TOLERANCE),
                                      ("peak memory", "peak_memory_bytes", fmt_bytes, MEMORY_TOLERANCE)):
        predicted, measured = amount(verify.get(f"predicted_{key}")), amount(verify.get(f"measured_{key}"))
        if predicted is None and measured is None:
            continue
        error = relative_error(predicted, measured)
        ratio = f", predicted / measured = {predicted / measured:.2f}" if error is not None else ""
        html += (f'<p class="lead"><strong>{what.capitalize()}</strong>: predicted {_show(predicted, fmt)}, '
                 f"measured {_show(measured, fmt)} ({fmt_error(error)}{ratio}) {error_badge(error, tolerance)}</p>")
        if error is not None:
            html += charts.compare_bars([(f"predicted {what}", predicted, color(0)),
                                         (f"measured {what}", measured, color(1))],
                                        fmt, what, f"predicted vs measured {what}")
    if not html:
        return ""
    where = [f"measured on {esc(on)}" for on in [verify.get("measured_on")] if isinstance(on, str) and on]
    target = verify.get("predicted_for")
    if isinstance(target, str) and target:
        measured_on_cpu = str(verify.get("measured_on", "cpu")).startswith("cpu")
        where.append(f"predicted for {esc(target)}" + ("" if target.lower().startswith("cpu") == measured_on_cpu
                                                       else " (another device: expect times to differ)"))
    note = f" ({'; '.join(where)})" if where else ""
    return (f'<h3>Predicted vs measured</h3><p class="lead">Errors are predicted / measured - 1: negative means the '
            f"plan expected less than the run needed{note}. Beyond ±{TIME_TOLERANCE:.0%} (time) or "
            f"±{MEMORY_TOLERANCE:.0%} (memory) they are marked red.</p>" + html)


def _folded(head: str, rows: list[str], what: str) -> str:
    table = f"<table>{head}{''.join(rows[:ROWS_SHOWN])}</table>"
    if len(rows) > ROWS_SHOWN:
        table += (f"<details><summary>{len(rows) - ROWS_SHOWN} more {what}</summary>"
                  f"<table>{head}{''.join(rows[ROWS_SHOWN:])}</table></details>")
    return table


def short_modules(modules: tuple[str, ...]) -> str:
    """"wte, blocks.0 … blocks.5 (8 modules)": the first ones and the last, each name shortened."""
    names = [charts.shorten(m, MODULE_CHARS) for m in modules]
    if len(names) <= MODULES_SHOWN:
        return ", ".join(names) or MISSING
    return f"{', '.join(names[:MODULES_SHOWN - 1])} … {names[-1]} ({len(names)} modules)"


def stages_html(stages: list[StageRow]) -> str:
    """Per-stage table and chart of predicted vs measured peak memory ("" without stages)."""
    if not stages:
        return ""
    head = ('<tr><th class="n">stage</th><th>modules</th><th class="n">predicted time<br>(fwd + bwd, 1 micro-batch)'
            '</th><th class="n">predicted peak memory</th><th class="n">measured peak memory</th>'
            '<th class="n">error</th></tr>')
    rows = [f'<tr><td class="n">{s.index}</td><td title="{esc(", ".join(s.modules))}">{esc(short_modules(s.modules))}'
            f'</td><td class="n">{_show(s.predicted_time_s, fmt_seconds)}</td>'
            f'<td class="n">{_show(s.predicted_memory_bytes, fmt_bytes)}</td>'
            f'<td class="n">{_show(s.measured_memory_bytes, fmt_bytes)}</td>'
            f'<td class="n">{error_badge(s.memory_error, MEMORY_TOLERANCE)}</td></tr>' for s in stages]
    bars = [PairedBar(f"stage {s.index}", _predicted_segments(s), s.measured_memory_bytes,
                      f"{len(s.modules)} modules: " + short_modules(s.modules))
            for s in stages]
    chart = paired_bars(bars, fmt_bytes, "peak memory per rank", "predicted vs measured memory per stage") \
        if any(b.predicted or b.measured for b in bars) else ""
    return ('<h3>Per pipeline stage</h3><p class="lead">Predicted peak memory of one rank of each stage (split into '
            "model states and activations) against the peak the run measured on the ranks holding it. Time is "
            "only predicted per stage: the run measures whole steps (see the ranks below).</p>"
            + chart + _folded(head, rows, "stages"))


def _predicted_segments(stage: StageRow) -> tuple[tuple[str, float], ...]:
    """The predicted bar's segments: the breakdown plus "other" for the unexplained rest; one plain segment
    when there is no breakdown or it adds up to more than the total (then it cannot be the total's split)."""
    total = stage.predicted_memory_bytes
    if total is None or total <= 0:
        return ()
    if stage.breakdown and sum(v for _, v in stage.breakdown) <= total * (1 + 1e-6):
        return tuple((k, v) for k, v in memory_segments(dict(stage.breakdown), total) if v > 0)
    return (("predicted", total),)


def ranks_html(ranks: list[RankRow]) -> str:
    """Per-rank table: measured vs predicted step time and peak memory ("" without ranks)."""
    if not ranks:
        return ""
    # two header rows (step time / peak memory over measured, predicted, error) keep 11 columns narrow enough
    head = ('<tr><th class="n" rowspan="2">rank</th><th class="n" rowspan="2">PP</th><th class="n" rowspan="2">DP</th>'
            '<th class="n" rowspan="2">TP</th><th rowspan="2">stages</th><th class="g" colspan="3">step time</th>'
            '<th class="g" colspan="3">peak memory</th></tr><tr>'
            + '<th class="n">measured</th><th class="n">predicted</th><th class="n">error</th>' * 2 + "</tr>")
    rows = []
    for r in ranks:
        time_error = relative_error(r.predicted_step_time_s, r.measured_step_time_s)
        memory_error = relative_error(r.predicted_memory_bytes, r.measured_memory_bytes)
        cells = [str(r.rank), _show(r.pp_rank, str), _show(r.dp_rank, str), _show(r.tp_rank, str)]
        rows.append("<tr>" + "".join(f'<td class="n">{c}</td>' for c in cells)
                    + f"<td>{', '.join(map(str, r.stages)) or MISSING}</td>"
                    + f'<td class="n">{_show(r.measured_step_time_s, fmt_seconds)}</td>'
                    + f'<td class="n">{_show(r.predicted_step_time_s, fmt_seconds)}</td>'
                    + f'<td class="n">{error_badge(time_error, TIME_TOLERANCE)}</td>'
                    + f'<td class="n">{_show(r.measured_memory_bytes, fmt_bytes)}</td>'
                    + f'<td class="n">{_show(r.predicted_memory_bytes, fmt_bytes)}</td>'
                    + f'<td class="n">{error_badge(memory_error, MEMORY_TOLERANCE)}</td></tr>')
    return ('<h3>Per rank</h3><p class="lead">Each process\'s median step time and peak memory; the overall '
            "numbers above are the largest over the ranks.</p>" + _folded(head, rows, "ranks"))


# ---- chart ----

@dataclass(frozen=True)
class PairedBar:
    """A predicted bar (stacked by category) above a measured bar (one value), for one row label."""

    label: str
    """Row label, e.g. "stage 0"."""
    predicted: tuple[tuple[str, float], ...]
    """(category, value) segments from left to right; empty when there is no prediction."""
    measured: float | None
    """The measured value, None when not measured."""
    note: str = ""
    """Extra tooltip text."""


def paired_bars(groups: list[PairedBar], fmt, axis_title: str, label: str) -> str:
    """Horizontal grouped bars: per group a stacked predicted bar and a plain measured bar under it, with the
    values (and the measured bar's error) printed at their ends."""
    names = list(dict.fromkeys(name for g in groups for name, _ in g.predicted))
    entries = [(name.replace("_", " "), color(i)) for i, name in enumerate(names)] + [("measured", MEASURED_COLOR)]
    left, right = charts.label_margin([g.label for g in groups]), charts.WIDTH - 170
    bar_h, gap = 16, 14
    group_h = 2 * bar_h + 2 + gap
    top = 26 + legend_height(entries, right - left)
    bottom = top + group_h * len(groups)
    largest = max([sum(v for _, v in g.predicted) for g in groups]
                  + [g.measured for g in groups if g.measured is not None] + [1e-30])
    x = charts.value_scale(fmt, largest * 1.04, (left, right))
    chart = Svg(charts.WIDTH, bottom + 48, label)
    chart.legend(left, 16, entries, right)
    chart.x_axis(x, bottom + 4, top - 6, axis_title, fmt)
    for i, g in enumerate(groups):
        y = top + i * group_h + gap / 2
        chart.text(left - 8, y + bar_h + 5, charts.shorten(g.label), "end")
        total = sum(v for _, v in g.predicted)
        start = 0.0
        for name, value in g.predicted:
            tip = f"{g.label}, predicted\n{name.replace('_', ' ')}: {fmt(value)} of {fmt(total)}" + (
                f"\n{g.note}" if g.note else "")
            chart.rect(x(start), y, x(start + value) - x(start), bar_h, color(names.index(name)), tip)
            start += value
        chart.text((x(total) if g.predicted else left) + 4, y + bar_h - 4,
                   f"predicted {fmt(total)}" if g.predicted else "not predicted", "start", MUTED)
        y_measured = y + bar_h + 2
        error = relative_error(total if g.predicted else None, g.measured)
        if g.measured is not None and g.measured > 0:
            chart.rect(left, y_measured, x(g.measured) - left, bar_h, MEASURED_COLOR,
                       f"{g.label}, measured: {fmt(g.measured)}" + (f"\npredicted / measured - 1 = {fmt_error(error)}"
                                                                     if error is not None else ""))
        measured_text = "not measured" if g.measured is None else f"measured {fmt(g.measured)}" + (
            f" ({fmt_error(error)})" if error is not None else "")
        chart.text(x(max(g.measured or 0.0, 0.0)) + 4, y_measured + bar_h - 4, measured_text, "start", MUTED)
    return chart.render()
