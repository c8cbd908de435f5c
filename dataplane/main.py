"""Start the data plane: rank 0 in this process, ranks 1..N-1 as child processes that die with it."""

import logging
import pathlib
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import torch

from common.errors import ConfigError
from common.model_info import ModelInfo
from common.process import die_with_parent
from common.transport import LinkConfig
from dataplane.distributed import (ParallelConfig, init_distributed, rendezvous_store,
                                   shutdown_distributed)
from dataplane.model_runner import ModelRunner, RunnerConfig
from dataplane.worker import Liveness, run_follower, run_rank0

log = logging.getLogger("splitserve.dataplane")


@dataclass(frozen=True)
class DataPlaneConfig:
    runner: RunnerConfig
    controlplane_address: str
    tp: int = 1
    rank: int | None = None  # None: this is the launcher (rank 0), it spawns the others
    parent_pid: int | None = None  # die with this process (set by whoever spawned us)
    dist_init_method: str | None = None
    link: LinkConfig = LinkConfig()
    liveness_file: pathlib.Path | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, not {self.tp}")
        if self.rank is not None and not 0 <= self.rank < self.tp:
            raise ValueError(f"rank must be in [0, {self.tp}), not {self.rank}")


def spawn_followers(config: DataPlaneConfig, argv: list[str], init_method: str
                    ) -> list[subprocess.Popen]:
    """Start ranks 1..tp-1 with the launcher's own command line plus their rank and where to
    meet rank 0; each dies with this process."""
    return [subprocess.Popen([sys.executable, "-m", "splitserve", "dataplane", *argv,
                              "--rank", str(rank), "--dist-init-method", init_method,
                              "--parent-pid", str(os.getpid())])
            for rank in range(1, config.tp)]


def cpu_threads(num_cores: int, tp: int) -> int:
    """Torch threads of each CPU rank: the cores but one (under `serve` the control plane's
    engine and gRPC front-end run beside the data plane; a data plane started alone gives one
    up too), shared by the ranks. OpenMP threads spin at their
    barriers, so one that loses its core stalls the others: on 2 cores, 128 streams of 500
    tokens (bench/controlplane_cpu.py) took 30 and 36 s (two runs) with 2 threads and 34 s with
    1, but with two other busy processes on the machine over 140 s with 2 threads and 35 s with
    1."""
    return max(1, (num_cores - 1) // tp)


def run(config: DataPlaneConfig, argv: list[str]) -> None:
    if config.parent_pid is not None:
        die_with_parent(config.parent_pid)
    if config.runner.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device (torch "
                          f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'})")
    children, store = [], None
    if config.tp > 1 and config.rank is None:
        init_method = config.dist_init_method
        if init_method is None:  # one host: a store whose port is ours before anyone hears of it
            store = rendezvous_store(config.tp)
            init_method = f"tcp://127.0.0.1:{store.port}"
        children = spawn_followers(config, argv, init_method)
        config = replace(config, rank=0, dist_init_method=init_method)
    rank = config.rank or 0
    if config.runner.device == "cpu":
        # the cores this process may run on (a container's cpuset), not the host's
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        torch.set_num_threads(cpu_threads(num_cores, config.tp))
    try:
        init_distributed(ParallelConfig(rank, config.tp, config.dist_init_method,
                                        config.runner.device), store=store)
        runner = ModelRunner.load(config.runner)
        log.info("rank %d/%d loaded %s (%s, %s attention)", rank, config.tp,
                 config.runner.model_dir, runner.dtype, runner.backend.name)
        liveness = Liveness(config.liveness_file)
        if rank == 0:
            run_rank0(runner, ModelInfo.from_dir(config.runner.model_dir),
                      config.controlplane_address, config.link, liveness)
        else:
            run_follower(runner, liveness)
    finally:
        shutdown_distributed()
        for child in children:
            child.kill()
