"""The shared torchrun launch of tests/helpers/batch.py and verify_many.run_batch: a launch whose rank dies
outside every job's Python code (a native abort: no traceback, torchrun stops the other ranks) reruns the jobs it
did not finish in one fresh launch and says so; a job that aborts every time is reported with how its rank ended."""

import textwrap

import pytest

from autoplan.errors import UserError
from helpers.verify_many import BatchJob, run_batch

pytestmark = pytest.mark.slow  # torchrun launches

PROGRAM = textwrap.dedent('''
    """A job: each rank writes its file beside the argument's; with --abort-once (or --abort-always) rank 1
    aborts the process natively the first time (every time), as a C++ exception escaping a gloo thread would."""
    import os
    import sys
    from pathlib import Path

    import torch.distributed as dist


    def main(argv):
        out, mode = Path(argv[0]), argv[1]
        once = out.with_suffix(".aborted")
        aborting = mode == "--abort-always" or (mode == "--abort-once" and not once.exists())
        if aborting and dist.get_rank() == 1:
            once.touch()
            sys.stderr.flush()
            os.abort()
        dist.barrier()
        out.with_suffix(f".rank{dist.get_rank()}").write_text(str(dist.get_world_size()))
''')


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(PROGRAM)
    return path


def test_a_rank_aborted_natively_reruns_the_unfinished_jobs_in_a_fresh_launch(tmp_path, program):
    jobs = [BatchJob(tmp_path, (str(tmp_path / "first.txt"), "--fine"), 2, program=program),
            BatchJob(tmp_path, (str(tmp_path / "second.txt"), "--abort-once"), 2, program=program),
            BatchJob(tmp_path, (str(tmp_path / "third.txt"), "--fine"), 2, program=program, same_ranks_as=1)]
    with pytest.warns(UserWarning, match=r"(?s)rank 1 ended by signal 6 \(SIGABRT\).*launch 1 of 2.*rerun in a "
                                         r"fresh launch: \S+ \S+second.txt --abort-once\.\.\. on 2 ranks, "
                                         r"\S+ \S+third.txt"):
        errors = run_batch(jobs, nproc=2, timeout_s=300, job_timeout_s=60)
    assert errors == ["", "", ""]
    assert (tmp_path / "second.aborted").exists()
    written = sorted(p.name for p in tmp_path.glob("*.rank*"))
    assert written == [f"{job}.rank{rank}" for job in ("first", "second", "third") for rank in (0, 1)]


def test_a_job_that_aborts_every_time_fails_with_how_its_rank_ended(tmp_path, program):
    jobs = [BatchJob(tmp_path, (str(tmp_path / "out.txt"), "--abort-always"), 2, program=program)]
    with pytest.warns(UserWarning, match="launch 1 of 2"), \
            pytest.raises(UserError, match=r"failed \(exit code 1\):\nfirst exception: rank 1 ended by signal 6 "
                                            r"\(SIGABRT\), without a Python traceback"):
        run_batch(jobs, nproc=2, timeout_s=300, job_timeout_s=60)
    assert not list(tmp_path.glob("out.rank*"))
