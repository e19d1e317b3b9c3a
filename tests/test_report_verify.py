"""The verification section of report.html with verify.json from `autoplan verify --measure`: overall,
per-stage and per-rank predicted vs measured, and robustness to hand-edited (malformed, hostile) files."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser

import pytest
from report_fixtures import EVIL, VERIFY, make_result

from autoplan.report.html import add_verification, verify_section, write_report
from autoplan.report.svg import fmt_bytes
from autoplan.report.verify_view import (MEMORY_TOLERANCE, ROWS_SHOWN, TIME_TOLERANCE, error_badge,
                                         relative_error)

MB = 1_000_000


def full_verify() -> dict:
    """verify.json of a 2-stage x 2-replica run, as `autoplan verify --measure` writes it."""
    stage_modules = [["wte", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "lm_head"]]
    stages = [{"index": 0, "modules": stage_modules[0], "predicted_time_s": 0.01, "predicted_memory_bytes": 29 * MB,
               "measured_peak_memory_bytes": 30 * MB,
               "memory_breakdown": {"parameters": 1 * MB, "gradients": 1 * MB, "optimizer": 2 * MB,
                                    "activations": 5 * MB}},
              {"index": 1, "modules": stage_modules[1], "predicted_time_s": 0.012, "predicted_memory_bytes": 20 * MB,
               "measured_peak_memory_bytes": 25 * MB,
               "memory_breakdown": {"parameters": 4 * MB, "gradients": 4 * MB, "optimizer": 8 * MB,
                                    "activations": 4 * MB}}]
    ranks = [{"rank": r, "pp_rank": r // 2, "dp_rank": r % 2, "tp_rank": 0, "stages": [r // 2],
              "measured_step_time_s": [0.2, 0.21, 0.18, 0.127][r],
              "measured_peak_memory_bytes": [30 * MB, 29.5 * MB, 25 * MB, 24 * MB][r],
              "predicted_peak_memory_bytes": [29 * MB, 29 * MB, 20 * MB, 20 * MB][r]} for r in range(4)]
    return {**VERIFY, "parity_tolerance": 1e-4, "passed": True,
            "measured_step_time_s": 0.21, "predicted_step_time_s": 0.19,
            "measured_peak_memory_bytes": 31 * MB, "predicted_peak_memory_bytes": 29 * MB,
            "step_time_error": 0.19 / 0.21 - 1, "peak_memory_error": 29 / 31 - 1,
            "measured_on": "cpu (gloo): peak memory = peak of live tensor storage bytes during a step",
            "predicted_for": "cpu", "ranks": ranks, "stages": stages}


class Tables(HTMLParser):
    """Text of every body row (a row of <td> cells) per table, and the h3 heading each table is under."""

    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.captions: list[str] = []
        self.heading = ""
        self._in_heading = False
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "h3":
            self._in_heading, self.heading = True, ""
        elif tag == "table":
            self.tables.append([])
            self.captions.append(self.heading)
        elif tag == "tr":
            self._row = []
        elif tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "h3":
            self._in_heading = False
        elif tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row:
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._in_heading:
            self.heading += data

    def rows(self, heading: str) -> list[list[str]]:
        """Body rows of all tables under the h3 `heading` (folded ones included)."""
        return [row for table, caption in zip(self.tables, self.captions) if caption == heading for row in table]


def section_of(verify) -> tuple[str, Tables]:
    html = verify_section(verify)
    parser = Tables()
    parser.feed(html)
    parser.close()
    return html, parser


def svg_with_label(html: str, label: str) -> str:
    match = re.search(rf'<svg[^>]*aria-label="{re.escape(label)}".*?</svg>', html, re.S)
    assert match, f"no chart {label!r}"
    return match.group(0)


def test_full_verify_shows_every_stage_and_rank_with_their_errors(tmp_path):
    verify = full_verify()
    write_report(make_result(), tmp_path, verify)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    html = page[page.index('<section id="verification">'):]
    parser = Tables()
    parser.feed(html)

    assert "Step time</strong>: predicted 190 ms, measured 210 ms (-9.5%" in html
    assert f"Peak memory</strong>: predicted {fmt_bytes(29 * MB)}, measured {fmt_bytes(31 * MB)} (-6.5%" in html

    stage_rows = parser.rows("Per pipeline stage")
    assert [row[0] for row in stage_rows] == ["0", "1"]
    assert stage_rows[0][1] == "wte, blocks.0 … blocks.2 (4 modules)"
    assert stage_rows[1][1] == "blocks.3, lm_head"
    for row, stage in zip(stage_rows, verify["stages"]):
        error = stage["predicted_memory_bytes"] / stage["measured_peak_memory_bytes"] - 1
        assert row[2:] == ["10 ms" if stage["index"] == 0 else "12 ms", fmt_bytes(stage["predicted_memory_bytes"]),
                           fmt_bytes(stage["measured_peak_memory_bytes"]), f"{error * 100:+.1f}%"]
    assert stage_rows[1][5] == "-20.0%"  # beyond ±15%: red

    rank_rows = parser.rows("Per rank")
    assert [row[:5] for row in rank_rows] == [["0", "0", "0", "0", "0"], ["1", "0", "1", "0", "0"],
                                              ["2", "1", "0", "0", "1"], ["3", "1", "1", "0", "1"]]
    assert [row[7] for row in rank_rows] == ["-5.0%", "-9.5%", "+5.6%", "+49.6%"]
    assert all(row[6] == "190 ms" for row in rank_rows)  # the plan's step time, for every rank
    assert [row[10] for row in rank_rows] == ["-3.3%", "-1.7%", "-20.0%", "-16.7%"]
    # the badge colours follow the tolerances: rank 3's time, stage 1's and ranks 2-3's memory are red
    assert html.count('class="badge bad"') == 1 + 1 + 2
    assert "cpu (gloo): peak memory = peak of live tensor storage bytes" in html


def test_stage_chart_draws_predicted_stacks_and_measured_bars_to_scale():
    verify = full_verify()
    html, _ = section_of(verify)
    chart = svg_with_label(html, "predicted vs measured memory per stage")
    widths = {title.split("\n")[0]: float(width) for width, title in
              re.findall(r'<rect[^>]*width="([\d.]+)"[^>]*><title>([^<]*)</title>', chart)}
    measured = [widths[f"stage {i}, measured: {fmt_bytes(s['measured_peak_memory_bytes'])}"]
                for i, s in enumerate(verify["stages"])]
    assert measured[1] / measured[0] == pytest.approx(25 / 30, rel=0.01)
    # stage 0's predicted bar: its four categories plus the unexplained rest ("other"), adding up to 29 MB
    segments = re.findall(r'<rect[^>]*width="([\d.]+)"[^>]*><title>stage 0, predicted\n([a-z ]+): ', chart)
    assert [name for _, name in segments] == ["parameters", "gradients", "optimizer", "activations", "other"]
    assert sum(float(w) for w, _ in segments) / measured[0] == pytest.approx(29 / 30, rel=0.01)
    assert "measured 28.6 MiB (-3.3%)" in chart  # 30 MB measured, printed at the bar's end


def test_without_stages_or_ranks_the_section_renders_as_before():
    html, parser = section_of(VERIFY)
    assert "Per pipeline stage" not in html and "Per rank" not in html and "<table" not in html
    assert html.count("<svg") == 2  # loss parity, predicted vs measured step time
    assert "predicted / measured = 0.86" in html and "Peak memory" not in html
    parity_only = {k: v for k, v in VERIFY.items() if "step_time" not in k}
    html, _ = section_of(parity_only)
    assert "Predicted vs measured" not in html and html.count("<svg") == 1 and ">parity<" in html


def test_hostile_strings_are_escaped(tmp_path):
    verify = full_verify()
    verify["stages"][0]["modules"] = [EVIL, f'x" onmouseover="{EVIL}']
    verify["stages"][1]["memory_breakdown"] = {EVIL: 1 * MB}
    verify.update(measured_on=EVIL, predicted_for=EVIL, nproc=EVIL, error=EVIL)
    write_report(make_result(), tmp_path, {"losses": [1.0]})
    add_verification(tmp_path, verify)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    section = page[page.index('<section id="verification">'):]
    assert "<script" not in page and 'x" onmouseover' not in page
    assert section.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 6  # table, tooltips, legend, notes, error


NAN = float("nan")
MALFORMED = [
    {"stages": "all of them", "ranks": 4},
    {"stages": [None, 3, "x", []], "ranks": [None, "rank 0"]},
    {"stages": [{"index": "0", "modules": 5, "predicted_memory_bytes": "29e6", "measured_peak_memory_bytes": None,
                 "predicted_time_s": NAN, "memory_breakdown": "lots"}],
     "ranks": [{"rank": "zero", "pp_rank": 0.5, "stages": "0,1", "measured_step_time_s": NAN,
                "measured_peak_memory_bytes": True, "predicted_peak_memory_bytes": -1}]},
    {"stages": [{"index": 0, "predicted_memory_bytes": 1e6, "measured_peak_memory_bytes": 0,
                 "memory_breakdown": {"parameters": NAN, "activations": 5e6, "gradients": "1"}}, {}],
     "ranks": [{}, {"rank": 1, "measured_step_time_s": 0, "predicted_step_time_s": float("inf")}]},
    {"measured_step_time_s": "0.2", "predicted_step_time_s": None, "measured_peak_memory_bytes": NAN,
     "predicted_peak_memory_bytes": float("inf"), "parity_max_abs_diff": "tiny", "parity_tolerance": "big",
     "losses": "many", "reference_losses": {"a": 1}, "nproc": None, "measured_on": 7, "predicted_for": ["cpu"]},
    {"measured_step_time_s": 0.0, "predicted_step_time_s": 0.1, "measured_peak_memory_bytes": -5,
     "predicted_peak_memory_bytes": 0, "losses": [1, None, "x", NAN], "reference_losses": [1, 2]},
]


@pytest.mark.parametrize("changes", MALFORMED)
def test_malformed_values_never_fail_the_page(tmp_path, changes):
    verify = {**full_verify(), **changes}
    # through a file, as the CLI does: json writes NaN/Infinity and reads them back
    (tmp_path / "verify.json").write_text(json.dumps(verify))
    write_report(make_result(), tmp_path)
    add_verification(tmp_path, json.loads((tmp_path / "verify.json").read_text()))
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    section = page[page.index('<section id="verification">'):page.index("<!-- verify:end -->")]
    assert section.count("<svg") == section.count("</svg>") and section.endswith("</section>")
    assert not re.search(r"\b(nan|inf)\b", re.sub(r"<[^>]*>", " ", section).lower()), \
        "a malformed number reached the page"


def test_a_malformed_stage_shows_dashes_not_numbers():
    html, parser = section_of({**full_verify(), **MALFORMED[2]})
    assert parser.rows("Per pipeline stage") == [["0", "–", "–", "–", "–", "–"]]
    assert parser.rows("Per rank") == [["0", "–", "–", "–", "–", "–", "190 ms", "–", "–", "–", "–"]]
    assert "predicted vs measured memory per stage" not in html  # nothing to draw


@pytest.mark.parametrize("verify", [[], "verify", None, 3])
def test_a_verify_json_that_is_not_an_object_still_renders(verify):
    html, _ = section_of(verify)
    assert "NO parity" in html and "no losses recorded" in html and "Per rank" not in html


def test_a_failed_run_is_never_shown_as_parity():
    # verify.py writes passed=false and a null difference when a loss is NaN; the other losses agree
    nan_run = {**VERIFY, "losses": VERIFY["losses"][:5] + [NAN], "parity_max_abs_diff": None}
    assert "NO parity" in section_of(nan_run)[0]
    assert "NO parity" in section_of({**VERIFY, "passed": False})[0]
    short = {**VERIFY, "losses": VERIFY["losses"][:3], "parity_max_abs_diff": None}
    assert "NO parity" in section_of(short)[0] and "do not compare" in section_of(short)[0]
    recomputed = {**VERIFY, "parity_max_abs_diff": None}
    html = section_of(recomputed)[0]
    assert ">parity<" in html and "2.00e-07" in html
    failed = section_of({**VERIFY, "passed": False, "error": "rank 1: RuntimeError: boom"})[0]
    assert "The run failed" in failed and "RuntimeError: boom" in failed


def test_the_gradient_check_is_shown_and_its_failure_is_never_parity():
    checked = {**VERIFY, "gradient_max_rel_diff": 4.3e-7, "gradient_tolerance": 1e-3,
               "gradient_worst": "blocks.0.ln_1.bias on rank 1"}
    html = section_of(checked)[0]
    assert ">parity<" in html and "max relative difference 4.30e-07 at blocks.0.ln_1.bias on rank 1 (within" in html
    halved = {**checked, "passed": False, "gradient_max_rel_diff": 0.5, "gradient_worst": "mlp.fc.weight on rank 0"}
    html = section_of(halved)[0]
    assert "NO parity" in html and "5.00e-01 at mlp.fc.weight on rank 0 (ABOVE tolerance 0.001)" in html
    missing = {**checked, "passed": False, "gradient_max_rel_diff": None, "gradient_problem": "no rank reports 'w'"}
    assert "First-step gradients: FAIL, no rank reports &#x27;w&#x27;" in section_of(missing)[0]
    assert "First-step gradients" not in section_of(VERIFY)[0]  # a verify.json from before the check


def test_many_ranks_fold_into_details():
    verify = full_verify()
    verify["ranks"] = [{**verify["ranks"][0], "rank": r} for r in range(ROWS_SHOWN + 4)]
    html, parser = section_of(verify)
    assert len(parser.rows("Per rank")) == ROWS_SHOWN + 4
    assert "<summary>4 more ranks</summary>" in html


def test_errors_and_their_badges():
    assert relative_error(0.19, 0.21) == pytest.approx(-0.0952, abs=1e-4)
    assert relative_error(1.0, 0.0) is None and relative_error(None, 1.0) is None
    assert 'class="badge ok"' in error_badge(TIME_TOLERANCE - 0.01, TIME_TOLERANCE)
    assert 'class="badge bad"' in error_badge(-(TIME_TOLERANCE + 0.01), TIME_TOLERANCE)
    assert 'class="badge ok"' in error_badge(-(MEMORY_TOLERANCE - 0.01), MEMORY_TOLERANCE)
    assert 'class="badge bad"' in error_badge(MEMORY_TOLERANCE + 0.01, MEMORY_TOLERANCE)
    assert error_badge(None, TIME_TOLERANCE) == "–" and not math.isnan(relative_error(2.0, 4.0))


@pytest.mark.slow
def test_full_section_renders_in_headless_chromium(tmp_path):
    from test_report_browser import console_messages, page_requests, run_chromium

    write_report(make_result(), tmp_path, full_verify())
    done = run_chromium(tmp_path, tmp_path / "report.html", "--dump-dom")
    assert console_messages(done.stderr) == [] and page_requests(tmp_path) == []
    dom = done.stdout
    assert 'aria-label="predicted vs measured memory per stage"' in dom and dom.count("<table") >= 3
