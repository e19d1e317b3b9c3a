"""No function of autoplan/ takes more than six parameters: a longer list takes a config object (PlanOptions,
SearchOptions, MemoryLayout, TableSetting, VerifySettings, the layout itself) instead, as the developers' guide asks.

Counted: the named parameters (positional and keyword-only) of every def of the whole package (the runtime, codegen,
verify.py, profile, capture, calibrate, ... included), self and cls left out; *args and **kwargs are passed through,
not listed, and are not counted. ALLOWED is the rest that keep a long list, each with why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "autoplan"
MOST = 6

ALLOWED = {
    "__init__.py:parallelize": "the public call of a user's own loop: the model, the plan and the mesh, then "
                               "keyword-only options with defaults (as torch's fully_shard); it forwards to "
                               "runtime/apply_plan.parallelize",
    "runtime/apply_plan.py:parallelize": "as __init__.py:parallelize, whose arguments it takes",
    "profile/model_profile.py:_Timer.__call__": "one op's replay facts from its one caller, once per op on the "
                                                "profiling hot path (an object per op would cost planning time)",
    "runtime/distributed/batchnorm.py:synchronized_batch_norm": "torch.nn.functional.batch_norm's arguments "
                                                                "(training mode) and the process group",
    "runtime/distributed/batchnorm.py:DataParallelBatchNorm.__init__": "torch.nn.BatchNorm's constructor (it "
                                                                       "subclasses it) and the process group",
    "runtime/distributed/tensor_parallel.py:_register_cpu_attention_sharding._forward": "the schema of "
        "aten._scaled_dot_product_flash_attention_for_cpu, which register_sharding calls it with",
    "runtime/distributed/tensor_parallel.py:_register_cpu_attention_sharding._backward": "the schema of "
        "aten._scaled_dot_product_flash_attention_for_cpu_backward, which register_sharding calls it with",
}


def _long_signatures() -> dict[str, int]:
    """"path:Class.function" -> its parameter count, for every def of autoplan/ over MOST."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        found.update({f"{relative.as_posix()}:{name}": n for name, n in _long_in(ast.parse(path.read_text()))})
    return found


def _long_in(tree: ast.AST) -> list[tuple[str, int]]:
    """(Class.function, parameter count) of the defs of `tree` over MOST."""
    out = []
    for owner, node in _functions(tree):
        args = node.args
        names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        if len(names) > MOST:
            out.append((f"{owner}{node.name}", len(names)))
    return out


def _functions(tree: ast.AST, owner: str = ""):
    """(owner prefix, def) for every function, methods as Class.method, nested defs under their function."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield owner, node
            yield from _functions(node, f"{owner}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{owner}{node.name}.")
        else:
            yield from _functions(node, owner)


def test_no_function_takes_more_than_six_parameters():
    long = _long_signatures()
    unexplained = {name: count for name, count in long.items() if name not in ALLOWED}
    assert not unexplained, (f"more than {MOST} parameters (take a config object or the layout, or add the function "
                             f"to ALLOWED with why): {unexplained}")


def test_the_allow_list_names_only_functions_that_still_need_it():
    stale = sorted(set(ALLOWED) - set(_long_signatures()))
    assert not stale, f"ALLOWED names functions that no longer take more than {MOST} parameters: {stale}"


def test_the_count_sees_methods_nested_functions_and_keyword_only_parameters():
    source = ("class A:\n    def m(self, a, b, c, d, e, f, g): pass\n"
              "    def fine(self, a, b, c, d, e, f): pass\n"
              "def outer():\n    def inner(a, b, c, d, e, f, *, g): pass\n"
              "def passes_through(a, b, c, d, e, f, *args, **kwargs): pass\n")
    assert _long_in(ast.parse(source)) == [("A.m", 7), ("outer.inner", 7)]
