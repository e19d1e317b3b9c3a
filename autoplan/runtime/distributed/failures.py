"""Name the op, module and source line where a pipeline stage failed.

A pipeline stage is generated code (an fx GraphModule built from the exported graph), so the traceback of
an error inside it points at `<eval_with_key>.16` line 62, and torch's pipeline wraps it in "[Stage 2]
failed to run forward: args: (...)". `stage_failures` adds one note to the original exception, which
Python prints under its message and `autoplan verify` puts on its root-cause line:

    autoplan: at aten.masked_fill_.Scalar in encoder.layer.1.attention.self (DisentangledSelfAttention),
    pipeline stage 2, from modeling_deberta_v2.py:130 in forward

The op is found from the innermost traceback frame that runs a stage's generated code, the module and the
source line from what torch.export recorded on that node (`nn_module_stack`, `stack_trace`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from torch import fx, nn

NOTE_PREFIX = "autoplan: at "
"""How the note starts (verify's root-cause line keeps it)."""

_SOURCE_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@contextlib.contextmanager
def stage_failures(stages: Mapping[int, nn.Module]) -> Iterator[None]:
    """Run a pipeline step; an exception from a stage's generated code leaves with a note that names it."""
    try:
        yield
    except Exception as error:
        root = _original(error)
        note = failure_note(root, stages)
        if note and note not in getattr(root, "__notes__", ()):
            root.add_note(note)
        raise


def failure_note(error: BaseException, stages: Mapping[int, nn.Module]) -> str | None:
    """"autoplan: at OP in MODULE (TYPE), pipeline stage K, from FILE:LINE in FUNC" for the innermost
    frame of `error`'s traceback that runs generated stage code, None when no frame does."""
    code = {module.forward.__code__.co_filename: (index, module)
            for index, stage in stages.items() for module in stage.modules() if isinstance(module, fx.GraphModule)}
    found = None
    traceback = error.__traceback__
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename
        if filename in code:
            found = (*code[filename], traceback.tb_lineno)
        traceback = traceback.tb_next
    if found is None:
        return None
    index, module, line = found
    node = _node_at(module, line)
    if node is None:
        return None
    parts = [f"{NOTE_PREFIX}{node.target}"]
    owner = _owner(node)
    if owner:
        parts.append(f" in {owner}")
    parts.append(f", pipeline stage {index}")
    source = _source(node)
    if source:
        parts.append(f", from {source}")
    return "".join(parts)


def _original(error: BaseException) -> BaseException:
    """The first exception of a chain (`raise RuntimeError(...) from e` leads to e)."""
    seen = {id(error)}
    while True:
        inner = error.__cause__ or error.__context__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner


def _node_at(module: fx.GraphModule, line: int) -> fx.Node | None:
    """The node whose generated line is `line` (fx numbers lines from the `def forward` line)."""
    lines = module.code.splitlines()
    start = next((i + 1 for i, text in enumerate(lines) if text.startswith("def forward")), None)
    index = getattr(module, "_lineno_map", None) or {}
    if start is None or line - start not in index:
        return None
    nodes = list(module.graph.nodes)
    position = index[line - start]
    return nodes[position] if 0 <= position < len(nodes) else None


def _owner(node: fx.Node) -> str | None:
    """"path (Type)" of the innermost model module the op ran in, from torch.export's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, kind = list(stack.values())[-1]
    name = str(kind).rsplit(".", 1)[-1].rstrip("'>")
    return f"{path} ({name})" if path else name


def _source(node: fx.Node) -> str | None:
    """"file.py:LINE in FUNC" of the model's source line that made the op (the last frame torch.export
    recorded)."""
    frames = _SOURCE_FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    path, line, function = frames[-1]
    return f"{Path(path).name}:{line} in {function}"
