"""What this model cannot take whatever the layout, found before and beside the search: a pipeline without
torch.export's graph (stages are cut from it) or with one module, tensor, loss and sequence parallelism the
model's modules refuse. Each is one line naming the module and why; unsupported_ops.txt lists them and the
search never tries them."""

from __future__ import annotations

import logging
from dataclasses import replace

from autoplan.errors import UserError
from autoplan.profile_data import ModelProfile

log = logging.getLogger("autoplan")

NO_PIPELINE = "no pipeline parallelism (pp=1)"
"""How a line about a model that cannot be cut into pipeline stages starts."""


def export_failure(profile: ModelProfile) -> str | None:
    """Why torch.export could not capture the model (with the module and line where it failed, when
    known); None when it did. Pipeline stages are cut from its graph, so without it there is no pp > 1."""
    if profile.capture_method == "export":
        return None
    return next((f.removeprefix("export: ") for f in profile.capture_failures if f.startswith("export: ")),
                "torch.export was not tried")


def pipeline_refusal(profile: ModelProfile) -> str | None:
    """The line that says the model is planned without pipeline parallelism and why; None when it can be."""
    failure = export_failure(profile)
    if failure is None:
        return None
    return f"{NO_PIPELINE}: pipeline stages are cut from torch.export's graph, and torch.export failed: {failure}"


def not_planned(context) -> tuple[str, ...]:
    """A line for each dimension this model cannot take on this cluster whatever the layout (a pipeline
    without torch.export's graph or with one module; tensor parallelism at every degree a node allows),
    each naming the module and why. Written to unsupported_ops.txt; the search never tries these."""
    from autoplan.solve.layouts import divisors

    lines = []
    refusal = pipeline_refusal(context.profile)
    if refusal:
        lines.append(refusal)
    elif len(context.chain) == 1 and context.cluster.num_gpus > 1:
        lines.append(f"{NO_PIPELINE}: {context.chain.whole_reason or 'the model splits into one module'}")
    degrees = [t for t in divisors(context.cluster.gpus_per_node) if t > 1]
    if degrees and "tp" in context.features and all(context.facts.problems(t) for t in degrees):
        lines.append(f"no tensor parallelism (tp=1): {'; '.join(context.facts.problems(degrees[0]))}")
    elif degrees and "tp" in context.features and context.loss_parallel_problem:
        lines.append(f"no loss parallel (with tp > 1 the logits are gathered for the loss): "
                     f"{context.loss_parallel_problem}")
    if degrees and {"tp", "sp"} <= context.features and context.facts.plan and context.facts.sequence_parallel_problem:
        lines.append(f"no sequence parallelism (with tp > 1 the norms, residual adds and dropout between the split "
                     f"Linears keep whole-sequence activations on every tensor-parallel rank, tp times those of "
                     f"sp=on): {context.facts.sequence_parallel_problem}")
    return tuple(lines)


def pins_for_capture(pins, profile: ModelProfile, warn: bool = True):
    """Pipeline stages are cut from the exported graph: without one (export failed and capture fell
    back), only layouts that keep the model whole can be generated."""
    failure = export_failure(profile)
    if failure is None:
        return pins
    if pins.pp not in (None, 1):
        raise UserError(f"pp={pins.pp} needs the model's graph from torch.export (pipeline stages are cut from it), "
                        f"but torch.export failed: {failure}; pin pp=1 or make the forward exportable")
    if warn:
        log.warning("planning with %s", pipeline_refusal(profile))
    return replace(pins, pp=1)
