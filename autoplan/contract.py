"""The model contract (docs/model-contract.md), in one place: what a model file defines, how autoplan loads it,
and how a model is called on a batch and its loss taken.

    def build_model() -> nn.Module                      required (or another factory: file.py:name)
    def example_batch(batch_size) -> (inputs, targets)  required
    def loss_fn(output, targets) -> Tensor              optional
    def make_dataloader(rank, world_size[, batch_size]) optional (the generated program's data)

Loading. The file is imported as Python would import it from its folder: under its own module name (`wrapper`, or
`pkg.model` for a file inside a package, so its relative imports work), with its folder (and, inside a
package, the folder above the package) first on sys.path, so that it imports the modules and packages beside
it. Those local modules are found by reading the import statements (local_files): the output folder copies
them with the model file (codegen/program.py), so the copy imports what the original did.
Importing runs the user's code, so every failure is turned into a one-line UserError.

Calling. What planning (profile/whole_model.py times the model) and the generated program (autoplan.runtime)
both run, below both. Inputs from example_batch are a Tensor (one positional argument), a tuple/list (positional
arguments) or a dict (keyword arguments). Without a loss_fn, the default below applies: take `.logits` from
Hugging Face-style outputs, cross-entropy over the last dimension for integer targets, mean squared error
otherwise. Both are means over the batch, so the mean of equal-sized micro-batch losses equals the loss of the
whole batch (what gradient accumulation and pipelining rely on).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import importlib.util
import keyword
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from autoplan.errors import UserError

CONTRACT_DOC = "docs/model-contract.md"
"""The model contract's page in the repository (tests check it exists)."""
CONTRACT = f"see the model contract in autoplan's {CONTRACT_DOC}"
"""Where a message sends the user for the contract (a page of the repository's docs/)."""


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
    root: Path | None = None
    """The folder its imports start from (its own, or the one above the packages it is in); None for a
    factory given as a Python object."""
    files: tuple[Path, ...] = ()
    """The model file and the local Python files it imports, directly or through each other (local_files)."""

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.factory_name}"


def split_spec(spec: str) -> tuple[Path, str]:
    """"model.py:factory" -> (Path("model.py"), "factory"); the factory defaults to build_model."""
    path, sep, factory = spec.rpartition(":")
    if not sep or not factory.isidentifier() or not path:
        return Path(spec), "build_model"
    return Path(path), factory


def import_root(path: Path) -> Path:
    """The folder a model file's imports start from: its own, or, when it is inside packages (folders with
    an __init__.py), the folder above the outermost of them."""
    root = path.parent
    while (root / "__init__.py").is_file() and root.parent != root:
        root = root.parent
    return root


def search_dirs(path: Path) -> tuple[Path, ...]:
    """Where the model file's absolute imports look first, in order: its folder (as for `python file.py`),
    then its import root (a file inside a package imports the package's other modules by their full names)."""
    root = import_root(path)
    return (path.parent,) if root == path.parent else (path.parent, root)


def local_files(path: Path) -> tuple[Path, ...]:
    """The model file and every Python file under its import root that it imports, directly or through each
    other (found by reading their import statements, those inside functions included: a factory's lazy
    import counts), with the __init__.py of each package on the way (and of the packages the file is in)."""
    path = path.resolve()
    root, dirs = import_root(path), search_dirs(path)
    found: dict[Path, None] = {path: None}
    folder = path.parent
    while folder != root:
        found[folder / "__init__.py"] = None
        folder = folder.parent
    pending = list(found)
    while pending:
        for file in _imported_files(pending.pop(), dirs):
            if file not in found and file.is_relative_to(root):
                found[file] = None
                pending.append(file)
    return tuple(found)


def _imported_files(file: Path, dirs: tuple[Path, ...]) -> list[Path]:
    """The local files that `file`'s import statements name (modules, and packages' __init__.py)."""
    try:
        tree = ast.parse(file.read_bytes(), str(file))
    except (OSError, SyntaxError, ValueError):
        return []  # importing it reports the error; the copy just does not follow its imports
    files: list[Path] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                files += _resolve(alias.name.split("."), dirs)
        elif isinstance(node, ast.ImportFrom):
            parts = node.module.split(".") if node.module else []
            bases = dirs
            if node.level:  # relative: from the importing file's package
                base = file.parent
                for _ in range(node.level - 1):
                    base = base.parent
                bases = (base,)
            files += _resolve(parts, bases)
            files += [f for alias in node.names if alias.name != "*"  # `from pkg import submodule`
                      for f in _resolve([*parts, alias.name], bases)]
    return files


def _resolve(parts: list[str], bases: tuple[Path, ...]) -> list[Path]:
    """The files that importing module `parts` runs, from the first of `bases` that has it; [] if none does."""
    for base in bases:
        files: list[Path] = []
        folder: Path | None = base
        for part in parts:
            if folder is None:  # a module file has no submodules
                files = []
                break
            package, module = folder / part, folder / f"{part}.py"
            if (package / "__init__.py").is_file():  # Python's order: a package, a module, a namespace folder
                files.append(package / "__init__.py")
                folder = package
            elif module.is_file():
                files.append(module)
                folder = None
            elif package.is_dir():
                folder = package
            else:
                files = []
                break
        if files:
            return [f.resolve() for f in files]
    return []


def module_name(path: Path, root: Path) -> str:
    """The dotted name Python imports `path` by from `root` ("wrapper", "pkg.model", "pkg" for
    pkg/__init__.py)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


_LOCAL_MODULES: dict[str, Path] = {}
"""Modules imported from a model's local files in this process (name -> file): a later model whose files
have the same names (each folder's `model.py`) imports its own, not these."""


def _file_of(module: ModuleType) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def _forget_other_models() -> None:
    """Drop from sys.modules the modules imported from model folders' files before (_LOCAL_MODULES): a model
    imports its own neighbours, not another folder's that have the same names (each folder's `model.py`), and
    a neighbour it lacks is missing rather than borrowed."""
    for name in _LOCAL_MODULES:
        sys.modules.pop(name, None)


_ON_PATH: list[str] = []
"""The folders load_source put on sys.path for the model loaded last."""


def _put_first_on_path(folders: tuple[Path, ...]) -> None:
    """Put `folders` first on sys.path, as `python file.py` does, in place of the last model's: kept there
    after loading, since a factory may import its neighbours only when it is called."""
    for folder in _ON_PATH:
        if folder in sys.path:
            sys.path.remove(folder)
    _ON_PATH[:] = [str(f) for f in folders]
    for folder in reversed(_ON_PATH):
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)


def _is_free(name: str, path: Path) -> bool:
    """Whether the model file may be registered as module `name`: a valid dotted name, not taken in this
    process by another module, and no installed module has its top-level name (registering would shadow it)."""
    if not all(part.isidentifier() and not keyword.iskeyword(part) for part in name.split(".")):
        return False
    taken = sys.modules.get(name)
    if taken is not None and _file_of(taken) != path and name not in _LOCAL_MODULES:
        return False
    top = name.split(".")[0]
    elsewhere = importlib.machinery.PathFinder.find_spec(top, [p for p in sys.path if Path(p or ".").resolve()
                                                               not in search_dirs(path)])
    return elsewhere is None and top not in sys.builtin_module_names


def _check_text(path: Path) -> None:
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


def load_source(spec: str) -> ModelSource:
    path, factory_name = split_spec(spec)
    _check_text(path)
    path = path.resolve()
    root, files = import_root(path), local_files(path)
    local_names = {module_name(f, root): f for f in files}
    _forget_other_models()
    _put_first_on_path(search_dirs(path))
    name = module_name(path, root)
    if not _is_free(name, path):
        name = f"autoplan_user_model_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        raise UserError(_not_found(path, e)) from None
    except Exception as e:  # noqa: BLE001 - any error in user code is reported, not raised
        raise UserError(f"importing {path.name} failed{_user_frame(e, files, root)}: {type(e).__name__}: {e}") from None
    finally:
        _LOCAL_MODULES.update({n: f for n, f in local_names.items() if n in sys.modules})

    missing = [n for n in (factory_name, "example_batch") if not callable(getattr(module, n, None))]
    if missing:
        raise UserError(f"{path.name} must define {' and '.join(n + '()' for n in missing)} ({CONTRACT})")
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise UserError(f"{path.name}: loss_fn is not a function")
    return ModelSource(path, factory_name, module, getattr(module, factory_name), module.example_batch, loss_fn,
                       root, files)


def _not_found(path: Path, error: ModuleNotFoundError) -> str:
    """A missing import: not installed, and (for a name that is not a library's) not beside the file either."""
    where = " or ".join(str(d) for d in search_dirs(path))
    return (f"{path.name} imports {error.name}, which is not installed and not a module or package in {where}"
            if error.name else f"importing {path.name} failed: ModuleNotFoundError: {error}")


def _user_frame(exc: BaseException, files: tuple[Path, ...], root: Path | None) -> str:
    """' (model.py:12)' for the innermost frame of the user's files in a traceback (the model file or a local
    module it imports, by its path from the import root: ' (mingpt/model.py:120)'), else ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() in files]
    if not frames:
        return ""
    file = Path(frames[-1].filename).resolve()
    shown = file.relative_to(root).as_posix() if root is not None and file.is_relative_to(root) else file.name
    return f" ({shown}:{frames[-1].lineno})"


def call_user(source: ModelSource, what: str, fn: Callable, *args) -> Any:
    """Call a function from the user's file; an exception becomes a UserError naming it."""
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001
        raise user_error(source, what, e) from None


def user_error(source: ModelSource, what: str, error: BaseException, note: str = "") -> UserError:
    """"<what> in model.py raised (model.py:12): <Type>: <message>[ (note)]" for an exception of the user's code."""
    return UserError(f"{what} in {source.path.name} raised{_user_frame(error, source.files or (source.path,), source.root)}"
                     f": {type(error).__name__}: {error}" + (f" ({note})" if note else ""))


def raised_in_user_code(source: ModelSource, error: BaseException) -> bool:
    """Whether the innermost frame of `error`'s traceback is in the user's files (the user's code raised it,
    not a library it called)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve() in (source.files or (source.path,))


def where(source: ModelSource, error: BaseException) -> str:
    """"model.py:12": the innermost frame of `error` in the user's files, or ""."""
    return _user_frame(error, source.files or (source.path,), source.root).strip(" ()")


# calling the model and taking its loss

LossFn = Callable[[Any, Any], torch.Tensor]


def model_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for calling the model on `inputs`."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    args, kwargs = model_args(inputs)
    return model(*args, **kwargs)


CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)
"""Leaves of a model's inputs or outputs that torch.export records as constants (a forward returning (logits, None),
use_cache=True in a batch): a pipeline carries them, it never sends them."""


def disable_kv_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face models return a KV cache by default; training (and export) wants none: the model's config
    says so from now on, and the keyword arguments returned (a copy of `kwargs`) pass use_cache=False where
    the batch passed use_cache."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return {**kwargs, "use_cache": False} if "use_cache" in kwargs else dict(kwargs)


def is_kv_cache(value: Any) -> bool:
    """A Hugging Face KV cache (transformers.cache_utils.Cache: DynamicCache, StaticCache, ...). A model that returned
    one imported transformers' cache module: nothing is imported here."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


@contextlib.contextmanager
def outputs_without_caches(model: nn.Module) -> Iterator[None]:
    """Within: `model`'s output has None in place of every KV cache in it (is_kv_cache), an object torch.export
    cannot flatten ("Found <class 'transformers.cache_utils.DynamicCache'> in output") and training never reads,
    whatever made the model return one (use_cache=True inside its forward, a cache class a config asks for). The
    tensors around it (in tuples, lists, dicts, Hugging Face ModelOutputs) stay where they are: the loss reads those.
    What planning exports (capture) and what the pipeline's stages are cut from (runtime/distributed/split.py) run so."""
    def drop_caches(module: nn.Module, args: Any, output: Any) -> Any:
        return pytree.tree_map(lambda leaf: None if is_kv_cache(leaf) else leaf, output, is_leaf=is_kv_cache)

    handle = model.register_forward_hook(drop_caches)
    try:
        yield
    finally:
        handle.remove()


def model_logits(output: Any) -> torch.Tensor:
    """The prediction tensor of a model output: `.logits` (attribute or key), the first element of a
    tuple/list, or the output itself."""
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output:
        return model_logits(output[0])
    if not isinstance(output, torch.Tensor):
        raise UserError(f"the default loss cannot find the prediction in a model output of type "
                        f"{type(output).__name__}: define loss_fn(output, targets) in the model file")
    return output


def default_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets (class ids or tokens), mean squared error otherwise."""
    logits = model_logits(output)
    if not targets.is_floating_point() and not targets.is_complex():
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return F.mse_loss(logits, targets)


def compute_loss(loss_fn: LossFn | None, output: Any, targets: Any) -> torch.Tensor:
    """The user's loss_fn if the model file defines one, else default_loss."""
    return (loss_fn or default_loss)(output, targets)
