"""One name per concept in the planning core: no Python name there spells a layout concept another way than
layout.VOCABULARY's short name (num_microbatches for microbatches, zero_stage for zero, ...), nor by its plan.json
name (those live in the codec's strings: layout.PLAN_CODEC).

Checked: the Python names (identifiers, attributes, keywords; not strings, comments or docstrings) of the planning
core, CORE below. autoplan/runtime/, autoplan/codegen/ and the rest of autoplan/ are not checked yet: the runtime and
the generated program's constants are issue 29's other lane this session (they still hold some, e.g.
num_microbatches), and join CORE when that lands."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

from autoplan.layout import VOCABULARY

PACKAGE = Path(__file__).resolve().parent.parent / "autoplan"
CORE = ("plan.py", "api.py", "layout.py", "cost", "solve", "report", "chain")
"""The planning core, under autoplan/."""

SECOND_SPELLINGS = {
    "num_microbatches": "microbatches", "n_microbatches": "microbatches", "num_micro_batches": "microbatches",
    "micro_batches": "microbatches",
    "microbatch_size": "microbatch", "micro_batch_size": "microbatch", "mbs": "microbatch",
    "zero_stage": "zero (Parallelism.zero, or dp_shard and reshard)",
    "sequence_parallel": "sp",
    "num_ranks": "pp", "pp_size": "pp", "pipeline_parallel_size": "pp",
    "tp_size": "tp", "tensor_parallel_size": "tp", "dp_size": "dp", "data_parallel_size": "dp",
    "cp_size": "cp", "ep_size": "ep",
    "fsdp": "fsdp_shard (Parallelism.fsdp_shard)", "fsdp_shard_degree": "fsdp_shard",
    "virtual": "virtual_stages", "num_virtual_stages": "virtual_stages", "virtual_pipeline_stages": "virtual_stages",
    "reshard_after_forward": "reshards_after_forward (Parallelism.reshards_after_forward) or reshard",
    "activation_checkpointing": "recompute", "cpu_offload": "offload",
}
"""A second spelling -> the one name (layout.VOCABULARY's short name, or Parallelism's derived property)."""


def _forbidden() -> dict[str, str]:
    """SECOND_SPELLINGS, and each plan.json field name of the vocabulary -> its short name."""
    plan_names = {term.plan_field: term.short for term in VOCABULARY if term.plan_field.isidentifier()}
    return {**SECOND_SPELLINGS, **plan_names}


def _core_files() -> list[Path]:
    out = []
    for part in CORE:
        path = PACKAGE / part
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def _names(source: str) -> list[tuple[str, int]]:
    """(Python name, line) of every name token of `source`."""
    return [(tok.string, tok.start[0]) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.NAME]


def test_the_planning_core_spells_each_concept_one_way():
    forbidden = _forbidden()
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} {name} (use {forbidden[name]})"
             for path in _core_files() for name, line in _names(path.read_text()) if name in forbidden]
    assert not found, "second spellings in the planning core:\n" + "\n".join(found)


def test_the_table_holds_no_vocabulary_name_and_the_check_reads_names_only():
    short = {term.short for term in VOCABULARY}
    assert not short & set(_forbidden()), "a second spelling in the table is a vocabulary short name"
    assert {"pipeline_parallel_num_microbatches", "data_parallel_shard_degree"} <= set(_forbidden())
    source = ('"""num_microbatches in a docstring"""\nx = "zero_stage"  # sequence_parallel\n'
              'def f(num_ranks): return plan.fsdp\n')
    assert [name for name, _ in _names(source) if name in _forbidden()] == ["num_ranks", "fsdp"]
    assert all(path.is_file() for path in _core_files()) and len(_core_files()) > 40
