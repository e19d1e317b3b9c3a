"""Load a user's model.py by the model contract (see DESIGN.md).

    def build_model() -> nn.Module                      required (or another factory: file.py:name)
    def example_batch(batch_size) -> (inputs, targets)  required
    def loss_fn(output, targets) -> Tensor              optional

Importing runs the user's code, so every failure is turned into a one-line UserError.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from autoplan.errors import UserError


@dataclass(frozen=True)
class ModelSource:
    path: Path
    """Resolved path of the model file."""
    factory_name: str
    """Name of the factory function in the file."""
    module: ModuleType
    build_model: Callable[[], Any]
    example_batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Any] | None

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.factory_name}"


def split_spec(spec: str) -> tuple[Path, str]:
    """"model.py:factory" -> (Path("model.py"), "factory"); the factory defaults to build_model."""
    path, sep, factory = spec.rpartition(":")
    if not sep or not factory.isidentifier() or not path:
        return Path(spec), "build_model"
    return Path(path), factory


def _user_frame(exc: BaseException, path: Path) -> str:
    """' (model.py:12)' for the innermost frame of the user's file in a traceback, else ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return f" ({path.name}:{frames[-1].lineno})" if frames else ""


def load_source(spec: str) -> ModelSource:
    path, factory_name = split_spec(spec)
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    if not path.is_file():
        raise UserError(f"model file is not a file: {path}")
    data = path.read_bytes()
    if not data.strip():
        raise UserError(f"model file is empty: {path}")
    if b"\x00" in data:
        raise UserError(f"model file is binary, not Python source: {path}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"model file is not UTF-8 text: {path}") from None
    try:
        compile(text, str(path), "exec")
    except SyntaxError as e:
        raise UserError(f"syntax error in {path}:{e.lineno}: {e.msg}") from None

    path = path.resolve()
    module_name = f"autoplan_user_model_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.parent))  # let model.py import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        raise UserError(f"{path.name} imports a module that is not installed: {e.name}") from None
    except Exception as e:  # noqa: BLE001 - any error in user code is reported, not raised
        raise UserError(f"importing {path.name} failed{_user_frame(e, path)}: {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(str(path.parent))

    missing = [n for n in (factory_name, "example_batch") if not callable(getattr(module, n, None))]
    if missing:
        raise UserError(f"{path.name} must define {' and '.join(n + '()' for n in missing)} (see the model contract in DESIGN.md)")
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise UserError(f"{path.name}: loss_fn is not a function")
    return ModelSource(path, factory_name, module, getattr(module, factory_name), module.example_batch, loss_fn)


def call_user(source: ModelSource, what: str, fn: Callable, *args) -> Any:
    """Call a function from the user's file; an exception becomes a UserError naming it."""
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{what} in {source.path.name} raised{_user_frame(e, source.path)}: {type(e).__name__}: {e}") from None
