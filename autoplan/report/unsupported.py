"""unsupported_ops.txt: what autoplan could not capture or profile exactly, for a human to read.

Written next to ops.csv. Nothing in it is fatal: a model that runs eagerly is always profiled; this file
says where the numbers are weaker (a fallback capture, ops counted as 0 FLOPs, times estimated).
No torch here.
"""

from __future__ import annotations

from collections import Counter

from autoplan.profile_data import ModelProfile
from autoplan.solve.refusals import pipeline_refusal

FILE_NAME = "unsupported_ops.txt"

_METHODS = {
    "export": "torch.export",
    "symbolic_trace": "symbolic tracing (make_fx) of the forward flattened to tensors",
    "dispatch": "recording the ops of an eager forward under a dispatch mode",
}


def unsupported_ops_text(profile: ModelProfile, not_planned: tuple[str, ...] | None = None) -> str:
    """The contents of unsupported_ops.txt for `profile` (a header line even when all went well), with
    `not_planned`, a line per dimension the model cannot take (autoplan.solve.refusals.not_planned; by default
    the pipeline's refusal when torch.export failed)."""
    counts = Counter(op.op for op in profile.ops)
    lines = [f"# {profile.model}: captured by {_METHODS.get(profile.capture_method, profile.capture_method)}, "
             f"{len(profile.ops)} ops", _times(profile)]
    if not_planned is None:
        not_planned = tuple(filter(None, [pipeline_refusal(profile)]))
    if not_planned:
        lines += ["", "## dimensions not planned", *not_planned]
    if profile.capture_failures:
        lines += ["", "## capture methods that failed first"]
        lines += profile.capture_failures
    if profile.unsupported_ops:
        lines += ["", "## ops with no FLOP formula (counted as 0 FLOPs; their time comes from bytes moved or a "
                      "measurement)"]
        lines += [f"{op} ({counts[op]} ops)" for op in profile.unsupported_ops]
    if profile.op_failures:
        lines += ["", "## ops profiled in part"]
        lines += profile.op_failures
    if not (not_planned or profile.capture_failures or profile.unsupported_ops or profile.op_failures):
        lines += ["", "nothing unsupported: every op has a FLOP formula and was replayed and timed or estimated"]
    return "\n".join(lines) + "\n"


def _times(profile: ModelProfile) -> str:
    """Where the op times come from: measured here, or estimated (an approximation, named as such)."""
    sources = Counter(op.source for op in profile.ops)
    measured, estimated = sources.get("measured", 0), sources.get("estimated", 0)
    if not estimated:
        return f"op times: measured on this machine ({profile.device}), {measured} ops"
    how = (f"estimated for {profile.device} by a roofline (the slower of FLOPs at its peak rate and bytes at its "
           f"memory bandwidth, times the profile's efficiencies, plus a launch cost)")
    if not measured:
        return f"op times: {how}, {estimated} ops"
    return f"op times: measured on this machine for {measured} ops; {how} for {estimated}"
