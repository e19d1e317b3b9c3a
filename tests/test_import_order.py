"""Dependencies point one way. Each part of autoplan imports only parts to its left in ORDER, and the
planning core never imports torch (it works from a saved profile, fast and testable without a model).
Inside a part, no modules import each other around a loop; runtime/'s folders (applying a plan, the training loop's
parts, verify's harness) import one way; no public name of a package is bound to anything but
its module of that name; the train.py template reaches autoplan through the versioned runtime interface only.

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


def from_target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` statement of `module` reads from, relative ones resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) of every import in `source`, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = from_target(node, module, is_package)
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
    ("autoplan.profile.whole_model", "from autoplan.runtime.components.data import call_model\n"),
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


# ---------------------------------------------------------------------------------------------------------
# loops inside a part


def modules_imported(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `module` imports (`from autoplan.x import y` names the module autoplan.x.y when
    there is one, else autoplan.x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = from_target(node, module, is_package)
            found |= {f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names}
    return (found & known) - {module}


def loops_inside_parts(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """Each set of modules of one part (module name -> (source, is a package)) that import each other around a
    loop, sorted; [] when there is none. A loop works only in the order Python happens to meet its modules, and
    an import moved inside a function to break one at import time still ties the modules together."""
    known = set(sources)
    edges = {name: {other for other in modules_imported(source, name, is_package, known)
                    if part_of(other) == part_of(name)}
             for name, (source, is_package) in sources.items()}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(edges[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += edges[name]
        return seen

    reach = {name: reachable(name) for name in edges}
    loops = {frozenset({name} | {other for other in reach[name] if name in reach[other]})
             for name in edges if name in reach[name]}
    return sorted(sorted(loop) for loop in loops)


def test_no_modules_of_a_part_import_each_other_around_a_loop():
    sources = {name: (path.read_text(), path.name == "__init__.py") for name, path in all_modules()}
    assert loops_inside_parts(sources) == []


def test_the_check_finds_a_loop_inside_a_part():
    """A loop through an import inside a function counts; a chain or a loop across parts (ORDER's) does not."""
    planted = {"autoplan.cost.a": ("from autoplan.cost import b\n", False),
               "autoplan.cost.b": ("def f():\n    from autoplan.cost.c import x\n", False),
               "autoplan.cost.c": ("from autoplan.cost.a import y\n", False),
               "autoplan.cost.d": ("from autoplan.cost import a\n", False)}
    assert loops_inside_parts(planted) == [["autoplan.cost.a", "autoplan.cost.b", "autoplan.cost.c"]]
    del planted["autoplan.cost.c"]
    assert loops_inside_parts(planted) == []


# ---------------------------------------------------------------------------------------------------------
# runtime/'s folders, by who needs them


RUNTIME_ORDER = ("distributed", "components", "harness", "")
"""autoplan.runtime's folders, left to right: applying a plan (distributed/), the training loop's parts
(components/), autoplan verify's harness (harness/), then runtime's own modules ("": apply_plan, startup,
interface and the package, the interface a train.py reads). Each imports only runtime modules of its own folder
or of folders to its left."""


def runtime_folder(module: str) -> str | None:
    """"autoplan.runtime.distributed.mesh" -> "distributed"; "autoplan.runtime.startup" -> ""; None outside runtime."""
    parts = module.split(".")
    if parts[:2] != ["autoplan", "runtime"]:
        return None
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in RUNTIME_ORDER[:-1]) else ""


def runtime_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Every import of the runtime module `module` that points right in RUNTIME_ORDER."""
    mine = runtime_folder(module)
    if mine is None:
        return []
    problems = []
    for line, target in imports_of(source, module, is_package):
        theirs = runtime_folder(target)
        if theirs is not None and RUNTIME_ORDER.index(theirs) > RUNTIME_ORDER.index(mine):
            problems.append(f"{module}:{line} imports {target}: runtime/{mine or '.'} may import only "
                            f"{', '.join(f'runtime/{f}' for f in RUNTIME_ORDER[:RUNTIME_ORDER.index(mine) + 1])}")
    return problems


def test_every_runtime_module_is_in_a_folder_of_the_order():
    folders = {child.name for child in (PACKAGE / "runtime").iterdir() if (child / "__init__.py").is_file()}
    assert folders == set(RUNTIME_ORDER) - {""}


def test_runtime_folders_import_one_way():
    problems = []
    for name, path in all_modules():
        problems += runtime_violations(name, path.read_text(), path.name == "__init__.py")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, source", [
    ("autoplan.runtime.distributed.steps", "from autoplan.runtime.components.data import TrainingData\n"),
    ("autoplan.runtime.distributed.recompute", "def f():\n    from autoplan.runtime.harness import hooks\n"),
    ("autoplan.runtime.components.metrics", "from autoplan.runtime.harness.hooks import verify_hook\n"),
    ("autoplan.runtime.harness.reference", "from autoplan.runtime import adamw\n"),
    ("autoplan.runtime.components.checkpoint", "import autoplan.runtime.apply_plan\n"),
])
def test_the_check_finds_a_runtime_import_against_the_folders(module, source):
    assert runtime_violations(module, source)


def test_the_runtime_check_lets_a_folder_use_those_left_of_it():
    assert runtime_violations("autoplan.runtime.components.metrics", "from autoplan.runtime.distributed.mesh import "
                              "RankLayout\nfrom autoplan.runtime.components import memory\n") == []
    assert runtime_violations("autoplan.runtime.apply_plan", "from autoplan.runtime.harness.hooks import x\n") == []
    assert runtime_violations("autoplan.runtime", "from autoplan.runtime.harness.hooks import x\n", True) == []


# ---------------------------------------------------------------------------------------------------------
# public names that are also modules


def collisions(package: str, source: str, submodules: set[str]) -> list[str]:
    """Names the package's __init__ (`source`) binds at its top level to anything but its module of that name:
    `import package.name` rebinds the name to the module (and `import package.name as m` reads the name), so one
    of the two is lost. A public function named like a module is that module made callable (autoplan/public.py)."""
    problems = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = [target.id for target in targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.ImportFrom):
            same = from_target(node, f"{package}.__init__", False) == package
            bound = [alias.asname or alias.name for alias in node.names
                     if not (same and (alias.asname or alias.name) == alias.name)]
        elif isinstance(node, ast.Import):
            bound = [alias.asname for alias in node.names if alias.asname and alias.name != f"{package}.{alias.asname}"]
        else:
            bound = []
        problems += [f"{package}:{node.lineno} binds {name!r}, the name of its module {package}.{name}"
                     for name in bound if name in submodules]
    return problems


def test_no_public_name_collides_with_a_module():
    problems = []
    for name, path in all_modules():
        if path.name == "__init__.py":
            submodules = {child.stem for child in path.parent.glob("*.py") if child.name != "__init__.py"}
            submodules |= {child.name for child in path.parent.iterdir() if (child / "__init__.py").is_file()}
            problems += collisions(name, path.read_text(), submodules)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package, source", [
    ("autoplan", "def profile(model, gpu='cpu'):\n    pass\n"),
    ("autoplan.runtime", "from autoplan.runtime.distributed.materialize import materialize\n"),
    ("autoplan", "plan = None\n"),
    ("autoplan", "from autoplan.api import plan_model as plan\n"),
])
def test_the_check_finds_a_name_bound_over_a_module(package, source):
    assert collisions(package, source, {"profile", "plan", "materialize"})


def test_binding_the_module_itself_is_no_collision():
    assert collisions("autoplan", "from autoplan import plan, profile\nfrom . import plan\n", {"plan", "profile"}) == []


def test_autoplan_plan_and_profile_are_the_modules_and_the_functions():
    """The public functions of DESIGN.md and the modules of the same name are one object each, whatever is imported
    first; the signatures are the functions'."""
    import inspect

    code = ("import inspect, autoplan.plan as p, autoplan.profile.roofline, autoplan\n"
            "print(p is autoplan.plan, p.Plan is autoplan.Plan, inspect.signature(autoplan.plan))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split(" ", 2)[:2] == ["True", "True"]
    assert run.stdout.split(" ", 2)[2].startswith("(model, gpus: 'int'")
    assert "pin" in inspect.signature(__import__("autoplan").estimate).parameters


# ---------------------------------------------------------------------------------------------------------
# the generated program's imports


TEMPLATES = PACKAGE / "codegen" / "templates"
AUTOPLAN_NAMES = ("runtime", "parallelize", "init_mesh", "Parallelized")
"""What a train.py may read from autoplan itself (runtime/interface.py: through autoplan.runtime, and
autoplan.parallelize and autoplan.init_mesh, and the type parallelize returns); the rest through runtime.*."""


def runtime_interface() -> set[str]:
    """autoplan.runtime's __all__, read from its source (no torch): the names RUNTIME_API versions."""
    tree = ast.parse((PACKAGE / "runtime" / "__init__.py").read_text())
    listed = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    return set(ast.literal_eval(listed))


def template_problems(name: str, source: str, interface: set[str]) -> list[str]:
    """Where a template reaches autoplan other than by `import autoplan`, `from autoplan import runtime`,
    autoplan.<AUTOPLAN_NAMES> and runtime.<a name of the runtime interface>."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            problems += [f"{name}:{node.lineno} imports {alias.name}" for alias in node.names
                         if alias.name.split(".")[0] == "autoplan" and (alias.name != "autoplan" or alias.asname)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "autoplan":
            if node.module != "autoplan" or [(a.name, a.asname) for a in node.names] != [("runtime", None)]:
                problems.append(f"{name}:{node.lineno} imports from {node.module}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "autoplan" and node.attr not in AUTOPLAN_NAMES:
                problems.append(f"{name}:{node.lineno} reads autoplan.{node.attr}, outside {AUTOPLAN_NAMES}")
            if node.value.id == "runtime" and node.attr not in interface:
                problems.append(f"{name}:{node.lineno} reads runtime.{node.attr}, not in autoplan.runtime.__all__")
    return problems


def test_templates_reach_autoplan_through_the_runtime_interface_only():
    templates = sorted(path for path in TEMPLATES.glob("*.py") if path.name != "__init__.py")
    assert templates, f"no template found in {TEMPLATES}"
    problems = []
    for path in templates:
        problems += template_problems(path.name, path.read_text(), runtime_interface())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", [
    "from autoplan.runtime.distributed.split import split_model\n",
    "import autoplan.runtime\n",
    "from autoplan import runtime, api\n",
    "import autoplan\nautoplan.api.plan_model('m.py', 8)\n",
    "from autoplan import runtime\nruntime.split.PipelineSplit\n",
])
def test_the_check_finds_a_template_reaching_around_the_interface(source):
    assert template_problems("train.py", source, runtime_interface())
