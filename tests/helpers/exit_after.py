"""Run a script as __main__, then leave without the interpreter's teardown (tests/helpers/ranks.py runs every
rank's script through it).

A gloo process group still referenced from a script's leftovers and destroyed at interpreter exit can abort the
process ("terminate called without an active exception": CI saw a rank of tests/test_context_parallel.py's script
end so after it had printed that it matches), which torchrun reports as the whole run failing. The script's own
outcome decides the exit code: 0, its SystemExit code, or 1 with the traceback printed when it raised.

    python -m torch.distributed.run ... tests/helpers/exit_after.py SCRIPT [ARGS...]
"""

import os
import runpy
import sys
import traceback


def run(script: str) -> int:
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, and the rank fails
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    code = run(sys.argv[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
