"""Keep measured-timing caches out of the user's home: every test session gets its own. The wheel a
regular install would get, built once per session for the tests that check what it ships."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("AUTOPLAN_CACHE", tempfile.mkdtemp(prefix="autoplan-test-cache-"))

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: without it they are skipped, saying so (never silently passed)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch {torch.__version__} sees none on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@dataclass(frozen=True)
class BuiltWheel:
    wheel: zipfile.ZipFile
    site: Path
    """The wheel unpacked, what pip install does with a pure-Python wheel: put it first on sys.path."""


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> BuiltWheel:
    """A wheel built from a copy of the source tree (no network: setuptools' own bdist_wheel)."""
    pytest.importorskip("setuptools", minversion="70.1")
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    for folder in ("autoplan", "profiles"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    wheel = zipfile.ZipFile(next((tmp / "dist").glob("*.whl")))
    wheel.extractall(tmp / "site")
    return BuiltWheel(wheel, tmp / "site")
