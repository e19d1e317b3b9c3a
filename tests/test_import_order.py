"""Dependencies point one way. Each part of autoplan imports only parts to its left in ORDER, and the
planning core never imports torch (it works from a saved profile, fast and testable without a model).

Read from the source with ast: every import statement counts, those inside functions too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoplan"

ORDER = (
    "errors", "public", "layout", "plan", "hardware", "profile_data", "procs",
    "chain", "cost", "solve",
    "contract", "source", "capture", "profile", "runtime", "codegen", "report", "verify", "calibrate",
    "api", "autoplan", "cli", "__main__",
)
"""Left to right: types and rules, the torch-free planning core (chain -> cost -> solve), the torch side
(the model contract, capture, profile, the generated program's runtime), the writers and tools, then
the API, the package's __init__ (`autoplan`: the public functions) and the command line."""

TORCH_FREE = ("errors", "public", "layout", "plan", "hardware", "profile_data", "chain", "cost", "solve", "report")
"""Parts that never import torch, directly or through another part."""


def part_of(module: str) -> str:
    """"autoplan.cost.evaluate" -> "cost"; "autoplan" -> "autoplan"."""
    parts = module.split(".")
    return "autoplan" if len(parts) == 1 else parts[1]


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    names = list(relative.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) of every import in `source`, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "autoplan" or (node.level and not node.module):
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return found


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Every import of `module` that points right in ORDER, or to torch from a torch-free part."""
    mine = part_of(module)
    problems = []
    for line, target in imports_of(source, module, is_package):
        if target.split(".")[0] == "torch" and mine in TORCH_FREE:
            problems.append(f"{module}:{line} imports {target}: {mine} is torch-free")
        if not target.startswith("autoplan"):
            continue
        theirs = part_of(target)
        if theirs != mine and ORDER.index(theirs) > ORDER.index(mine):
            problems.append(f"{module}:{line} imports {target}: {mine} may import only parts left of it "
                            f"({' -> '.join(ORDER[:ORDER.index(mine)])})")
    return problems


def all_modules() -> list[tuple[str, Path]]:
    return sorted((module_name(path), path) for path in PACKAGE.rglob("*.py")
                  if "templates" not in path.relative_to(PACKAGE).parts)


def test_every_part_of_the_package_is_placed_in_the_order():
    unplaced = {part_of(name) for name, _ in all_modules()} - set(ORDER)
    assert not unplaced, f"place these in ORDER: {sorted(unplaced)}"


def test_imports_point_one_way():
    problems = []
    for name, path in all_modules():
        problems += violations(name, path.read_text(), path.name == "__init__.py")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, source", [
    ("autoplan.cost.module_costs", "from autoplan.solve.layouts import SUPPORTED\n"),
    ("autoplan.cost.compute", "def f():\n    from autoplan.solve import search\n"),
    ("autoplan.profile.whole_model", "from autoplan.runtime.data import call_model\n"),
    ("autoplan.chain.modules", "import torch\n"),
    ("autoplan.solve.search", "from torch import nn\n"),
])
def test_the_check_finds_edges_against_the_order(module, source):
    """The edges this order was made to remove (cost -> solve, planning -> runtime, torch in the core)."""
    assert violations(module, source)


def test_planning_core_imports_no_torch_at_run_time():
    """Importing every module of the torch-free parts leaves torch unimported (nothing pulls it in
    through a third module)."""
    names = [name for name, _ in all_modules() if part_of(name) in TORCH_FREE]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"torch was imported: {out.strip()[:300]}"


def test_autoplan_profile_is_the_function_and_the_subpackage(tmp_path):
    """DESIGN.md's public autoplan.profile() and the subpackage autoplan/profile/ are one object: importing
    autoplan.profile.* (which binds the subpackage to the name autoplan.profile) leaves the function callable."""
    code = ("import autoplan, autoplan.profile.roofline\n"
            "from autoplan.profile import profile_model\n"
            "try:\n    autoplan.profile('no_such_model.py')\n"
            "except autoplan.UserError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("model file not found"), run.stderr[-500:]
