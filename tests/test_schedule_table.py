"""Pipeline schedules as one table (autoplan.layout.SCHEDULE_TABLE) and one placement rule (layout.stage_rank):
every consumer reads a schedule's facts from its row, so a new schedule is a row and its operation order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplan import layout
from autoplan.cost import pipeline
from autoplan.layout import SCHEDULE_TABLE, rank_stages, stage_rank
from autoplan.plan import Parallelism
from autoplan.report.rollup import describe_layout
from autoplan.solve.layouts import SCHEDULE_PREFERENCE, virtual_stages_tried


@pytest.mark.parametrize("placement, pp, virtual", [("loop", 4, 1), ("loop", 4, 3), ("v", 4, 2), ("v", 3, 2)])
def test_rank_stages_inverts_stage_rank(placement, pp, virtual):
    """Each stage runs on exactly one rank, each rank runs `virtual` stages, and rank_stages lists them in order."""
    held = {r: list(rank_stages(r, pp, virtual, placement)) for r in range(pp)}
    assert sorted(s for stages in held.values() for s in stages) == list(range(pp * virtual))
    for r, stages in held.items():
        assert len(stages) == virtual and stages == sorted(stages)
        assert all(stage_rank(s, pp, placement) == r for s in stages)


def test_the_cost_model_writes_each_schedule_of_the_table_once():
    """cost/pipeline.ORDERS holds an operation order for every row of SCHEDULE_TABLE and nothing else; split-backward
    rows give their order through split_backward_order too, the others refuse it."""
    assert set(pipeline.ORDERS) == {s.name for s in SCHEDULE_TABLE}
    for schedule in SCHEDULE_TABLE:
        order = pipeline.rank_order(schedule.name, 2, 4, 0, max(schedule.virtual_stages[0], 1))
        assert order == pipeline.ORDERS[schedule.name](2, 4, 0, max(schedule.virtual_stages[0], 1))
        if schedule.split_backward:
            assert pipeline.split_backward_order(schedule.name, 2, 4, 0, schedule.virtual_stages[0]) == order
        else:
            with pytest.raises(ValueError, match="does not split its backward"):
                pipeline.split_backward_order(schedule.name, 2, 4, 0, 1)


def test_the_v_placement_puts_the_first_and_last_stage_on_rank_zero():
    assert [stage_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_rank(s, 4, "loop") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("schedule", SCHEDULE_TABLE, ids=lambda s: s.name)
def test_every_row_is_priced_searched_and_named(schedule):
    """What a row needs beside itself: an operation order in the cost model, its micro-batches in flight, a place
    in the search's preference; the search's virtual stages come from the row."""
    p, m, v = 4, 8, schedule.searched_from
    assert schedule.name in SCHEDULE_PREFERENCE
    assert list(virtual_stages_tried(schedule.name))[0] == schedule.searched_from
    for rank in range(p):
        order = pipeline.rank_order(schedule.name, p, m, rank, v)
        assert sum(kind == "F" for kind, _, _ in order) == m * v
    for stage in range(p * v):
        assert 1 <= pipeline.microbatches_in_flight(schedule.name, p, m, stage, v) <= m
    assert schedule.display_name


@pytest.fixture
def row_edited(monkeypatch):
    """Replace fields of a schedule's row for one test (the cost model's caches cleared around it)."""
    def edit(name: str, **fields) -> None:
        monkeypatch.setitem(layout.SCHEDULE_BY_NAME, name, replace(layout.SCHEDULE_BY_NAME[name], **fields))
        pipeline.microbatches_in_flight.cache_clear()

    yield edit
    pipeline.microbatches_in_flight.cache_clear()


def test_micro_batches_in_flight_follow_the_row(row_edited):
    """The cost model reads the rule from the row: GPipe's row given 1F1B's rule keeps 1F1B's micro-batches."""
    p, m = 4, 8
    assert [pipeline.microbatches_in_flight("gpipe", p, m, s) for s in range(p)] == [m] * p
    row_edited("gpipe", in_flight="pp_minus_stage")
    assert [pipeline.microbatches_in_flight("gpipe", p, m, s) for s in range(p)] == [4, 3, 2, 1]


def test_the_report_names_a_schedule_by_its_row(row_edited):
    par = Parallelism(dp_replicate=1, pp=2, schedule="1f1b",
                      microbatches=4)
    assert "PP 2 (1F1B," in describe_layout(par)
    row_edited("1f1b", display_name="one-forward-one-backward")
    assert "PP 2 (one-forward-one-backward," in describe_layout(par)


def test_the_search_tries_virtual_stages_from_the_row(row_edited):
    assert list(virtual_stages_tried("interleaved"))[:2] == [2, 3]
    row_edited("interleaved", searched_from=3)
    assert list(virtual_stages_tried("interleaved"))[0] == 3


@pytest.mark.parametrize("placement, virtual, last_rank", [("loop", 1, 3), ("loop", 2, 3), ("v", 2, 0)])
def test_the_program_finds_its_last_stage_by_the_placement(placement, virtual, last_rank):
    from autoplan.runtime.distributed.mesh import RankLayout

    ranks = [RankLayout(rank=r, pp_rank=r, dp_rank=0, dp=1, pp=4, placement=placement,
                        virtual_stages=virtual) for r in range(4)]
    assert [r.pp_rank for r in ranks if r.is_last_stage] == [last_rank]
