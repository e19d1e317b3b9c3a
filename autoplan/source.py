"""Moved to autoplan.contract (one module for the model contract: loading a model file and calling the model);
this name stays for code written against it."""

from autoplan.contract import (CONTRACT, CONTRACT_DOC, ModelSource, call_user, import_root, load_source, local_files,
                               module_name, raised_in_user_code, search_dirs, split_spec, user_error, where)

__all__ = ["CONTRACT", "CONTRACT_DOC", "ModelSource", "call_user", "import_root", "load_source", "local_files",
           "module_name", "raised_in_user_code", "search_dirs", "split_spec", "user_error", "where"]
