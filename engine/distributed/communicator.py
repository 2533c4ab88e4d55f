"""A tensor-parallel group: this rank's place in it, and the collectives the sharded
layers need (all-reduce, broadcast from rank 0, gather to rank 0).

A group is a process group of its own (gloo or NCCL), made from a TCP store on the
loopback that rank 0 opens; torch.distributed's process-wide default group is never
used, so one process can hold several engines.
"""

import datetime

import torch
import torch.distributed as dist

# How long one collective, or the start-up rendezvous, may wait for the other ranks.
_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallelGroup:
    """Rank `rank` of `size`; with size 1 every collective is the identity."""

    def __init__(self, rank: int = 0, size: int = 1, process_group: "dist.ProcessGroup | None" = None,
                 backend: str = "none") -> None:
        self.rank = rank
        self.size = size
        self.backend = backend
        self._pg = process_group

    @staticmethod
    def open_store(size: int) -> dist.TCPStore:
        """Rank 0's rendezvous store on a free loopback port (its `port` goes to the others)."""
        return dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=_TIMEOUT, wait_for_workers=False)

    @classmethod
    def connect(cls, rank: int, size: int, store: dist.Store | int, backend: str,
                device: torch.device) -> "TensorParallelGroup":
        """Joins the group: rank 0 passes its store, the others the store's port."""
        if isinstance(store, int):
            store = dist.TCPStore("127.0.0.1", store, size, is_master=False, timeout=_TIMEOUT)
        if backend == "nccl":
            torch.cuda.set_device(device)
            process_group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            process_group = dist.ProcessGroupGloo(store, rank, size, _TIMEOUT)
        return cls(rank, size, process_group, backend)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns it."""
        if self.size > 1:
            self._pg.allreduce([x]).wait()
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self._collective_device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([tensor], options).wait()
        return int(tensor.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x`, copied into every other rank's `x` (same shape and dtype)."""
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._pg.broadcast([x], options).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` [rows, n] side by side ([rows, size * n]) on rank 0; None on the
        others. gloo gathers CPU tensors only: on a GPU over gloo each rank's part goes
        into a zero tensor of the whole width and the parts are summed instead."""
        if self.size == 1:
            return x
        if self.backend == "gloo" and x.is_cuda:
            whole = x.new_zeros(x.shape[0], self.size, x.shape[1])
            whole[:, self.rank] = x
            self._pg.allreduce([whole]).wait()
            return whole.view(x.shape[0], -1) if self.rank == 0 else None
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self._pg.gather(parts, [x], options).wait()
        return torch.cat(parts[0], dim=-1) if self.rank == 0 else None

    @property
    def _collective_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Drops the process group (its connections close)."""
        self._pg = None
