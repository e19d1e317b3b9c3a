"""Code generation: the torchrun training program and its launchers for a Plan."""

from autoplan.codegen.program import check_supported, render_train_py, write_program

__all__ = ["check_supported", "render_train_py", "write_program"]
