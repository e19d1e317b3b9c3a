"""Errors a user can fix. The CLI prints their message as one line and exits 2."""


class UserError(Exception):
    """Bad input or an infeasible request; the message says what is wrong and, where it helps, the
    arithmetic and a way out ("needs 93.1 GiB per GPU, has 80 GiB: try --gpus 128")."""


class Infeasible(UserError):
    """No layout fits. The message names the smallest memory per GPU and GPU count that would."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds like Ctrl-C (cleaning up partial output), exit code 143."""
