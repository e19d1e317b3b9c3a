"""profile --measure counts the rows each expert's router sends it on the real model (profile/router_loads.py):
every (token, slot) row once per expert layer, kept in profile.json, and none without experts or without
--measure."""

from pathlib import Path

import pytest

from autoplan.cost.context import TableKey
from autoplan.api import ProfileOptions, profile_only
from autoplan.profile.router_loads import measure_router_loads
from autoplan.profile_data import ModelProfile
from autoplan.contract import load_source

MIXTRAL = '''
"""examples/mixtral.py at tiny sizes."""
import importlib.util

_spec = importlib.util.spec_from_file_location("autoplan_example_mixtral", {path!r})
mixtral = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mixtral)
mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS = 64, 16, 32, 2, 2, 1
mixtral.SEQ_LEN, mixtral.EXPERTS, mixtral.EXPERTS_PER_TOKEN = 8, 4, 2
build_model, example_batch, loss_fn = mixtral.build_model, mixtral.example_batch, mixtral.loss_fn
'''
ROOT = Path(__file__).resolve().parents[1]


def _tiny_mixtral(tmp_path) -> Path:
    path = tmp_path / "tiny_mixtral.py"
    path.write_text(MIXTRAL.format(path=str(ROOT / "examples" / "mixtral.py")))
    return path


def test_every_row_is_counted_once_per_expert_layer(tmp_path):
    source = load_source(str(_tiny_mixtral(tmp_path)))
    loads = measure_router_loads(source, 2, parameter_bytes=0)
    assert sorted(loads) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for counts in loads.values():
        assert len(counts) == 4 and sum(counts) == 2 * 8 * 2  # batch x tokens x slots
    assert measure_router_loads(source, 2, parameter_bytes=2**40) == {}  # too large to build here
    assert measure_router_loads(load_source(str(ROOT / "examples" / "gpt.py")), 2, parameter_bytes=0) == {}


def test_profile_measure_keeps_the_counts_in_profile_json(tmp_path):
    model = _tiny_mixtral(tmp_path)
    measured = profile_only(str(model), "cpu", ProfileOptions(measure=True, out=tmp_path / "measured"))
    assert sum(measured.router_loads["model.layers.0.mlp.experts"]) > 0
    saved = ModelProfile.from_json((tmp_path / "measured" / "profile.json").read_text())
    assert saved.router_loads == measured.router_loads
    assert profile_only(str(model), "h100-sxm5-80gb", ProfileOptions(measure=False)).router_loads == {}


def test_measured_loads_set_the_busiest_expert_rank_in_the_plan(tmp_path):
    """ep=2 over 4 experts: rows split 10/10/0/0 put every row on rank 0 (2x the mean), 6/6/4/4 put 12 of 20
    there (1.2x), 5/5/5/5 none extra. The experts' compute grows by the ratio: the extra time of 10/10/0/0 is
    five times that of 6/6/4/4, and 5/5/5/5 costs what one rank holding every expert does."""
    from dataclasses import replace

    from chain_fixtures import cluster

    from autoplan.cost.context import Context
    from autoplan.layout import SUPPORTED
    from autoplan.plan import Training

    profile = profile_only(str(_tiny_mixtral(tmp_path)), "h100-sxm5-80gb", ProfileOptions(measure=False))
    names = [f"model.layers.{i}.mlp.experts" for i in range(2)]

    def forward_s(rows):
        measured = replace(profile, router_loads={name: rows for name in names})
        ctx = Context(measured, cluster(8), Training(8, "bf16"), SUPPORTED | {"ep"})
        return sum(ctx.table(TableKey(1, 1, ep=2)).forward_s), sum(ctx.table(TableKey(1, 1)).forward_s)

    even, whole = forward_s((5, 5, 5, 5))
    skewed, _ = forward_s((10, 10, 0, 0))
    mild, _ = forward_s((6, 6, 4, 4))
    assert even == pytest.approx(whole)
    assert skewed > mild > even
    assert (skewed - even) == pytest.approx(5 * (mild - even))
