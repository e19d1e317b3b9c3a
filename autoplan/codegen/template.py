"""The generated train.py's template: autoplan/codegen/templates/train.py, a valid Python program with
a docstring of its own and a placeholder config block between two marker lines. It ships as the module
autoplan.codegen.templates.train but autoplan never imports it: fill() reads it as text and puts a plan's
docstring and config block in their place; every other line of the template reaches train.py unchanged.
"""

from __future__ import annotations

import ast
from importlib import resources

CONFIG_BEGIN = "# --- plan config begin ---\n"
CONFIG_END = "# --- plan config end ---\n"
"""The marker lines around the template's placeholder config; fill() drops them with the placeholders."""


def template_text() -> str:
    """The template's source as shipped (the source tree's file in an editable install)."""
    return (resources.files("autoplan.codegen") / "templates" / "train.py").read_text(encoding="utf-8")


def fill(docstring: str, config: str) -> str:
    """The template with `docstring` (the text between the triple quotes) in place of its own docstring
    and `config` (whole lines, no final newline) in place of its marked placeholder config block."""
    body = _after_docstring(template_text())
    head, rest = _split_at(body, CONFIG_BEGIN)
    _, tail = _split_at(rest, CONFIG_END)
    return f'"""{docstring}"""\n{head}{config}\n{tail}'


def placeholder_config() -> str:
    """The template's own config lines, between the markers (for tests: the names a plan must set)."""
    _, rest = _split_at(template_text(), CONFIG_BEGIN)
    config, _ = _split_at(rest, CONFIG_END)
    return config


def _after_docstring(text: str) -> str:
    """`text` from the line after its module docstring on."""
    first = ast.parse(text).body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        raise ValueError("the train.py template must open with its docstring")
    return "".join(text.splitlines(keepends=True)[first.end_lineno:])


def _split_at(text: str, marker_line: str) -> tuple[str, str]:
    """(the lines before, the lines after) the one line `marker_line` of the template."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line == marker_line]
    if len(found) != 1:
        raise ValueError(f"the train.py template must hold the line {marker_line.strip()!r} once, "
                         f"it holds it {len(found)} times")
    return "".join(lines[:found[0]]), "".join(lines[found[0] + 1:])
