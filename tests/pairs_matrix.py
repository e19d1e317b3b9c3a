"""The parity matrix of the plan vocabulary: factors whose values are the vocabulary's (autoplan/layout.py,
plan.OPTIMIZER_IMPLEMENTATIONS) and the kinds of model, the layout rules deciding which values can be emitted
together, and the all-pairs cases (tests/helpers/all_pairs.py) that tests/test_pairs_matrix.py trains under
verify's parity check. Each model's facts (what the layout rules read from a captured model: its modules, experts,
BatchNorm modules, what tensor, sequence and context parallelism find) are stated here; the slow test checks them
against the capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from autoplan.chain.attention import NO_SDPA_PROBLEM
from autoplan.codegen import write_program
from autoplan.layout import (COMPILE, OFFLOAD, RECOMPUTE, RESHARD, SCHEDULE_BY_NAME, SCHEDULES, SEQUENCE_PARALLEL, SUPPORTED,
                             Layout, Scope, problems)
from autoplan.plan import OPTIMIZER_IMPLEMENTATIONS, Compile, Plan
from helpers.all_pairs import Case, Covering, Factor, covering_array
from test_expert_parallel_program import ATTENTION_TP_PLAN, CHAIN as MIXTRAL_CHAIN, SOURCES as MOE_SOURCES
from test_layouts import MODELS as LAYOUT_MODELS, make_plan

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
GLOBAL_BATCH = 8
MAX_RANKS = 8
"""Ranks a case may use (one launch of 8 processes); every pair fits in fewer (the fast test checks it)."""
STEPS = 2


@dataclass(frozen=True)
class MatrixModel:
    kind: str
    """What kind of model it stands for (what its parity exercises)."""
    source: str
    chain: tuple[str, ...]
    four_stages: tuple[tuple[str, ...], ...]
    tensor_parallel_plan: dict[str, str]
    facts: dict[str, Any] = field(default_factory=dict)
    """Scope fields the layout rules read from the captured model (besides its module count)."""


def _dropout_gpt() -> MatrixModel:
    chain = ("wte", "wpe", "drop", "blocks.0", "blocks.1", "ln_f", "lm_head")
    plan = {"wte": "rowwise", "lm_head": "colwise"}
    for i in range(2):
        plan.update({f"blocks.{i}.qkv": "colwise", f"blocks.{i}.proj": "rowwise", f"blocks.{i}.mlp.0": "colwise",
                     f"blocks.{i}.mlp.2": "rowwise"})
    return MatrixModel("dropout and a tied head (a GPT written from scratch)",
                       (TESTS / "models" / "dropout_gpt.py").read_text(), chain,
                       (chain[:3], chain[3:4], chain[4:5], chain[5:]), plan,
                       dict(sequence_length=16, sequence_parallel_problem="aten.scaled_dot_product_attention.default in "
                            "blocks.0 would read a sequence shard, and it does not compute token by token: it cuts, "
                            "merges or reduces the sequence dimension of a DTensor shard",
                            context_parallel_problem="its attention in 'blocks.0' applies dropout to the attention "
                            "weights (dropout_p 0.1), which context parallelism's ring attention does not run"))


def _llama() -> MatrixModel:
    case = LAYOUT_MODELS["llama"]
    return MatrixModel("a Hugging Face model (Llama, grouped-query attention)", case.source, case.chain_modules,
                       case.four_stages, case.tensor_parallel_plan, dict(sequence_length=8))


def _mixtral() -> MatrixModel:
    chain = MIXTRAL_CHAIN
    local = tuple(f"model.layers.{i}.mlp" for i in range(2))  # routed on each tp rank's sequence shard (sp=on)
    return MatrixModel("mixture of experts (examples/mixtral.py)", MOE_SOURCES["mixtral"], chain,
                       (chain[:1], chain[1:2], chain[2:3], chain[3:]),
                       ATTENTION_TP_PLAN | dict.fromkeys(local, "sequence_local"),
                       dict(sequence_length=8, num_experts=(4, 4), sequence_local_modules=local))


RESNET = f'''
"""examples/resnet.py at tiny sizes: BatchNorm after every convolution."""
import importlib.util

_spec = importlib.util.spec_from_file_location("autoplan_matrix_resnet", {str(ROOT / "examples" / "resnet.py")!r})
resnet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resnet)
resnet.WIDTHS, resnet.BLOCKS_PER_STAGE, resnet.IMAGE_SIZE = (4, 8), 1, 8
build_model, example_batch = resnet.build_model, resnet.example_batch
'''
BATCH_NORM_MODULES = ("stem.1", "blocks.0.bn1", "blocks.0.bn2", "blocks.1.bn1", "blocks.1.bn2", "blocks.1.shortcut.1")


def _resnet() -> MatrixModel:
    chain = ("stem", "blocks.0", "blocks.1", "head")
    return MatrixModel("BatchNorm (examples/resnet.py)", RESNET, chain, tuple((m,) for m in chain), {},
                       dict(batch_norm_modules=BATCH_NORM_MODULES, context_parallel_problem=NO_SDPA_PROBLEM,
                            tensor_parallel_problems=lambda tp: [f"tp={tp}: no Megatron-style Linear pairs were "
                                                                 f"found in the graph"]))


@lru_cache(maxsize=1)
def models() -> dict[str, MatrixModel]:
    return {"dropout_gpt": _dropout_gpt(), "llama": _llama(), "mixtral": _mixtral(), "resnet": _resnet()}


DATA = {"dp=1": (1, 1), "ddp": (2, 1), "fsdp": (1, 2), "hsdp": (2, 2)}
"""data: (dp_replicate, dp_shard) of each data-parallel shape: none, DDP, FSDP2, HSDP."""
ZERO = {0: ("ddp", None), 1: ("fsdp", "never"), 2: ("fsdp", "never"), 3: ("fsdp", "always")}
"""Each zero stage (the pin shorthand) as the matrix's data and reshard values."""
PIPELINES = {"pp=1": (1, None, 1), **{s: (2, s, 2 if s == "interleaved" else SCHEDULE_BY_NAME[s].virtual_stages[0])
                                      for s in SCHEDULES}}
"""pipeline: (pp, schedule, virtual_stages): no pipeline, or 2 ranks with each schedule (interleaved on 2 stages per
rank, the others on the fewest they run)."""
DEGREES = (1, 2)
"""tp, cp and ep: off or 2 ranks."""
LOSS_PARALLEL = ("on", "off")
FEATURE_VALUES = {
    "tp": ("tp", 2), "sp": ("sp", "on"), "tp_vocab_parallel": ("loss_parallel", "on"), "zero2": ("reshard", "never"),
    "zero3": ("reshard", "always"), "hsdp": ("data", "hsdp"), "gpipe": ("pipeline", "gpipe"),
    "1f1b": ("pipeline", "1f1b"), "interleaved": ("pipeline", "interleaved"), "zb-interleaved": ("pipeline",
    "zb-interleaved"), "zbv": ("pipeline", "zbv"), "dualpipev": ("pipeline", "dualpipev"),
    "selective": ("recompute", "selective"),
    "full": ("recompute", "full"), "offload": ("offload", "cpu"), "compile": ("compile", "on"), "cp": ("cp", 2),
    "ep": ("ep", 2), "cp_pp": None, "cp_tp": None, "ep_tp": None, "ep_pp": None, "ep_cp": None,
}
"""The matrix value that runs each SUPPORTED feature; None for a feature that is a pair of two of them (cp_pp is
(cp=2, a pipeline), covered as that pair)."""


def _sharded(case: Case) -> bool:
    return DATA[case["data"]][1] * case["cp"] > 1


def factors() -> tuple[Factor, ...]:
    """The matrix's factors, their values the vocabulary's."""
    return (
        Factor("model", tuple(models())),
        Factor("data", tuple(DATA)),
        Factor("reshard", RESHARD, _sharded),
        Factor("tp", DEGREES),
        Factor("sp", SEQUENCE_PARALLEL, lambda c: c["tp"] > 1),
        Factor("loss_parallel", LOSS_PARALLEL, lambda c: c["tp"] > 1 and "lm_head" in
               models()[c["model"]].tensor_parallel_plan),
        Factor("cp", DEGREES),
        Factor("ep", DEGREES),
        Factor("pipeline", tuple(PIPELINES)),
        Factor("recompute", RECOMPUTE),
        Factor("compile", COMPILE),
        Factor("offload", OFFLOAD),
        Factor("optimizer", OPTIMIZER_IMPLEMENTATIONS),
    )


def microbatches(case: Case) -> int:
    """Micro-batches per data-parallel rank: 2 with a pipeline (1F1B and interleaved need pp of them; DualPipeV pp x
    its 2 stages per rank, 4), else 1; 1 for a model with BatchNorm (the rules refuse to split its batch: a GPipe
    pipeline of one micro-batch)."""
    if models()[case["model"]].facts.get("batch_norm_modules"):
        return 1
    pp, schedule, virtual = PIPELINES[case["pipeline"]]
    if pp == 1:
        return 1
    return pp * virtual if SCHEDULE_BY_NAME[schedule].min_microbatches == "stages" else 2


def layout(case: Case) -> Layout:
    replicate, shard = DATA[case["data"]]
    pp, schedule, virtual = PIPELINES[case["pipeline"]]
    m = microbatches(case)
    return Layout(dp=replicate * shard, dp_replicate=replicate, dp_shard=shard, reshard=case["reshard"] or "never",
                  tp=case["tp"], sp=case["sp"] or "off", cp=case["cp"], ep=case["ep"], pp=pp,
                  schedule=schedule or "1f1b", virtual_stages=virtual,
                  microbatch=GLOBAL_BATCH // (replicate * shard) // m, microbatches=m, recompute=case["recompute"],
                  offload=case["offload"], compile=case["compile"])


def ranks(case: Case) -> int:
    lay = layout(case)
    return lay.dp * lay.tp * lay.cp * lay.pp


def scope(model_name: str, gpus: int, facts: dict[str, Any] | None = None) -> Scope:
    """What the rules check a case against: its model's facts (`facts`, else the stated ones), a GPU cluster of the
    case's ranks (offload is emitted for GPUs; the program's CPU path runs it here, as
    tests/test_compile_offload.py does)."""
    model = models()[model_name]
    return Scope(**{"num_gpus": gpus, "gpus_per_node": MAX_RANKS, "global_batch": GLOBAL_BATCH,
                    "features": SUPPORTED, "num_modules": len(model.chain), "host_link": True, "num_experts": (),
                    "tensor_parallel_modules": sum(style in ("colwise", "rowwise")
                                                   for style in model.tensor_parallel_plan.values()),
                    **(model.facts if facts is None else facts)})


def reasons(case: Case, facts_of: Callable[[str], dict[str, Any]] | None = None) -> list[str]:
    """The layout rules the case breaks (layout.problems) with its model's stated facts, or `facts_of` its model."""
    if facts_of is None:
        return _stated(layout(case), case["model"])
    return problems(layout(case), scope(case["model"], ranks(case), facts_of(case["model"])))


@lru_cache(maxsize=None)
def _stated(lay: Layout, model: str) -> list[str]:
    """problems() with the model's stated facts; many cases share a layout (they differ in the optimizer, say)."""
    return problems(lay, scope(model, lay.dp * lay.tp * lay.cp * lay.pp))


def cost(case: Case) -> float:
    """Relative cost of a case: inductor's C++ build dwarfs the rest on CPUs, then ranks."""
    return 4.0 * (case["compile"] == "on") + ranks(case) / MAX_RANKS


PARALLELISMS = {
    "dp": lambda case: case["data"] != "dp=1" and case["reshard"] is None,
    "fsdp": lambda case: DATA[case["data"]][1] > 1,
    "pp": lambda case: case["pipeline"] != "pp=1",
    "tp+sp": lambda case: case["sp"] == "on",
}
"""The kinds of parallelism compile x recompute must run beside (REQUIRED)."""


def _compiled_recompute(recompute: str, kind: str) -> Callable[[Case], bool]:
    return lambda case: case["compile"] == "on" and case["recompute"] == recompute and PARALLELISMS[kind](case)


REQUIRED = {(recompute, kind): _compiled_recompute(recompute, kind) for recompute in RECOMPUTE if recompute != "none"
            for kind in PARALLELISMS}
"""Triples the matrix holds besides its pairs: compile=on x each recompute x each kind of parallelism."""


@lru_cache(maxsize=1)
def matrix() -> Covering:
    return covering_array(factors(), reasons, cost, lambda case: ranks(case) <= MAX_RANKS, list(REQUIRED.values()),
                          costly=lambda case: case["compile"] == "on")


def name(case: Case) -> str:
    """The case's values that apply, "model=llama,data=fsdp,...", in the factors' order."""
    return ",".join(f"{k}={v}" for k, v in case.items() if v is not None)


def plan_of(case: Case, model_file: Path) -> Plan:
    """The case's plan.json (a pinned plan, as tests/test_layouts.py writes them) for the model in `model_file`."""
    model = models()[case["model"]]
    lay = layout(case)
    stages = {1: [model.chain], 2: [model.chain[:len(model.chain) // 2], model.chain[len(model.chain) // 2:]],
              4: model.four_stages}[lay.pp * lay.virtual_stages]
    plan = make_plan(model_file, stages, model.tensor_parallel_plan,
                     dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard,
                     reshard=lay.reshard == "always", tp=lay.tp,
                     sp=lay.sp == "on", loss_parallel=case["loss_parallel"] != "off",
                     cp=lay.cp, ep=lay.ep, pp=lay.pp,
                     schedule=lay.schedule, virtual_stages=lay.virtual_stages,
                     microbatch=lay.microbatch, microbatches=lay.microbatches,
                     recompute=lay.recompute, offload=lay.offload == "cpu")
    return replace(plan, compile=Compile(case["compile"] == "on"),
                   training=replace(plan.training, optimizer_implementation=case["optimizer"]),
                   batch_norm_modules=tuple(model.facts.get("batch_norm_modules", ())))


def runs_as(plan: Plan) -> dict[str, Any]:
    """What the program runs of a plan, in the matrix's factors (to check that a case's plan is the case)."""
    par = plan.parallelism
    data = {shape: name for name, shape in DATA.items()}[par.dp_replicate,
                                                           par.dp_shard]
    tp = par.tp
    pipeline = "pp=1" if par.pp == 1 else par.schedule
    return {"data": data, "reshard": par.layout().reshard if par.fsdp_enabled else None, "tp": tp,
            "sp": ("on" if par.sp else "off") if tp > 1 else None,
            "loss_parallel": par.layout().loss_parallel if tp > 1 and "lm_head" in
            plan.tensor_parallel_plan else None, "cp": par.cp, "ep": par.ep,
            "pipeline": pipeline, "recompute": par.recompute, "compile": "on" if plan.compile.enable else "off",
            "offload": "cpu" if par.offload else "none", "optimizer": plan.training.optimizer_implementation}


def write_case(root: Path, index: int, case: Case) -> Path:
    """The case's generated program (plan.json and train.py, as `autoplan` writes them) under root/<index>."""
    folder = root / f"case{index:02d}"
    folder.mkdir(parents=True)
    model_file = folder / "user_model.py"
    model_file.write_text(models()[case["model"]].source)
    plan = plan_of(case, model_file)
    write_program(plan, folder / "out", model_file)
    (folder / "out" / "plan.json").write_text(plan.to_json())
    return folder / "out"


def captured_facts(folder: Path, model_name: str) -> dict[str, Any]:
    """The Scope fields the rules read, from autoplan's capture of the model (no measurement)."""
    from autoplan.api import ProfileOptions, load_cluster, profile_only
    from autoplan.cost.context import Context
    from autoplan.plan import Training
    from autoplan.solve.layouts import scope_of

    model_file = folder / f"{model_name}.py"
    model_file.write_text(models()[model_name].source)
    profile = profile_only(str(model_file), "h100-sxm5-80gb", ProfileOptions(measure=False))
    cluster = load_cluster(MAX_RANKS, "h100-sxm5-80gb", MAX_RANKS, None, None)
    found = scope_of(Context(profile, cluster, Training(global_batch_size=GLOBAL_BATCH), SUPPORTED))
    return {f: getattr(found, f) for f in ("sequence_parallel_problem", "loss_parallel_problem", "batch_norm_modules",
                                            "sequence_length", "context_parallel_problem", "num_experts",
                                            "tensor_parallel_problems", "sequence_local_modules")}
