"""One vocabulary and one home for the rules of a valid layout (autoplan/layout.py)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from autoplan.layout import (ALL_FEATURES, PARTS, UNSUPPORTED_PAIRS, VOCABULARY, Layout, Scope, problems,
                             to_plan_fields)
from autoplan.plan import Parallelism
from autoplan.report.csv import CANDIDATE_COLUMNS
from autoplan.solve.pins import PIN_KEYS

ROOT = Path(__file__).resolve().parent.parent


def test_the_layouts_doc_lists_the_vocabulary():
    """docs/layouts.md's table has a row per concept with its plan.json name, in VOCABULARY's order (rows for
    top-level plan.json fields beside them, tensor_parallel_plan say, may sit between), and the README links to it."""
    table = (ROOT / "docs" / "layouts.md").read_text()
    for term in VOCABULARY:
        assert f"| `{term.short}` |" in table, f"docs/layouts.md's table lacks {term.short}"
        if term.plan_field:
            assert f"`{term.plan_field}`" in table, f"docs/layouts.md's table lacks {term.plan_field}"
    rows = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    short = [term.short for term in VOCABULARY]
    assert [name for name in rows if name in short] == short, "docs/layouts.md's rows are not in VOCABULARY's order"
    assert "(docs/layouts.md)" in (ROOT / "README.md").read_text()


def test_pins_csv_and_plan_fields_use_the_vocabulary():
    short = {t.short for t in VOCABULARY}
    assert set(PIN_KEYS) <= short
    assert {f.name for f in fields(Layout)} <= short
    layout_columns = set(CANDIDATE_COLUMNS) - {"rank", "fits", "step_time_s", "peak_memory_gib", "host_memory_gib",
                                               "reason", "bubble_s", "schedule_tradeoff"}
    assert layout_columns <= short
    assert {f.name for f in fields(Parallelism)} <= short
    plan_fields = {t.plan_field for t in VOCABULARY}
    assert set(to_plan_fields(Parallelism())) <= plan_fields


def test_every_rule_is_reported_at_once_with_its_arithmetic():
    layout = Layout(dp=3, tp=16, pp=4, schedule="interleaved", microbatch=5, recompute="full")
    found = problems(layout, Scope(num_gpus=8, gpus_per_node=8, global_batch=12, num_modules=6,
                                   features=frozenset({"tp", "1f1b"})))
    text = "; ".join(found)
    for part in ("tp=16 does not divide 8 GPUs", "dp=3 does not divide 8 GPUs", "dp=3 x tp=16 x pp=4 = 192, not 8",
                 "microbatch=5 does not divide the 4 samples per data-parallel rank",
                 "schedule=interleaved is not supported yet", "recompute=full is not supported yet",
                 "schedule=interleaved needs at least 2 x pp=4 = 8 modules, the model splits into 6"):
        assert part in text, text


def test_unknown_facts_skip_their_rules():
    """A pin before capture: only what the cluster decides is checked."""
    assert problems(Layout(pp=64, microbatch=3), Scope(num_gpus=64)) == []
    assert problems(Layout(pp=64), Scope(num_gpus=64, num_modules=10)) == [
        "pp=64 exceeds the 10 modules the model splits into"]


@pytest.mark.parametrize("phrase", ["does not divide", "micro-batches, but", "must be at least 1", "is not one of",
                                    "needs schedule=", "stages, but the plan lists"])
def test_layout_rules_are_written_only_in_layout_py(phrase):
    """The rules' messages live in autoplan/layout.py; the model's own tensor-parallel facts (heads,
    features, vocabulary) come from chain/tensor_parallel.py through Scope.tensor_parallel_problems."""
    allowed = {ROOT / "autoplan" / "layout.py", ROOT / "autoplan" / "chain" / "tensor_parallel.py"}
    unrelated = re.compile(r"(--steps|batch size) must be at least 1")
    for path in (ROOT / "autoplan").rglob("*.py"):
        if path in allowed:
            continue
        lines = [line for line in path.read_text().splitlines() if phrase in line and not unrelated.search(line)]
        assert not lines, f"{path.relative_to(ROOT)} writes a layout rule: {lines[0].strip()}"


def test_compiled_recompute_over_tensor_parallel_shards_is_refused_unless_sequence_parallel_outside_the_ring():
    from autoplan.layout import ALL_FEATURES, SUPPORTED, Layout, Scope, problems

    def refused(layout, features=SUPPORTED):
        return [p for p in problems(layout, Scope(features=features)) if "AOTAutograd" in p]

    assert refused(Layout(tp=2, sp="off", cp=1, recompute="full", compile="on")) == [
        "compile=on with recompute=full at tp=2 with sp=off: torch.compile of a recomputed module over tensor-parallel "
        "shards fails in AOTAutograd here unless they are sequence shards outside the ring (use compile=off, "
        "recompute=none, tp=1, or sp=on with cp=1)"]
    assert "with cp=2" in refused(Layout(tp=2, sp="on", cp=2, recompute="selective", compile="on"))[0]
    for runs in (Layout(tp=2, sp="on", cp=1, recompute="full", compile="on"),
                 Layout(tp=2, sp="off", cp=2, recompute="none", compile="on"),
                 Layout(tp=1, cp=2, recompute="full", compile="on"),
                 Layout(tp=2, sp="off", cp=2, recompute="selective", compile="off")):
        assert not refused(runs), runs
    assert not refused(Layout(tp=2, sp="off", recompute="full", compile="on"), ALL_FEATURES)  # priced


PART_VALUES = {"tp": {"tp": 2}, "cp": {"cp": 2}, "ep": {"ep": 2}, "pp": {"pp": 2}, "offload": {"offload": "cpu"}}


@pytest.mark.parametrize("pair", UNSUPPORTED_PAIRS, ids=lambda p: p.feature)
def test_each_unsupported_pair_refuses_its_two_parts_together_with_its_reason(pair):
    """layout.UNSUPPORTED_PAIRS is the rule: a layout using both parts breaks it, once, unless the features hold
    the pair's name; either part alone does not."""
    assert pair.feature in ALL_FEATURES and set(PARTS) == set(PART_VALUES)
    both = Layout(dp_shard=4, **PART_VALUES[pair.first], **PART_VALUES[pair.second])
    without = Scope(features=ALL_FEATURES - {pair.feature})
    found = [p for p in problems(both, without) if pair.reason in p]
    assert len(found) == 1 and found[0].endswith(")") and "(use " in found[0]
    assert not [p for p in problems(both, Scope(features=ALL_FEATURES)) if pair.reason in p]
    for alone in (pair.first, pair.second):
        assert not [p for p in problems(Layout(dp_shard=4, **PART_VALUES[alone]), without) if pair.reason in p]


def test_only_the_compile_rules_read_compile():
    """layout.compile_problems (what search.runnable checks of each variant compiled) holds every rule that reads
    compile: on a grid of layouts every other rule says the same compiled as uncompiled, while the compile rules
    refuse some compiled layouts the rules accept uncompiled (so a shortcut skipping them would be wrong)."""
    import itertools

    from autoplan.layout import COMPILE_RULES, RULES, SUPPORTED, compile_problems

    scopes = [Scope(num_gpus=16, gpus_per_node=8, global_batch=32, num_modules=8, features=features, num_experts=(4,))
              for features in (SUPPORTED, ALL_FEATURES)]
    refused_compiled = 0
    for tp, pp, cp, ep, schedule, recompute, sp in itertools.product(
            (1, 2), (1, 2), (1, 2), (1, 2), ("1f1b", "zb-interleaved"), ("none", "selective", "full"), ("on", "off")):
        for scope in scopes:
            layout = Layout(dp_shard=4, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, schedule=schedule, recompute=recompute,
                            microbatch=1)
            on = Layout(**{**layout.__dict__, "compile": "on"})
            for rule in RULES:
                if rule not in COMPILE_RULES:
                    assert rule(on, scope) == rule(layout, scope), (rule.__name__, on)
            if not problems(layout, scope) and problems(on, scope):
                refused_compiled += 1
                assert compile_problems(on, scope)
            assert bool(compile_problems(on, scope)) == bool(problems(on, scope)) or problems(layout, scope)
    assert refused_compiled
