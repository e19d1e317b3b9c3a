"""Small helpers to draw inline SVG by hand: no plotting library, no network, every string escaped."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

FONT = "11px"
INK = "#243b53"
"""Text and axes."""
MUTED = "#829ab1"
"""Grid lines, secondary text."""
GRID = "#e4e9ef"
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#e15759", "#9c755f",
           "#bab0ac", "#ff9da7")
"""Categorical colours (Tableau 10): distinct, colour-blind tolerant, calm."""
ACCENT = "#4e79a7"
WARN = "#c0392b"


def esc(value: object) -> str:
    """Escape anything for use in HTML/SVG text and attribute values."""
    return html.escape(str(value), quote=True)


def color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^k) covering [low, high]."""
    if not math.isfinite(low) or not math.isfinite(high):
        return [0.0]
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


@dataclass
class Scale:
    """A linear map from data values to pixels."""

    domain: tuple[float, float]
    """(low, high) data values."""
    pixels: tuple[float, float]
    """Pixel positions of low and high (high may be the smaller one for y axes)."""
    log: bool = False
    """Logarithmic instead of linear (domain must be positive)."""
    tick_unit: float = 1.0
    """Ticks are round numbers of this unit (2**30 puts byte ticks at whole GiB)."""
    fixed_ticks: tuple[float, ...] = ()
    """Use these ticks instead of computed ones (e.g. the GPU counts of a scaling curve)."""

    def __call__(self, value: float) -> float:
        low, high = self.domain
        if self.log:
            low, high, value = math.log10(low), math.log10(high), math.log10(max(value, self.domain[0]))
        span = (high - low) or 1.0
        return self.pixels[0] + (value - low) / span * (self.pixels[1] - self.pixels[0])

    def ticks(self, count: int = 5) -> list[float]:
        """Round values inside the domain."""
        low, high = self.domain
        if self.fixed_ticks:
            candidates = list(self.fixed_ticks)
        elif self.log:
            decades = [10.0 ** k for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)]
            candidates = decades if len(decades) > 3 else [d * m for d in decades for m in (1, 2, 5)]
        else:
            candidates = [t * self.tick_unit for t in nice_ticks(low / self.tick_unit, high / self.tick_unit, count)]
        slack = (high - low) * 1e-9
        return [t for t in candidates if low - slack <= t <= high + slack]


@dataclass
class Svg:
    """An SVG drawing built from escaped parts."""

    width: float
    """Width in CSS pixels (the drawing scales down on narrow screens)."""
    height: float
    """Height in CSS pixels."""
    label: str = ""
    """Accessible name of the chart (aria-label)."""
    parts: list[str] = field(default_factory=list)
    """Escaped SVG elements, in drawing order."""

    def rect(self, x: float, y: float, w: float, h: float, fill: str, tip: str | None = None, **attrs) -> None:
        self._element("rect", tip, x=x, y=y, width=max(0.0, w), height=max(0.0, h), fill=fill, **attrs)

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = GRID, **attrs) -> None:
        self._element("line", None, x1=x1, y1=y1, x2=x2, y2=y2, stroke=stroke, **attrs)

    def circle(self, cx: float, cy: float, r: float, fill: str, tip: str | None = None, **attrs) -> None:
        self._element("circle", tip, cx=cx, cy=cy, r=r, fill=fill, **attrs)

    def polyline(self, points: list[tuple[float, float]], stroke: str, tip: str | None = None, **attrs) -> None:
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        self._element("polyline", tip, points=coords, fill="none", stroke=stroke, **attrs)

    def text(self, x: float, y: float, content: object, anchor: str = "start", fill: str = INK, **attrs) -> None:
        attributes = _attributes({"x": x, "y": y, "text-anchor": anchor, "fill": fill, **attrs})
        self.parts.append(f"<text{attributes}>{esc(content)}</text>")

    def _element(self, name: str, tip: str | None, **attrs) -> None:
        attributes = _attributes(attrs)
        if tip is None:
            self.parts.append(f"<{name}{attributes}/>")
        else:
            self.parts.append(f"<{name}{attributes}><title>{esc(tip)}</title></{name}>")

    def x_axis(self, scale: Scale, y: float, top: float, title: str, fmt, count: int = 5) -> None:
        """Vertical grid lines with tick labels below `y`, and the axis title under them."""
        for tick in scale.ticks(count):
            x = scale(tick)
            self.line(x, top, x, y, GRID)
            self.text(x, y + 14, fmt(tick), "middle", MUTED)
        self.line(scale.pixels[0], y, scale.pixels[1], y, MUTED)
        self.text((scale.pixels[0] + scale.pixels[1]) / 2, y + 32, title, "middle", INK, **{"font-weight": 600})

    def y_axis(self, scale: Scale, x: float, right: float, title: str, fmt, count: int = 5) -> None:
        """Horizontal grid lines with tick labels left of `x`, and a rotated axis title."""
        for tick in scale.ticks(count):
            y = scale(tick)
            self.line(x, y, right, y, GRID)
            self.text(x - 6, y + 4, fmt(tick), "end", MUTED)
        self.line(x, scale.pixels[0], x, scale.pixels[1], MUTED)
        middle = (scale.pixels[0] + scale.pixels[1]) / 2
        self.text(14, middle, title, "middle", INK, transform=f"rotate(-90 14 {middle:.1f})",
                  **{"font-weight": 600})

    def legend(self, x: float, y: float, entries: list[tuple[str, str]], right: float) -> None:
        """(name, colour) swatches from (x, y), wrapping before `right` (see legend_lines)."""
        for (name, fill), (dx, line) in zip(entries, _legend_layout(entries, right - x)):
            self.rect(x + dx, y + line * LEGEND_LINE - 9, 10, 10, fill, rx=2)
            self.text(x + dx + 14, y + line * LEGEND_LINE, name)

    def render(self) -> str:
        return (f'<svg class="chart" viewBox="0 0 {self.width:.0f} {self.height:.0f}" width="{self.width:.0f}" '
                f'height="{self.height:.0f}" role="img" aria-label="{esc(self.label)}" '
                f'font-size="{FONT}">' + "".join(self.parts) + "</svg>")


LEGEND_LINE = 17
"""Pixels between wrapped legend lines."""
CHAR_WIDTH = 6.3
"""Average width of an 11px sans-serif character, pixels (for layout estimates only)."""


def text_width(text: str) -> float:
    return CHAR_WIDTH * len(text)


def _legend_layout(entries: list[tuple[str, str]], width: float) -> list[tuple[float, int]]:
    """(x offset, line) of each legend entry, wrapping at `width`."""
    positions, dx, line = [], 0.0, 0
    for name, _ in entries:
        entry = 28 + text_width(name)
        if dx > 0 and dx + entry > width:
            dx, line = 0.0, line + 1
        positions.append((dx, line))
        dx += entry
    return positions


def legend_height(entries: list[tuple[str, str]], width: float) -> float:
    """Vertical pixels a legend of `entries` needs at `width`."""
    lines = 1 + max((line for _, line in _legend_layout(entries, width)), default=0)
    return lines * LEGEND_LINE


def byte_unit(largest: float) -> float:
    """The binary unit byte-axis ticks are round numbers of."""
    return next((u for u in (2.0**40, 2.0**30, 2.0**20, 2.0**10) if largest >= 2 * u), 1.0)


def _attributes(attrs: dict) -> str:
    out = []
    for key, value in attrs.items():
        if value is None:
            continue
        name = key.rstrip("_").replace("_", "-")
        text = f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)
        out.append(f' {name}="{esc(text)}"')
    return "".join(out)


def fmt_bytes(value: float) -> str:
    """Bytes in binary units: 512 MiB, 1.5 GiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def fmt_seconds(value: float) -> str:
    """Seconds with a readable unit: 850 µs, 12.5 ms, 3.2 s."""
    if value == 0:
        return "0"
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def fmt_number(value: float, unit: str = "") -> str:
    """Compact number with an SI prefix: 1.2k, 3.4M, 0.25; with a unit: 4.2 TFLOP."""
    space = " " if unit else ""
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{space}{prefix}{unit}"
    return f"{value:.3g}{space}{unit}"
