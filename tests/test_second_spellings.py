"""One name per concept in autoplan/: no Python name there spells a layout concept another way than
layout.VOCABULARY's short name (num_microbatches for microbatches, zero_stage for zero, ...), nor by its plan.json
name (those live in the codec's strings: layout.PLAN_CODEC).

Checked: the Python names (identifiers, attributes, keywords; not strings, comments or docstrings) of every file of
the package: the planning core, the runtime, codegen and the train.py template, verify.py, profile, capture,
calibrate, ... TORCH_NAMES are torch's own names a file must use as torch spells them, each with why."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

from autoplan.layout import VOCABULARY

PACKAGE = Path(__file__).resolve().parent.parent / "autoplan"

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


TORCH_NAMES = {
    "fsdp": "torch.distributed.fsdp, the module fully_shard and FSDPModule are imported from",
    "reshard_after_forward": "fully_shard's keyword (runtime/distributed/parallel.py passes Parallelism's reshard)",
    "n_microbatches": "the keyword of torch's pipeline schedule classes (PipelineScheduleSingle/Multi)",
    "num_microbatches": "the parameter of torch's PipelineStage._setup_backward_recv_info, which steps.py overrides",
}
"""Second spellings that are torch's own API -> why a file of autoplan/ names them so."""

TORCH_NAME_FILES = {
    "fsdp": {"calibrate/frameworks.py", "runtime/distributed/expert_parallel.py", "runtime/distributed/parallel.py",
             "runtime/distributed/split_backward.py", "runtime/distributed/steps.py"},
    "reshard_after_forward": {"runtime/distributed/parallel.py"},
    "n_microbatches": {"calibrate/frameworks.py", "runtime/distributed/steps.py"},
    "num_microbatches": {"runtime/distributed/steps.py"},
}
"""Where each of TORCH_NAMES may appear (anywhere else it is a second spelling of autoplan's own)."""


def _package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _second_spellings(path: Path, forbidden: dict[str, str]) -> list[str]:
    relative = path.relative_to(PACKAGE).as_posix()
    return [f"autoplan/{relative}:{line} {name} (use {forbidden[name]})" for name, line in _names(path.read_text())
            if name in forbidden and relative not in TORCH_NAME_FILES.get(name, ())]


def _names(source: str) -> list[tuple[str, int]]:
    """(Python name, line) of every name token of `source`."""
    return [(tok.string, tok.start[0]) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.NAME]


def test_the_package_spells_each_concept_one_way():
    forbidden = _forbidden()
    found = [entry for path in _package_files() for entry in _second_spellings(path, forbidden)]
    assert not found, "second spellings in autoplan/:\n" + "\n".join(found)


def test_torch_names_are_explained_and_still_used_where_listed():
    assert set(TORCH_NAMES) == set(TORCH_NAME_FILES) and set(TORCH_NAMES) <= set(_forbidden())
    stale = [f"{name} in {relative}" for name, files in TORCH_NAME_FILES.items() for relative in sorted(files)
             if name not in {n for n, _ in _names((PACKAGE / relative).read_text())}]
    assert not stale, f"TORCH_NAME_FILES lists files that no longer use the name: {stale}"


def test_the_table_holds_no_vocabulary_name_and_the_check_reads_names_only():
    short = {term.short for term in VOCABULARY}
    assert not short & set(_forbidden()), "a second spelling in the table is a vocabulary short name"
    assert {"pipeline_parallel_num_microbatches", "data_parallel_shard_degree"} <= set(_forbidden())
    source = ('"""num_microbatches in a docstring"""\nx = "zero_stage"  # sequence_parallel\n'
              'def f(num_ranks): return plan.fsdp\n')
    assert [name for name, _ in _names(source) if name in _forbidden()] == ["num_ranks", "fsdp"]
    files = {path.relative_to(PACKAGE).as_posix() for path in _package_files()}
    assert {"codegen/templates/train.py", "runtime/distributed/mesh.py", "verify.py", "layout.py"} <= files
