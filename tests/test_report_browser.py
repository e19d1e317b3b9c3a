"""report.html in a real browser: headless Chromium renders it offline, without console errors or
network requests, into a screenshot full of chart colours. Needs the `chromium` package (.ci/run)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest
from report_fixtures import SCALING, VERIFY, make_result, moe_result

from autoplan.report.html import write_report

WINDOW = (1280, 2400)
BACKGROUND = (0xF5, 0xF7, 0xFA)
"""The page background (--bg in the report's CSS)."""
CHART_BLUE = (0x4E, 0x79, 0xA7)
"""The first palette colour: forward blocks, memory bars, chosen layout."""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed to render report.html: apt-get install -y chromium (see .ci/run)")


def run_chromium(tmp_path, page, *args: str) -> subprocess.CompletedProcess:
    """Run headless Chromium on a file; no network (every host resolves to nothing), net log kept."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path / 'profile'}",
               "--enable-logging=stderr", "--v=0", f"--log-net-log={tmp_path / 'net.json'}",
               f"--window-size={WINDOW[0]},{WINDOW[1]}", *args, page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def console_messages(stderr: str) -> list[str]:
    """Lines Chromium logs for console output (errors, uncaught exceptions, warnings)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def page_requests(tmp_path) -> list[str]:
    """URLs the page itself asked for (the browser's own service requests carry no page origin)."""
    log = json.loads((tmp_path / "net.json").read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [e["params"]["url"] for e in log["events"]
            if e["type"] == start and e.get("params", {}).get("initiator") not in (None, "not an origin")
            and not e["params"]["url"].startswith("file:")]


def decode_png(data: bytes) -> np.ndarray:
    """RGB(A) 8-bit PNG -> array of shape (height, width, channels); undoes the per-row filters."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, []
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color_type in (2, 6) and interlace == 0, (depth, color_type, interlace)
        elif kind == b"IDAT":
            chunks.append(body)
    bpp = 3 if color_type == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), dtype=np.uint8).reshape(height, stride + 1)
    image = np.zeros((height, stride), dtype=np.uint8)
    prior = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            row = line.copy()
        elif kind == 1:  # Sub: running sum per channel
            row = (np.cumsum(line.reshape(width, bpp).astype(np.int64), axis=0) % 256).astype(np.uint8).ravel()
        elif kind == 2:  # Up
            row = line + prior
        else:  # Average and Paeth depend on the byte just decoded: byte by byte
            row = np.array(_unfilter_sequential(int(kind), line.tolist(), prior.tolist(), bpp), dtype=np.uint8)
        image[y] = row
        prior = row
    return image.reshape(height, width, bpp)


def _unfilter_sequential(kind: int, cur: list[int], up: list[int], bpp: int) -> list[int]:
    for i in range(len(cur)):
        a = cur[i - bpp] if i >= bpp else 0
        b = up[i]
        c = up[i - bpp] if i >= bpp else 0
        if kind == 3:
            predicted = (a + b) >> 1
        else:
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            predicted = a if pa <= pb and pa <= pc else b if pb <= pc else c
        cur[i] = (cur[i] + predicted) & 255
    return cur


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path):
    write_report(make_result(pp=4, microbatches=8, layers=8), tmp_path, VERIFY, SCALING)
    page = tmp_path / "report.html"
    shot = tmp_path / "report.png"
    done = run_chromium(tmp_path, page, f"--screenshot={shot}")
    assert console_messages(done.stderr) == []
    assert page_requests(tmp_path) == []

    image = decode_png(shot.read_bytes())[:, :, :3]
    assert image.shape[:2] == (WINDOW[1], WINDOW[0])
    packed = (image[..., 0].astype(np.uint32) << 16) | (image[..., 1].astype(np.uint32) << 8) | image[..., 2]
    colours, counts = np.unique(packed, return_counts=True)
    share = dict(zip(colours.tolist(), (counts / packed.size).tolist()))
    pack = lambda rgb: (rgb[0] << 16) | (rgb[1] << 8) | rgb[2]  # noqa: E731
    assert len(colours) > 300, f"only {len(colours)} distinct colours: blank or unstyled page"
    assert 0.2 < share.get(pack(BACKGROUND), 0) < 0.9, "page background missing or covering everything"
    assert share.get(pack(CHART_BLUE), 0) > 0.003, "no chart bars drawn in the palette's blue"

    dom = run_chromium(tmp_path, page, "--dump-dom").stdout
    assert dom.count("<svg") >= 6 and dom.count("</svg>") == dom.count("<svg")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom and "<script>alert(1)" not in dom


@pytest.mark.slow
def test_the_experts_section_renders_for_a_model_with_experts(tmp_path):
    result, _, _ = moe_result()
    write_report(result, tmp_path)
    done = run_chromium(tmp_path, tmp_path / "report.html", "--dump-dom")
    assert console_messages(done.stderr) == [] and page_requests(tmp_path) == []
    start = done.stdout.index('<section id="experts">')
    section = done.stdout[start:done.stdout.index("</section>", start)]
    assert "Expert parallelism: why this layout" in section and section.count("<tr") == 3  # header, ep=4, ep=1


@pytest.mark.slow
def test_an_elided_schedule_renders_with_its_totals(tmp_path):
    # 8 ranks x 2 chunks x 128 micro-batches: past schedule.DRAWN_EVENTS, so runs of blocks are aggregated
    result = make_result(pp=8, microbatches=128, schedule="interleaved", chunks=2, layers=30)
    write_report(result, tmp_path)
    done = run_chromium(tmp_path, tmp_path / "report.html", "--dump-dom")
    assert console_messages(done.stderr) == [] and page_requests(tmp_path) == []
    start = done.stdout.index("<h2>Schedule of one step")
    section = done.stdout[start:done.stdout.index("</section>", start)]
    assert "<strong>Elided</strong>" in section and section.count("elided: ") > 8
    assert section.count("</svg>") == section.count("<svg") == 1
    assert "Totals per pipeline rank" in section and section.count("<tr><td") == 8


@pytest.mark.slow
def test_the_checks_catch_a_broken_page(tmp_path):
    # The same detectors flag a page with a console error and a network fetch, so passing means something.
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><p>x</p><img src="https://example.invalid/x.png">'
                    '<script>console.error("boom"); missing();</script>')
    done = run_chromium(tmp_path, page, "--dump-dom")
    assert any("boom" in line for line in console_messages(done.stderr))
    assert any("Uncaught ReferenceError" in line for line in console_messages(done.stderr))
    assert page_requests(tmp_path) == ["https://example.invalid/x.png"]
