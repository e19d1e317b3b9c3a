"""Why not a parameter server (issue 21): GPT-2 and Llama-3-70B planned for 64 H100s show the parameter-server
layout in candidates.csv and report.html with its predicted step time and the reason it lost. The row's numbers
are checked against the closed form (cost/parameter_server.py's push and pull, AdamW on the servers, the
replica's compute under DDP priced by the search itself) and the reason's numbers against the columns."""

import html
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from autoplan.api import PlanOptions, plan_model
from autoplan.cost.compute import ADAMW_BYTES_PER_PARAM
from autoplan.hardware.profiles import load_hardware
from autoplan.hardware.types import Cluster
from autoplan.plan import Parallelism
from autoplan.report.csv import candidates_frame
from autoplan.report.html import why_not_section
from autoplan.solve.parameter_server import SERVERS_PER_NODE
from autoplan.solve.pins import parse_pins
from autoplan.solve.search import search
from report_fixtures import FakeCandidate, make_plan

pytest.importorskip("transformers", reason="the GPT-2 and Llama examples are built from transformers configs")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPUS, PER_NODE, GIB = 64, 8, 2**30
H100 = load_hardware("h100-sxm5-80gb")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2") / "out"
    return plan_model(str(EXAMPLES / "hf_gpt2.py"), GPUS, options=PlanOptions(out=out)), out


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama70b") / "out"
    return plan_model(f"{EXAMPLES / 'llama.py'}:llama3_70b", GPUS, options=PlanOptions(out=out)), out


def server_row(out: Path) -> pd.Series:
    frame = pd.read_csv(out / "candidates.csv")
    rows = frame[frame.gradient_sync == "parameter_server"]
    assert len(rows) == 1 and set(frame.gradient_sync) == {"collectives", "parameter_server"}
    assert list(frame["rank"]) == list(range(1, len(frame) + 1)) and frame.iloc[0].reason == "chosen"
    return rows.iloc[0]


def closed_form(result) -> dict[str, float]:
    """The parameter server's transfers and server update for this model on 64 H100s in 8 nodes, by hand:
    fp32 gradients pushed and bf16 weights pulled through 8 server links of the inter-node link's bandwidth."""
    params = result.plan.model.param_count
    link, servers = H100.inter_node, SERVERS_PER_NODE * GPUS // PER_NODE
    server_rate = servers * link.bus_bandwidth_bytes_per_s
    host = H100.host
    return {"servers": servers,
            "push_s": link.latency_s + GPUS * 4 * params / server_rate,
            "pull_s": link.latency_s + GPUS * 2 * params / server_rate,
            "update_s": params / servers * ADAMW_BYTES_PER_PARAM["fused"]
            / (host.memory_bandwidth_bytes_per_s * host.memory_efficiency)}


def number_after(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in {text!r}"
    return float(found.group(1))


@pytest.mark.parametrize("model", ["gpt2", "llama70b"])
def test_the_parameter_server_row_is_the_closed_form_and_loses(model, request):
    result, out = request.getfixturevalue(model)
    ps, row, chosen = result.parameter_server, server_row(out), result.plan.predicted.step_time_s
    expected = closed_form(result)
    assert (ps.workers, ps.servers) == (GPUS, expected["servers"])
    assert ps.gradient_bytes == 4 * result.plan.model.param_count  # fp32 gradients: every parameter once
    assert ps.sync.push_s == pytest.approx(expected["push_s"], rel=1e-9)
    assert ps.sync.pull_s == pytest.approx(expected["pull_s"], rel=1e-9)
    assert ps.server_update_s == pytest.approx(expected["update_s"], rel=1e-9)
    assert ps.sync.bottleneck == "server links"
    assert ps.step_time_s == pytest.approx(ps.compute_s + ps.sync.push_s + ps.sync.pull_s + ps.server_update_s)
    # the workers' compute cannot beat the GPUs' peak: the model's FLOPs over 64 x 989 TFLOP/s
    assert ps.compute_s > result.plan.predicted.model_flops_per_step / (GPUS * H100.gpu.peak_flops["bf16"])
    assert row.step_time_s == pytest.approx(ps.step_time_s) and row.step_time_s > 5 * chosen
    assert (row.dp_replicate, row.dp_shard, row.tp, row.pp, row.microbatch) == (GPUS, 1, 1, 1, 256 // GPUS)
    assert row.peak_memory_gib == pytest.approx(ps.peak_memory_bytes / GIB)
    # the servers' host memory per node: 16 bytes per parameter (fp32 weight, gradient, AdamW moments) / 8
    assert row.host_memory_gib == pytest.approx(16 * result.plan.model.param_count / expected["servers"] / GIB)


@pytest.mark.parametrize("model", ["gpt2", "llama70b"])
def test_the_reason_carries_the_numbers_of_the_columns(model, request):
    result, out = request.getfixturevalue(model)
    row, reason = server_row(out), server_row(out).reason
    ps, chosen = result.parameter_server, result.plan.predicted.step_time_s
    assert number_after(r"step ([\d.e+-]+) s =", reason) == float(f"{row.step_time_s:.3g}")
    assert number_after(r"the chosen layout's ([\d.e+-]+) s", reason) == float(f"{chosen:.3g}")
    assert number_after(r"push \d+ x [\d.]+ GB / \(8 servers x 42.5 GB/s\) = ([\d.e+-]+) s", reason) == \
        float(f"{ps.sync.push_s - H100.inter_node.latency_s:.3g}")
    ring = number_after(r"vs ([\d.e+-]+) s for a ring all-reduce", reason)
    assert ring == float(f"{ps.ring_all_reduce_s:.3g}") and ring < ps.sync.step_s / 5
    assert number_after(r"([\d.]+)x the chosen", reason) == float(f"{row.step_time_s / chosen:.3g}")


def test_gpt2_fits_and_loses_on_time_only(gpt2):
    result, out = gpt2
    row = server_row(out)
    assert bool(row.fits) and "does not fit" not in row.reason


def test_llama_70b_loses_on_memory_too(llama70b):
    result, out = llama70b
    row = server_row(out)
    assert not row.fits and row.peak_memory_gib > 80
    assert number_after(r"([\d.]+) GiB per GPU", row.reason) == round(row.peak_memory_gib, 1)
    usable = result.plan.cluster.memory_per_gpu_bytes / GIB
    assert number_after(r"has ([\d.]+) GiB", row.reason) == round(usable, 1)


def test_the_workers_compute_is_the_replica_the_search_prices_under_ddp(gpt2):
    """DDP at dp=64 (micro-batch 4, no recompute) priced by the search on the same profile: the parameter
    server's compute is its step without the gradient all-reduce and the optimizer step."""
    result, _ = gpt2
    cluster = Cluster(H100, GPUS, PER_NODE)
    ddp = search(result.profile, cluster, result.plan.training,
                 parse_pins(f"dp={GPUS},zero=0,microbatch=4,recompute=none,compile=on")).best.predicted
    breakdown = ddp.time_breakdown
    assert result.parameter_server.compute_s == pytest.approx(
        ddp.step_time_s - breakdown["data_parallel_comm"] - breakdown["optimizer"], rel=1e-9)
    assert result.parameter_server.compile


@pytest.mark.parametrize("model", ["gpt2", "llama70b"])
def test_the_report_says_why_not_a_parameter_server_with_the_arithmetic(model, request):
    result, out = request.getfixturevalue(model)
    page = (out / "report.html").read_text()
    section = page[page.index('<section id="why-not">'):]
    section = html.unescape(section[:section.index("</section>")])
    assert "Why not a parameter server?" in section
    assert result.parameter_server.reason in section
    assert f"{GPUS} × " in section and "ring all-reduce of the same gradients (DDP)" in section
    assert "Horovod" in section


def fake_layout(step_time_s: float) -> SimpleNamespace:
    """Duck-typed stand-in for solve.parameter_server.ParameterServerLayout."""
    sync = SimpleNamespace(push_s=step_time_s / 2, pull_s=step_time_s / 4, step_s=step_time_s * 3 / 4,
                           bottleneck="server links", arithmetic="push ...")
    return SimpleNamespace(parallelism=Parallelism(dp_replicate=4), compile=False, fits=True,
                           workers=4, servers=1, link_bytes_per_s=1e9, gradient_bytes=1e9, parameter_bytes=5e8,
                           sync=sync, server_update_s=0.0, compute_s=step_time_s / 4, ring_all_reduce_s=0.1,
                           step_time_s=step_time_s, peak_memory_bytes=2 * GIB, host_memory_per_node_bytes=GIB,
                           reason="parameter server: <slower>")


def test_the_row_takes_its_place_by_fit_and_time_and_the_section_stands_alone():
    plan = make_plan()
    fast = FakeCandidate(Parallelism(dp_replicate=4), (), plan.predicted, True, "")
    oom = FakeCandidate(Parallelism(dp_replicate=2), (), None, False, "OOM by 3 GiB")
    ps = fake_layout(plan.predicted.step_time_s * 3)
    frame = candidates_frame((fast, oom), fast, ps)
    assert list(frame.gradient_sync) == ["collectives", "parameter_server", "collectives"]
    assert list(frame["rank"]) == [1, 2, 3] and frame.iloc[1].host_memory_gib == 1.0
    assert list(candidates_frame((fast, oom), fast).gradient_sync) == ["collectives"] * 2
    alone = why_not_section(replace(plan, alternatives=()), (fast,), fast, ps)
    assert alone.startswith("<h2>Why not a parameter server?</h2>") and "&lt;slower&gt;" in alone
    assert "Why not a parameter server?" not in why_not_section(plan, (fast,), fast)
