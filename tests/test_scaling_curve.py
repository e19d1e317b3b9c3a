"""The report's scaling curve (autoplan.solve.scaling.scaling_curve): every point is the search's choice at that GPU
count, the planned count is the plan's own, and a point cut short by its budget of layouts says so; the CLI's
searches in a second process give the same curve."""

from dataclasses import replace

import pytest
from chain_fixtures import GIB, cluster, gpt_profile

from autoplan.solve import scaling
from autoplan.solve.scaling import SCALING_FACTORS, ScalingInBackground, scaling_curve
from autoplan.errors import UserError
from autoplan.plan import Training
from autoplan.solve import layouts
from autoplan.solve.search import search

PROFILE = gpt_profile(n_layer=6, n_embd=256, vocab=1024, seq=128, batch=2, n_head=4)
TRAINING = Training(global_batch_size=32, dtype="bf16")


def test_points_are_the_search_choice_at_each_count():
    planned = cluster(8)
    points = scaling_curve(PROFILE, planned, TRAINING, max_priced=10_000)
    assert [p.gpus for p in points] == sorted({max(1, round(8 * f)) for f in SCALING_FACTORS})
    for point in points:
        other = replace(planned, num_gpus=point.gpus, gpus_per_node=min(8, point.gpus))
        batch = TRAINING.global_batch_size * point.gpus // 8
        best = search(PROFILE, other, replace(TRAINING, global_batch_size=batch)).best
        assert point.note == "" and point.layout == layouts.describe(best.parallelism)
        # the curve skips the MILP refinement of the split, which can only make the step faster
        assert point.samples_per_s == pytest.approx(best.predicted.samples_per_s, rel=0.05)
        assert point.samples_per_s <= best.predicted.samples_per_s * (1 + 1e-9)


def test_the_planned_count_is_the_plan_and_a_spent_budget_is_said():
    planned = cluster(8)
    best = search(PROFILE, planned, TRAINING).best
    points = scaling_curve(PROFILE, planned, TRAINING, planned=best, max_priced=0)
    at_plan = next(p for p in points if p.gpus == 8)
    assert at_plan.samples_per_s == best.predicted.samples_per_s and at_plan.note == ""
    others = [p for p in points if p.gpus != 8]
    assert others and all(p.samples_per_s is None and "did not finish" in p.note for p in others)


def test_a_count_where_nothing_fits_is_kept_with_its_reason():
    tight = replace(cluster(8), memory_per_gpu_bytes=0.05 * GIB)
    with pytest.raises(UserError):
        search(PROFILE, replace(tight, num_gpus=1, gpus_per_node=1), replace(TRAINING, global_batch_size=4))
    point = scaling_curve(PROFILE, tight, TRAINING, max_priced=10_000)[0]
    assert point.gpus == 1 and point.samples_per_s is None and point.note == "no layout fits"


def test_the_log_line_names_the_gpu_counts(caplog):
    """Once "best layouts at 8/8 .. 4x8 GPUs", which read as arithmetic nobody could follow."""
    caplog.set_level("INFO", logger="autoplan")
    points = scaling_curve(PROFILE, cluster(8), TRAINING, max_priced=0)
    assert [p.gpus for p in points] == [1, 2, 4, 8, 16, 32]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("scaling curve:")]
    assert lines == ["scaling curve: best layouts at 1, 2, 4, 8, 16, 32 GPUs (1/8 to 4 times the plan's 8)"]


def test_the_curve_searched_in_a_second_process_is_the_same():
    planned = cluster(8)
    best = search(PROFILE, planned, TRAINING).best
    background = ScalingInBackground(PROFILE, planned, TRAINING, search_planned_count=False)
    assert background.points(best) == scaling_curve(PROFILE, planned, TRAINING, planned=best)
    pinned = ScalingInBackground(PROFILE, planned, TRAINING, search_planned_count=True, max_priced=3).points()
    assert pinned == scaling_curve(PROFILE, planned, TRAINING, max_priced=3)
    assert any(p.note.startswith("bounded: best of the first 3 layouts") for p in pinned)


def test_a_failed_second_process_is_said_and_the_curve_searched_here(monkeypatch, caplog):
    def fails(sender, *args):
        sender.send(("error", "RuntimeError: boom"))
        sender.close()

    monkeypatch.setattr(scaling, "_search_in_child", fails)
    caplog.set_level("WARNING", logger="autoplan")
    points = ScalingInBackground(PROFILE, cluster(8), TRAINING, search_planned_count=True).points()
    assert points == scaling_curve(PROFILE, cluster(8), TRAINING)
    assert [r.getMessage() for r in caplog.records] == [
        "scaling curve: the search in a second process failed (RuntimeError: boom); searching here"]


def test_a_cancelled_second_process_is_stopped():
    background = ScalingInBackground(PROFILE, cluster(8), TRAINING, search_planned_count=True, max_priced=10_000)
    process = background._process
    background.cancel()
    assert process is None or not process.is_alive()


def test_the_caller_takes_the_counts_the_second_process_has_not_claimed(monkeypatch, caplog):
    """The second process claims the fewest GPUs first; the caller, from the most GPUs down, takes every count not
    claimed yet; a count claimed but never delivered (the process died) is searched by the caller too."""
    def first_then_dies(sender, claimed, counts, gpu_counts):
        assert scaling._claim(claimed, 0) and scaling._claim(claimed, 1)  # claims two, delivers one, dies
        sender.send(("point", counts.point(gpu_counts[0])))
        sender.close()

    monkeypatch.setattr(scaling, "_search_in_child", first_then_dies)
    caplog.set_level("WARNING", logger="autoplan")
    points = ScalingInBackground(PROFILE, cluster(8), TRAINING, search_planned_count=True).points()
    assert points == scaling_curve(PROFILE, cluster(8), TRAINING)
    assert [r.getMessage() for r in caplog.records] == [
        "scaling curve: the search in a second process failed (it ended with exit code 0 and no result); "
        "searching here"]
