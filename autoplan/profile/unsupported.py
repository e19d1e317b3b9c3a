"""unsupported_ops.txt: what autoplan could not capture or profile exactly, for a human to read.

Written next to ops.csv. Nothing in it is fatal: a model that runs eagerly is always profiled; this file
says where the numbers are weaker (a fallback capture, ops counted as 0 FLOPs, times estimated).
No torch here.
"""

from __future__ import annotations

from collections import Counter

from autoplan.profile.types import ModelProfile

FILE_NAME = "unsupported_ops.txt"

_METHODS = {
    "export": "torch.export",
    "symbolic_trace": "symbolic tracing (make_fx) of the forward flattened to tensors",
    "dispatch": "recording the ops of an eager forward under a dispatch mode",
}


def unsupported_ops_text(profile: ModelProfile) -> str:
    """The contents of unsupported_ops.txt for `profile` (a header line even when all went well)."""
    counts = Counter(op.op for op in profile.ops)
    lines = [f"# {profile.model}: captured by {_METHODS.get(profile.capture_method, profile.capture_method)}, "
             f"{len(profile.ops)} ops"]
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
    if not (profile.capture_failures or profile.unsupported_ops or profile.op_failures):
        lines += ["", "nothing unsupported: every op has a FLOP formula and was replayed and timed or estimated"]
    return "\n".join(lines) + "\n"
