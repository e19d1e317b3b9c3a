"""A plan as data: frozen dataclasses and a versioned JSON schema (plan.json).

Field names follow torchtitan's parallelism config so a plan carries over (autoplan/layout.py lists
each field's short name). Loading validates the schema version, every field and the layout's rules
(layout.problems); nothing in an output folder is ever unpickled or executed.

Schema versions: 1 had parallelism.zero_stage, an empty activation_checkpoint_modules meaning "every
module", and alternatives[].why_not. 2 says what runs instead: data_parallel_shard_degree with
fsdp_reshard_after_forward ("always" | "never"), activation_checkpoint_modules listed in full, and
alternatives[].reason.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from autoplan.layout import (RECOMPUTE, SCHEDULES, SUPPORTED, TENSOR_PARALLEL_STYLES, Parallelism, Scope,
                             from_plan_fields, to_plan_fields)

SCHEMA_VERSION = 2
SCHEMA_CHANGES = {1: "version 2 replaced parallelism.zero_stage with data_parallel_shard_degree and "
                     "fsdp_reshard_after_forward, and lists activation_checkpoint_modules in full"}
"""Per older schema version, what changed since (for the message that refuses it)."""


OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
"""torch.optim.AdamW's implementations (torchtitan's optimizer.implementation): one fused kernel per parameter
group, per-op kernels batched over tensors, or the single-tensor loop."""


class PlanError(ValueError):
    """plan.json is not a valid plan of this schema version."""


@dataclass(frozen=True)
class Compile:
    """torchtitan's compile section: torch.compile per chain module (runtime/distributed/compile.py)."""

    enable: bool = False
    """Compile each chain module (transformer block) with torch.compile (inductor); priced per op class
    (cost/calibration.py COMPILE_TIME_FACTOR). Plan.json's compile section is optional in schema 2 (absent: off)."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous run of the modules of the model's chain."""

    index: int
    modules: tuple[str, ...]
    """FQNs of the modules of the chain that run on this stage, in order."""
    predicted_time_s: float
    """Forward+backward time of one micro-batch on this stage's rank (compute, recompute, collectives and
    host time; not the transfers to neighbouring stages), seconds."""
    predicted_memory_bytes: float
    """Peak memory of a rank of this stage, bytes."""
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    """parameters, gradients, optimizer, activations, buffers, ... in bytes."""
    predicted_forward_s: float = 0.0
    """The forward's share of predicted_time_s, seconds (0 when not recorded)."""
    predicted_send_s: float = 0.0
    """One point-to-point transfer of this stage's output activation to the next stage (and of its
    gradient back), seconds; 0 for the last stage."""
    predicted_weight_s: float = 0.0
    """Of the backward, the weight gradients' pass (W, which a zero-bubble schedule runs apart from the
    input-gradient pass), seconds (0 when not recorded)."""


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float | None
    model_flops_per_step: float
    """Forward+backward FLOPs of one optimizer step at the global batch, without recomputation."""
    mfu: float
    """model_flops_per_step / (step_time_s * num_gpus * peak FLOP/s)."""
    peak_memory_bytes: float
    """Peak memory of the most loaded rank, bytes."""
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    """Breakdown of the most loaded rank's memory, bytes."""
    time_breakdown: dict[str, float] = field(default_factory=dict)
    """compute, bubble, data_parallel_comm, pipeline_comm, ... seconds per step."""
    activations_without_sequence_parallel_bytes: float | None = None
    """With sequence parallelism on: memory_breakdown's "activations" of the same rank in the same layout
    without it (sp=off), bytes, so the saving shows; None otherwise."""
    peak_memory_without_context_parallel_bytes: float | None = None
    """With cp > 1: peak_memory_bytes's rank in the same layout at cp = 1 (its sequence whole, the model states
    sharded over dp_shard only), bytes, so the saving shows; None otherwise. Optional in schema 2."""
    peak_memory_without_expert_parallel_bytes: float | None = None
    """With ep > 1: peak_memory_bytes's rank in the same layout at ep = 1 (every expert on every rank), bytes;
    None otherwise. Optional in schema 2."""
    host_memory_per_node_bytes: float = 0.0
    """Host memory per node that CPU offload fills (every rank's shard of the model states), bytes; 0
    without offload."""


@dataclass(frozen=True)
class SolverInfo:
    name: str
    """"highs" or "cbc" (the MILP solver), or "pinned" when every degree was fixed."""
    status: str
    """What the MILP on the chosen layout's stage split reported (solve/search.py refine_with_ilp): "optimal",
    "time_limit" (the best split found, see gap), or "infeasible" / "failed" (a solver failure: the fast packing's
    split, which fits, is kept; gap to the step-time lower bound)."""
    time_s: float
    candidates_evaluated: int
    gap: float = 0.0
    """Relative gap of the chosen stage split to the optimum (a bound on it) when the MILP did not prove it optimal."""


@dataclass(frozen=True)
class Training:
    global_batch_size: int
    """Samples per optimizer step across all data-parallel ranks."""
    dtype: str = "fp32"
    """"fp32" or "bf16" (mixed precision)."""
    optimizer: str = "adamw"
    optimizer_implementation: str = "fused"
    """How train.py runs AdamW, one of OPTIMIZER_IMPLEMENTATIONS (priced as it runs: cost/compute.py).
    Optional in schema 2 (absent: fused)."""
    learning_rate: float = 1e-3
    seed: int = 0
    tokens_per_sample: int | None = None


@dataclass(frozen=True)
class Alternative:
    """A layout that lost to the plan's, and why."""

    parallelism: Parallelism
    step_time_s: float | None
    """None when pruned by a bound before it was priced."""
    peak_memory_bytes: float | None
    fits: bool
    reason: str
    """Why it lost ("8% slower than the best", "OOM by 12.4 GiB on stage 0")."""
    compile: Compile = field(default_factory=Compile)
    """Whether it was priced compiled (optional in schema 2: absent, off)."""

    @staticmethod
    def of(candidate: Any) -> "Alternative":
        """From a priced layout (cost.evaluate.Candidate: parallelism, predicted, fits, reason, compile)."""
        predicted = candidate.predicted
        return Alternative(parallelism=candidate.parallelism,
                           step_time_s=predicted.step_time_s if predicted else None,
                           peak_memory_bytes=predicted.peak_memory_bytes if predicted else None,
                           fits=candidate.fits, reason=candidate.reason,
                           compile=Compile(enable=getattr(candidate, "compile", False)))


@dataclass(frozen=True)
class ModelRef:
    path: str
    """Path of the model file the plan was made for (train.py loads its copy in model_code/; --model-file planned
    this file)."""
    factory: str = "build_model"
    param_count: int = 0


@dataclass(frozen=True)
class ClusterRef:
    gpu: str
    num_gpus: int
    gpus_per_node: int
    memory_per_gpu_bytes: float


@dataclass(frozen=True)
class LeftWhole:
    """Linears that tensor parallelism leaves whole (replicated on every tensor-parallel rank), and why."""

    modules: tuple[str, ...]
    """The Linears' module FQNs (a block: the ones one split would have had to shard together)."""
    op: str
    """The op that would have needed every rank's features, e.g. "aten.mean.dim"."""
    op_module: str
    """The module that runs it ("" for the root)."""
    reason: str

    def line(self) -> str:
        where = self.op_module or "the model"
        return f"{', '.join(self.modules)} left whole: {self.op} in {where}: {self.reason}"


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    cluster: ClusterRef
    training: Training
    parallelism: Parallelism
    stages: tuple[Stage, ...]
    predicted: Prediction
    solver: SolverInfo
    alternatives: tuple[Alternative, ...] = ()
    """The next best layouts: parallelism, predicted step time and memory, why each lost."""
    tensor_parallel_plan: dict[str, str] = field(default_factory=dict)
    """Module FQN -> "colwise" | "rowwise" (Megatron pairs found in the graph) when tp > 1, else empty."""
    activation_checkpoint_modules: tuple[str, ...] = ()
    """The modules recomputed in backward with the parallelism.activation_checkpoint mode, every one
    listed (empty when the mode is "none")."""
    batch_norm_modules: tuple[str, ...] = ()
    """Modules that normalize over the batch (BatchNorm): train.py synchronizes their statistics over the
    data-parallel ranks (SyncBatchNorm) and the layout never splits a rank's batch into micro-batches.
    Optional in schema 2 (absent: none)."""
    compile: Compile = field(default_factory=Compile)
    """torch.compile per chain module (plan.json compile.enable)."""
    tensor_parallel_left_whole: tuple[LeftWhole, ...] = ()
    """When tp > 1, the Linears the tensor-parallel plan leaves whole (replicated on every tensor-parallel rank), in
    blocks: {modules, op, op_module, reason}, the op that would have needed every rank's features and why.
    Optional in schema 2 (absent: none listed)."""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """plan.json's content: the parallelism sections in plan.json's names (layout.to_plan_fields)."""
        raw = asdict(self)
        raw["parallelism"] = to_plan_fields(self.parallelism)
        for alternative, kept in zip(raw["alternatives"], self.alternatives):
            alternative["parallelism"] = to_plan_fields(kept.parallelism)
        return raw

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def problems(self, features: frozenset[str] | None = SUPPORTED) -> list[str]:
        """Every layout rule this plan breaks (layout.problems), with `features` what may be used."""
        scope = Scope(num_gpus=self.cluster.num_gpus, gpus_per_node=self.cluster.gpus_per_node,
                      global_batch=self.training.global_batch_size, features=features,
                      stage_modules=tuple(s.modules for s in self.stages),
                      tensor_parallel_modules=len(self.tensor_parallel_plan),
                      sequence_local_modules=tuple(m for m, style in self.tensor_parallel_plan.items()
                                                   if style == "sequence_local"),
                      batch_norm_modules=self.batch_norm_modules)
        found = self.parallelism.problems(scope, compile=self.compile.enable)
        recomputed = set(self.activation_checkpoint_modules)
        if (self.parallelism.recompute == "none") != (not recomputed):
            found.append(f"recompute={self.parallelism.recompute}, but recompute_modules lists "
                         f"{len(recomputed)} modules")
        unknown = recomputed - {m for s in self.stages for m in s.modules}
        if unknown:
            found.append(f"recompute_modules names {len(unknown)} module(s) no stage runs "
                         f"(e.g. {sorted(unknown)[0]!r})")
        return found

    def fingerprint(self) -> str:
        """The hash of what decides what the generated train.py trains (PROGRAM_KEYS: the model file and factory,
        training, parallelism, the stages' modules, the tensor-parallel plan, the recomputed and BatchNorm modules,
        compile), 16 hex digits of SHA-256 over their canonical JSON. train.py carries it (PLAN_FINGERPRINT) and
        refuses to run beside a plan.json whose fingerprint differs (runtime/startup.py); `autoplan verify`
        compares the two too. Predictions, the solver's record, the alternatives and the cluster are left out: they
        change what the program reports and how it is launched, never what it trains."""
        raw = self.to_dict()
        kept = {key: raw[key] for key in PROGRAM_KEYS}
        kept["model"] = {key: raw["model"][key] for key in ("path", "factory")}
        kept["stages"] = [{"index": s["index"], "modules": s["modules"]} for s in raw["stages"]]
        text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_DIGITS]

    @staticmethod
    def from_dict(raw: Any) -> "Plan":
        if not isinstance(raw, dict):
            raise PlanError("plan.json: top level must be an object")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            change = SCHEMA_CHANGES.get(version) if isinstance(version, int) else None
            raise PlanError(f"plan.json: schema_version {version!r}, but this autoplan reads version "
                            f"{SCHEMA_VERSION}" + (f" ({change})" if change else "") +
                            ": re-run autoplan on the model to write a new plan")
        unknown = sorted(set(raw) - {f.name for f in fields(Plan)})
        if unknown:  # a misspelt section would otherwise be dropped without a word and its defaults used
            raise PlanError(f"plan.json: unknown top-level key(s): {', '.join(map(repr, unknown))} (schema version "
                            f"{SCHEMA_VERSION} has {', '.join(f.name for f in fields(Plan))})")
        parallelism = _parallelism(raw)
        if parallelism.schedule not in SCHEDULES:
            raise PlanError(f"plan.json: parallelism.pipeline_parallel_schedule must be one of {SCHEDULES}")
        if parallelism.recompute not in RECOMPUTE:
            raise PlanError(f"plan.json: parallelism.activation_checkpoint must be one of {RECOMPUTE}")
        training = _build(Training, raw, "training")
        if training.optimizer_implementation not in OPTIMIZER_IMPLEMENTATIONS:
            raise PlanError(f"plan.json: training.optimizer_implementation must be one of {OPTIMIZER_IMPLEMENTATIONS}")
        stages_raw = raw.get("stages")
        if not isinstance(stages_raw, list):
            raise PlanError("plan.json: stages must be a list")
        stages = tuple(
            _build(Stage, {"stage": {**s, "modules": tuple(s.get("modules", ()))}}, "stage")
            if isinstance(s, dict) else _fail("plan.json: each stage must be an object")
            for s in stages_raw
        )
        alternatives_raw = raw.get("alternatives", [])
        if not isinstance(alternatives_raw, list) or not all(isinstance(a, dict) for a in alternatives_raw):
            raise PlanError("plan.json: alternatives must be a list of objects")
        alternatives = tuple(
            _build(Alternative, {"alternative": {**a, "parallelism": _parallelism(a),
                                                 **_compile_section(a)}}, "alternative") for a in alternatives_raw)
        tp_plan = raw.get("tensor_parallel_plan", {})
        if not isinstance(tp_plan, dict) or any(
                not isinstance(k, str) or v not in TENSOR_PARALLEL_STYLES for k, v in tp_plan.items()):
            raise PlanError(f"plan.json: tensor_parallel_plan must map module names to one of {TENSOR_PARALLEL_STYLES}")
        recomputed = raw.get("activation_checkpoint_modules", [])
        if not isinstance(recomputed, list) or not all(isinstance(m, str) for m in recomputed):
            raise PlanError("plan.json: activation_checkpoint_modules must be a list of module names")
        whole_raw = raw.get("tensor_parallel_left_whole", [])
        if not isinstance(whole_raw, list) or not all(
                isinstance(b, dict) and isinstance(b.get("modules"), list) and set(b) == {f.name for f in fields(LeftWhole)}
                and all(isinstance(b.get(k), str) for k in ("op", "op_module", "reason")) for b in whole_raw):
            raise PlanError("plan.json: tensor_parallel_left_whole must be a list of {modules, op, op_module, reason}")
        left_whole = tuple(LeftWhole(tuple(b["modules"]), b["op"], b["op_module"], b["reason"]) for b in whole_raw)
        batch_norm = raw.get("batch_norm_modules", [])
        if not isinstance(batch_norm, list) or not all(isinstance(m, str) for m in batch_norm):
            raise PlanError("plan.json: batch_norm_modules must be a list of module names")
        plan = Plan(
            model=_build(ModelRef, raw, "model"),
            cluster=_build(ClusterRef, raw, "cluster"),
            training=training,
            parallelism=parallelism,
            stages=stages,
            predicted=_build(Prediction, raw, "predicted"),
            solver=_build(SolverInfo, raw, "solver"),
            alternatives=alternatives,
            tensor_parallel_plan=dict(tp_plan),
            activation_checkpoint_modules=tuple(recomputed),
            batch_norm_modules=tuple(batch_norm),
            tensor_parallel_left_whole=left_whole,
            **_compile_section(raw),
        )
        broken = plan.problems(features=None)
        if broken:
            raise PlanError("plan.json: the layout breaks its rules: " + "; ".join(broken))
        return plan

    @staticmethod
    def from_json(text: str) -> "Plan":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan.json is not valid JSON: {e}") from None
        return Plan.from_dict(raw)


PROGRAM_KEYS = ("model", "training", "parallelism", "stages", "tensor_parallel_plan", "activation_checkpoint_modules",
                "batch_norm_modules", "compile")
"""The plan.json sections Plan.fingerprint hashes (of model only path and factory, of stages only index and
modules): what train.py's program is made of."""
FINGERPRINT_DIGITS = 16
"""Hex digits of a plan's fingerprint: 64 bits, no collision among the plans one user makes."""


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
"""Field annotation (before " |") -> the JSON types it accepts; other annotations are not checked."""


def _compile_section(raw: dict) -> dict:
    """{"compile": Compile} from raw's optional compile section, else {} (the default: off)."""
    return {"compile": _build(Compile, raw, "compile")} if "compile" in raw else {}


def _parallelism(raw: dict) -> Parallelism:
    """The Parallelism of raw's parallelism section, through the one codec (layout.from_plan_fields)."""
    section = raw.get("parallelism")
    if not isinstance(section, dict):
        raise PlanError("plan.json: 'parallelism' must be an object")
    try:
        return from_plan_fields(section)
    except ValueError as e:
        raise PlanError(f"plan.json: {e}") from None


def _fail(message: str):
    raise PlanError(message)


def _build(cls, raw: dict, key: str):
    """Build dataclass `cls` from raw[key], checking required fields and simple types."""
    section = raw.get(key)
    if not isinstance(section, dict):
        raise PlanError(f"plan.json: '{key}' must be an object")
    kwargs = {}
    for f in fields(cls):
        if f.name not in section:
            if f.default is MISSING and f.default_factory is MISSING:
                raise PlanError(f"plan.json: {key}.{f.name} is missing")
            continue
        value = section[f.name]
        expected = _TYPES.get(str(f.type).split(" |")[0])
        if expected and value is not None and (not isinstance(value, expected) or isinstance(value, bool) and bool not in expected):
            raise PlanError(f"plan.json: {key}.{f.name} must be {f.type}, got {value!r}")
        kwargs[f.name] = value
    unknown = set(section) - {f.name for f in fields(cls)}
    if unknown:
        raise PlanError(f"plan.json: unknown field(s) in '{key}': {', '.join(sorted(unknown))}")
    return cls(**kwargs)


def load_plan(path: Any) -> Plan:
    """The plan in `path`: a plan.json, or an autoplan output folder holding one. Any problem (no such file,
    not JSON, another schema version, a field of the wrong type, a layout that breaks its rules) is one
    UserError line."""
    from pathlib import Path

    from autoplan.errors import UserError

    path = Path(path)
    if path.is_dir():
        if not (path / "plan.json").is_file():
            raise UserError(f"{path} has no plan.json: is it an autoplan output folder?")
        path = path / "plan.json"
    elif not path.is_file():
        raise UserError(f"{path}: no such plan.json (give the file or the autoplan output folder that holds it)")
    try:
        return Plan.from_json(path.read_text())
    except PlanError as e:
        raise UserError(f"{e} (in {path})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
