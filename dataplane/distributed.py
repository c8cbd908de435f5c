"""Tensor-parallel process groups and the few collectives the model needs.

Rank 0 forwards every control message to the other ranks as raw protobuf bytes over a CPU (gloo)
group, so all ranks drive identical state from the same messages; the model's collectives run on
the device group (gloo on CPU, NCCL on CUDA).
"""

import datetime
import urllib.parse
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    rank: int
    world_size: int
    init_method: str | None  # tcp://host:port of rank 0; None when world_size == 1
    device: str  # "cpu" or "cuda"


_cpu_group: dist.ProcessGroup | None = None


def rendezvous_store(world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on a loopback port the OS picks: bound before any
    follower is told its port (`store.port`), so no other process can take the port in between,
    as one could a port merely seen free."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def init_distributed(config: ParallelConfig, timeout_s: float = 600.0,
                     store: dist.Store | None = None) -> None:
    """Join the TP group (a no-op for one rank), through `store` when rank 0 made one
    (rendezvous_store), else config.init_method: a tcp:// address becomes a store client (or
    its server on rank 0) in the same way, so every rank meets on the same keys (a store given
    to torch as such and one it builds from an init method are keyed apart). On CUDA, rank r
    uses the host's device r mod (devices visible): all ranks in one pod, or one rank per pod
    seeing one GPU."""
    global _cpu_group
    if config.device == "cuda":
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    if config.world_size == 1:
        return
    backend = "nccl" if config.device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    url = urllib.parse.urlparse(config.init_method or "")
    if store is None and url.scheme == "tcp":
        store = dist.TCPStore(url.hostname, url.port, config.world_size,
                              is_master=config.rank == 0, timeout=timeout)
    rendezvous = dict(store=store) if store is not None else dict(init_method=config.init_method)
    dist.init_process_group(backend, rank=config.rank, world_size=config.world_size,
                            timeout=timeout, **rendezvous)
    _cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD


def shutdown_distributed() -> None:
    global _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _cpu_group = None


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's `x` along the last dim on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.broadcast(x, src=0)
    return x


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0 passes the bytes, every rank gets them (over the CPU group)."""
    if tp_size() == 1:
        assert data is not None
        return data
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=_cpu_group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
           else torch.empty(int(size.item()), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, src=0, group=_cpu_group)
    return data if data is not None else buf.numpy().tobytes()


def min_over_ranks(value: int) -> int:
    """The smallest of each rank's `value` (over the CPU group)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    return int(t.item())
