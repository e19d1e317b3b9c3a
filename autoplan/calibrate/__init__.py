"""`autoplan calibrate`: measure this machine into a hardware profile, and refit a profile's
efficiency factors from a verified run.

    calibrate(out, nproc=None, base=None, timeout_s=600)   launch.py (torchrun, CPU/gloo or CUDA/NCCL)
    refit(verify_dir, hardware, out)                       refit.py  (no torch)
"""

from __future__ import annotations

from autoplan.calibrate import refit  # the module, callable as its function below
from autoplan.calibrate.launch import calibrate
from autoplan.calibrate.refit import RefitResult
from autoplan.public import callable_module

callable_module(refit, refit.refit)

__all__ = ["calibrate", "refit", "RefitResult"]
