"""A public function named like a module of its package is that module, made callable.

`import autoplan.x.y` binds the module y to the name autoplan.x.y (and `import autoplan.x.y as z` reads that
name), so a function of the same name is replaced by the module once anything imports it ("'module' object is
not callable"), or replaces the module for whoever imports it after. autoplan.plan (plan.py), autoplan.profile
(profile/) and autoplan.calibrate.refit are each one object instead: the module, which calls the function
(tests/test_import_order.py finds any other such name). (autoplan.runtime's materialize and tensor_parallel are
plain functions: their modules live in runtime/distributed/.)
"""

from __future__ import annotations

import inspect
import types
from typing import Callable


def callable_module(module: types.ModuleType, function: Callable) -> types.ModuleType:
    """`module`, made callable as `function` (its attributes unchanged; inspect.signature gives the function's)."""
    module.__class__ = type(f"CallableModule[{function.__name__}]", (types.ModuleType,),
                            {"__call__": staticmethod(function), "__slots__": ()})
    module.__signature__ = inspect.signature(function)
    return module
