"""The report's charts, each a function from plain numbers to an inline <svg> string."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autoplan.report.schedule import COMMUNICATION, COMPUTE, COMPUTE_KINDS, RECEIVE, ElidedSpan, ScheduleEvent
from autoplan.report.svg import (ACCENT, INK, MUTED, WARN, Scale, Svg, byte_unit, color, fmt_bytes, fmt_seconds,
                                 legend_height, text_width)

WIDTH = 960
CAP_ZOOM = 3.0
"""A cap (GPU memory) more than this many times the largest value is noted, not drawn: on its scale
the data would be slivers."""
LABEL_CHARS = 30
"""Longer row labels are shortened (the full name stays in the tooltip)."""

KIND_COLORS = {"forward": "#4e79a7", "backward": "#a0cbe8", "input_gradient": "#a0cbe8", "weight_gradient": "#76b7b2",
               "send": "#f28e2b", "recv": "#ffbe7d",
               "grad_sync": "#59a14f", "optimizer": "#b07aa1"}
ELIDED_COLOR = "#d9e2ec"
"""Runs of schedule blocks aggregated rather than drawn (schedule.ElidedSpan)."""
ELIDED_DRAWN_PX = 1.5
"""Narrowest block of an elided schedule's drawn micro-batches, pixels: over hundreds of micro-batches a block is a
fraction of a pixel, and these are the ones a reader looks for among the grey runs."""


def shorten(text: str, limit: int = LABEL_CHARS) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def group_color(group: int) -> str:
    """Stage colours; negative groups (work outside every stage) are grey."""
    return "#bab0ac" if group < 0 else color(group)


def label_margin(labels: list[str]) -> float:
    """Left margin that fits the longest (shortened) row label."""
    return min(260.0, max(80.0, 24 + max((text_width(shorten(t)) for t in labels), default=0)))


def value_scale(fmt, largest: float, pixels: tuple[float, float]) -> Scale:
    """A 0-based scale for values printed with `fmt`; byte axes tick at whole GiB/MiB."""
    unit = byte_unit(largest) if fmt is fmt_bytes else 1.0
    return Scale((0.0, largest), pixels, tick_unit=unit)


@dataclass(frozen=True)
class Axis:
    """One value axis of a chart: its title and how its values are written."""

    title: str
    fmt: Callable[[float], str]
    log: bool = False
    """A logarithmic scale (line_chart's x: GPU counts)."""
    zero_based: bool = False
    """From 0 rather than below the smallest value (line_chart's y)."""


@dataclass(frozen=True)
class BarRow:
    """One horizontal bar made of coloured segments."""

    label: str
    """Row label (shortened on the chart, in full in the tooltip)."""
    segments: tuple[tuple[str, float], ...]
    """(segment name, value) from left to right."""
    group: int = 0
    """Colour group (stage index, negative for none) when segments are coloured by row."""
    note: str = ""
    """Extra tooltip text."""


def stacked_bars(rows: list[BarRow], axis: Axis, label: str, cap: tuple[float, str] | None = None,
                 group_names: dict[int, str] | None = None, row_height: float = 26) -> str:
    """Horizontal stacked bars, one per row; optional vertical cap line (value, label: e.g. GPU memory). With
    `group_names` the bars are coloured by their row's group (named so in the legend), else by segment."""
    fmt, axis_title = axis.fmt, axis.title
    cap, cap_label = cap if cap is not None else (None, "")
    color_by_group = group_names is not None
    names = list(dict.fromkeys(name for row in rows for name, _ in row.segments))
    left, right = label_margin([row.label for row in rows]), WIDTH - 70
    if color_by_group:
        groups = sorted({r.group for r in rows}, key=lambda g: (g < 0, g))
        entries = [(group_names.get(g, f"stage {g}"), group_color(g)) for g in groups]
    else:
        entries = [(name.replace("_", " "), color(i)) for i, name in enumerate(names)]
    top = 26 + legend_height(entries, right - left)
    bottom = top + row_height * len(rows)
    largest = max([sum(v for _, v in row.segments) for row in rows] + [1e-30])
    off_scale = bool(cap) and cap > CAP_ZOOM * largest
    chart = Svg(WIDTH, bottom + (66 if off_scale else 48), label)
    chart.legend(left, 16, entries, right)
    if off_scale:
        note = f"{cap_label}: off the scale, {cap / largest:.0f}× the largest bar"
        chart.text(right, bottom + 56, note, "end", WARN)
        cap = None
    largest = max(largest, cap or 0.0)
    x = value_scale(fmt, largest * 1.04, (left, right))
    chart.x_axis(x, bottom + 4, top - 6, axis_title, fmt)
    previous_group = None
    for i, row in enumerate(rows):
        y = top + i * row_height
        if color_by_group and previous_group is not None and row.group != previous_group:
            chart.line(8, y, right, y, MUTED, **{"stroke-dasharray": "4 3"})
        previous_group = row.group
        chart.text(left - 8, y + row_height / 2 + 4, shorten(row.label), "end")
        start = 0.0
        total = sum(v for _, v in row.segments)
        for j, (name, value) in enumerate(row.segments):
            if value <= 0:
                continue
            fill = group_color(row.group) if color_by_group else color(names.index(name))
            opacity = 1.0 if not color_by_group or j == 0 else 0.5
            tip = f"{row.label}\n{name.replace('_', ' ')}: {fmt(value)} of {fmt(total)}" + (
                f"\n{row.note}" if row.note else "")
            chart.rect(x(start), y + 3, x(start + value) - x(start), row_height - 6, fill, tip,
                       opacity=opacity if opacity < 1 else None)
            start += value
        chart.text(x(total) + 4, y + row_height / 2 + 4, fmt(total), "start", MUTED)
    if cap:
        chart.line(x(cap), top - 6, x(cap), bottom + 4, WARN, **{"stroke-width": 1.5, "stroke-dasharray": "5 3"})
        chart.text(x(cap) - 4, bottom - 4, cap_label, "end", WARN)
    return chart.render()


def gantt(events: list[ScheduleEvent], ranks: int, label: str, elided: tuple[ElidedSpan, ...] = ()) -> str:
    """The pipeline schedule: a compute lane per pipeline rank, and its send and receive lanes when the
    schedule has any; `elided` runs of blocks are drawn as one grey block each."""
    left, right, lane_h, gap = 80, WIDTH - 30, 26, 12
    lanes = [COMPUTE] + [lane for lane in (COMMUNICATION, RECEIVE) if any(e.lane == lane for e in (*events, *elided))]
    names = {COMPUTE: "", COMMUNICATION: "comm", RECEIVE: "recv"}
    kinds = list(dict.fromkeys(e.kind for e in events))
    entries = [(k.replace("_", " "), KIND_COLORS.get(k, MUTED)) for k in kinds]
    if elided:
        entries.append(("elided (aggregated)", ELIDED_COLOR))
    top = 26 + legend_height(entries, right - left)
    rank_h = len(lanes) * lane_h + gap
    bottom = top + ranks * rank_h - gap + 4
    chart = Svg(WIDTH, bottom + 44, label)
    chart.legend(left, 16, entries, right)
    end = max((e.end_s for e in (*events, *elided)), default=1e-9) or 1e-9
    x = Scale((0.0, end), (left, right))
    chart.x_axis(x, bottom, top - 4, "time within one optimizer step", fmt_seconds, 8)
    for r in range(ranks):
        y = top + r * rank_h
        chart.text(left - 10, y + lane_h / 2 + 4, f"rank {r}", "end", INK, **{"font-weight": 600})
        for i, lane in enumerate(lanes[1:], 1):
            chart.text(left - 10, y + i * lane_h + lane_h / 2 + 4, names[lane], "end", MUTED)
        chart.rect(left, y + 1, right - left, len(lanes) * lane_h - 2, "#f7f9fb")
    for span in elided:
        y = top + span.rank * rank_h + lanes.index(span.lane) * lane_h
        x0, x1 = x(span.start_s), x(span.end_s)
        kinds_text = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in span.kinds)
        tip = (f"rank {span.rank}: {span.label} ({kinds_text})\n{fmt_seconds(span.start_s)} → "
               f"{fmt_seconds(span.end_s)}: busy {fmt_seconds(span.busy_s)}, idle {fmt_seconds(span.idle_s)}")
        chart.rect(x0, y + 2, max(x1 - x0 - 0.6, 0.4), lane_h - 4, ELIDED_COLOR, tip, rx=2)
    shortest = ELIDED_DRAWN_PX if elided else 0.4
    for e in events:
        y = top + e.rank * rank_h + lanes.index(e.lane) * lane_h
        x0, x1 = x(e.start_s), x(e.end_s)
        stage = "" if e.stage is None else f"stage {e.stage}, "
        when = f"{fmt_seconds(e.start_s)} → {fmt_seconds(e.end_s)} ({fmt_seconds(e.duration_s)})"
        tip = f"rank {e.rank}: {e.label}\n{stage}{when}"
        chart.rect(x0, y + 2, max(x1 - x0 - 0.6, shortest), lane_h - 4, KIND_COLORS.get(e.kind, MUTED), tip, rx=2)
        if e.kind in COMPUTE_KINDS and x1 - x0 > 9 * len(str(e.microbatch)) + 4:
            chart.text((x0 + x1) / 2, y + lane_h / 2 + 4, e.microbatch, "middle",
                       "#ffffff" if e.kind == "forward" else INK)
    return chart.render()


@dataclass(frozen=True)
class Point:
    """One candidate layout on the time-vs-memory scatter."""

    memory_bytes: float
    """Peak memory per GPU."""
    step_time_s: float
    """Predicted step time."""
    tip: str
    """Tooltip text."""
    fits: bool
    """Whether it fits in GPU memory."""
    chosen: bool = False
    """The plan's layout."""


def pareto_front(points: list[Point]) -> list[Point]:
    """Points no other point beats in both memory and step time, by increasing memory."""
    front: list[Point] = []
    for p in sorted(points, key=lambda p: (p.memory_bytes, p.step_time_s)):
        if not front or p.step_time_s < front[-1].step_time_s:
            front.append(p)
    return front


def scatter(points: list[Point], cap: float, label: str) -> str:
    """Step time against memory per GPU, Pareto front joined, memory cap as a vertical line."""
    left, right, top, bottom = 80, WIDTH - 30, 40, 390
    max_memory = max(p.memory_bytes for p in points) * 1.05
    cap_text = f"usable memory per GPU {fmt_bytes(cap)}"
    off_scale = cap > CAP_ZOOM * max_memory
    chart = Svg(WIDTH, bottom + (68 if off_scale else 50), label)
    if off_scale:
        chart.text(right, bottom + 58, f"{cap_text}: off the scale, {cap / max_memory:.0f}× the largest", "end", WARN)
    else:
        max_memory = max(max_memory, cap * 1.05)
    times = [p.step_time_s for p in points if p.step_time_s > 0] or [1e-3]
    use_log = max(times) / min(times) > 30
    y_domain = (min(times) / 1.5, max(times) * 1.5) if use_log else (0.0, max(times) * 1.08)
    x = value_scale(fmt_bytes, max_memory, (left, right))
    y = Scale(y_domain, (bottom, top), log=use_log)
    chart.x_axis(x, bottom, top, "peak memory per GPU", fmt_bytes)
    chart.y_axis(y, left, right, "predicted step time" + (" (log scale)" if use_log else ""), fmt_seconds)
    if cap <= max_memory:
        chart.rect(x(cap), top, right - x(cap), bottom - top, "#fbeeee")
        chart.line(x(cap), top, x(cap), bottom, WARN, **{"stroke-width": 1.5, "stroke-dasharray": "5 3"})
        near_right = x(cap) + 8 + text_width(cap_text) > right
        chart.text(x(cap) + (-4 if near_right else 4), bottom - 8, cap_text, "end" if near_right else "start", WARN)
    front = pareto_front(points)
    chart.polyline([(x(p.memory_bytes), y(p.step_time_s)) for p in front], ACCENT,
                   **{"stroke-width": 1.5, "stroke-dasharray": "3 2"})
    on_front = {id(p) for p in front}
    for p in sorted(points, key=lambda p: p.chosen):
        fill = ACCENT if p.fits else WARN
        radius = 7 if p.chosen else 4.5 if id(p) in on_front else 3.5
        chart.circle(x(p.memory_bytes), y(p.step_time_s), radius, fill if id(p) in on_front or p.chosen else "#ffffff",
                     p.tip, stroke=INK if p.chosen else fill, **{"stroke-width": 2 if p.chosen else 1.2})
    chart.legend(left, 16, [("fits", ACCENT), ("does not fit", WARN)], right)
    chart.text(right, 16, "filled: on the Pareto front · large, outlined: chosen", "end", MUTED)
    return chart.render()


def line_chart(series: list[tuple[str, str, list[tuple[float, float]]]], x_axis: Axis, y_axis: Axis, label: str,
               dashed: tuple[str, ...] = (), halo: tuple[str, ...] = ()) -> str:
    """Lines with dots; series are (name, colour, [(x, y), ...]). Up to 12 distinct x values become the
    x ticks (steps, GPU counts); `halo` series are drawn wide and pale under the others."""
    x_title, fmt_x, x_log = x_axis.title, x_axis.fmt, x_axis.log
    y_title, fmt_y, zero_based = y_axis.title, y_axis.fmt, y_axis.zero_based
    left, right, top, bottom = 80, WIDTH - 30, 40, 310
    chart = Svg(WIDTH, bottom + 50, label)
    xs = sorted({px for _, _, pts in series for px, _ in pts}) or [0.0, 1.0]
    ys = [py for _, _, pts in series for _, py in pts] or [0.0, 1.0]
    y_low, y_high = (0.0 if zero_based else min(ys)), max(ys)
    pad = (y_high - y_low) * 0.08 or abs(y_high) * 0.05 or 1.0
    x_domain = (xs[0], xs[-1] if xs[-1] > xs[0] else xs[0] + 1)
    x = Scale(x_domain, (left, right), log=x_log and xs[0] > 0, fixed_ticks=tuple(xs) if len(xs) <= 12 else ())
    y = Scale((y_low if zero_based else y_low - pad, y_high + pad), (bottom, top))
    chart.x_axis(x, bottom, top, x_title, fmt_x)
    chart.y_axis(y, left, right, y_title, fmt_y)
    for name, stroke, pts in sorted(series, key=lambda s: s[0] not in halo):
        style = {"stroke-width": 7 if name in halo else 1.6 if name in dashed else 2.5,
                 "stroke-dasharray": "6 4" if name in dashed else None, "stroke-linecap": "round",
                 "stroke-linejoin": "round", "opacity": 0.7 if name in halo else None}
        chart.polyline([(x(a), y(b)) for a, b in pts], stroke, name, **style)
        for a, b in pts:
            chart.circle(x(a), y(b), 5 if name in halo else 3, stroke,
                         f"{name}\n{x_title}: {fmt_x(a)}\n{y_title}: {fmt_y(b)}")
    chart.legend(left, 16, [(name, stroke) for name, stroke, _ in series], right)
    return chart.render()


def compare_bars(rows: list[tuple[str, float, str]], fmt, axis_title: str, label: str) -> str:
    """A few single bars side by side (predicted vs measured)."""
    left, right, top, row_h = label_margin([name for name, _, _ in rows]), WIDTH - 80, 14, 30
    chart = Svg(WIDTH, top + row_h * len(rows) + 48, label)
    x = value_scale(fmt, max([v for _, v, _ in rows] + [1e-30]) * 1.05, (left, right))
    bottom = top + row_h * len(rows)
    chart.x_axis(x, bottom + 4, top, axis_title, fmt)
    for i, (name, value, fill) in enumerate(rows):
        yy = top + i * row_h
        chart.text(left - 8, yy + row_h / 2 + 4, name, "end")
        chart.rect(left, yy + 4, x(value) - left, row_h - 8, fill, f"{name}: {fmt(value)}", rx=2)
        chart.text(x(value) + 4, yy + row_h / 2 + 4, fmt(value), "start", MUTED)
    return chart.render()

