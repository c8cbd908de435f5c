"""Process helpers shared by the launchers."""

import ctypes
import os
import signal
import sys


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a child: get SIGKILL when the parent dies (Linux), so no data-plane
    rank outlives the process that started it. Exits at once if the parent is already gone.

    Set in the child rather than in a pre-exec hook, so the parent never has to fork() with
    gRPC's threads running."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)
