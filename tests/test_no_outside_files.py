"""No user-facing text names a file outside the repository: the messages, help and generated files of
autoplan/, the README and docs/ point at what a user has (docs/model-contract.md, not a design note kept
beside the repository). Docstrings and comments may cite the project's reference data; a string the
program can print may not."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|(?<![\w/.-])shared/|/work/")
"""The design note and reference folder beside the repository, and this machine's work folders."""


def _is_docstring(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """A string that is a statement by itself: a module, class, function or attribute docstring."""
    return isinstance(parents.get(node), ast.Expr)


def _printable_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in `path` that is not a docstring (f-string parts included)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            outer = parents.get(node)
            owner = outer if isinstance(outer, ast.JoinedStr) else node
            if not _is_docstring(owner, parents):
                found.append((node.lineno, node.value))
    return found


def test_the_check_finds_a_message_naming_the_design_note(tmp_path):
    """The check below can fail: a message naming the design note is found, its docstring is not."""
    path = tmp_path / "m.py"
    path.write_text('"""See DESIGN.md."""\n'
                    'def f(x):\n    """shared/reference/formulas.md"""\n'
                    '    raise ValueError(f"{x} must define it (see the contract in DESIGN.md)")\n')
    assert [(line, text) for line, text in _printable_strings(path) if OUTSIDE.search(text)] == [
        (4, " must define it (see the contract in DESIGN.md)")]


def test_no_message_of_autoplan_names_a_file_outside_the_repository():
    offending = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
                 for path in sorted((ROOT / "autoplan").rglob("*.py"))
                 for line, text in _printable_strings(path) if OUTSIDE.search(text)]
    others = [f"{path.relative_to(ROOT)}" for path in sorted((ROOT / "autoplan").rglob("*"))
              if path.is_file() and path.suffix not in (".py", ".pyc") and OUTSIDE.search(path.read_text(errors="replace"))]
    assert not offending + others, "\n".join(offending + others)


def test_the_readme_and_docs_name_no_file_outside_the_repository():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = [line for line in page.read_text().splitlines() if OUTSIDE.search(line)]
        assert lines == [], f"{page.relative_to(ROOT)}: {lines}"


def test_the_model_contract_a_message_cites_is_in_the_repository():
    """A model file lacking build_model() is sent to CONTRACT_DOC: that page exists, is the contract, and the README
    links to it."""
    from autoplan.contract import CONTRACT, CONTRACT_DOC

    assert CONTRACT_DOC in CONTRACT
    page = ROOT / CONTRACT_DOC
    assert page.read_text().startswith("# The model contract\n")
    assert "def build_model()" in page.read_text() and "def example_batch(" in page.read_text()
    assert f"({CONTRACT_DOC})" in (ROOT / "README.md").read_text()
