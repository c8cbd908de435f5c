"""What every benchmark's JSON says about the run besides its figures."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def commit() -> str:
    """SPLITSERVE_COMMIT when set (the device machine gets the working tree, and its .git may
    be missing or stale: bench/gpu_run.sh), else git's short hash of this checkout."""
    return os.environ.get("SPLITSERVE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
        text=True).stdout.strip() or "unknown"
