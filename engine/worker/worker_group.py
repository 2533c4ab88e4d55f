"""Rank 0's handle on every rank of a tensor-parallel group: its own `Worker`, and the
others' in child processes, to which it repeats each call before making it itself.

A forward pass travels as a `ForwardCommand` over the ranks' connections (its host-side
metadata) plus one broadcast of its tensors, packed into one int64 tensor, through the
group's process group: on a GPU that broadcast is queued device work like the forward
pass, so asynchronous scheduling still never waits on it.

A failure in any rank fails the call with that rank's error (a rank that dies closes its
connections, and the collective rank 0 waits in raises); after a failure, or an
interrupt in the middle of a call, the ranks are out of step and are stopped: the
engine cannot be used again.
"""

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from engine.attention.layer import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.distributed.communicator import TensorParallelGroup
from engine.distributed.plan import ReplicaPlan
from engine.distributed.process import ChildProcess, WorkerError, stop_all
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRARange
from engine.worker.worker import ModelInputs, Worker

logger = logging.getLogger(__name__)


@dataclass
class ForwardCommand:
    """A forward pass as the other ranks receive it: everything but the tensors, which
    follow by broadcast (`pack_tensors`)."""

    num_tokens: int
    num_seqs: int
    table_width: int
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    block_copies: list[tuple[int, int]]
    lora_ranges: list[LoRARange]
    num_kept: int | None  # how many kept rows (None: all)

    @classmethod
    def of(cls, inputs: ModelInputs) -> "ForwardCommand":
        meta = inputs.attention
        kept = None if inputs.kept_rows is None else len(inputs.kept_rows)
        return cls(len(inputs.input_ids), len(meta.query_lens), meta.block_tables.shape[1], meta.query_lens,
                   meta.context_lens, meta.block_size, inputs.block_copies, inputs.lora_ranges, kept)

    @property
    def _sizes(self) -> list[int]:
        tokens, seqs = self.num_tokens, self.num_seqs
        return [tokens, tokens, tokens, seqs + 1, seqs, seqs * self.table_width, self.num_kept or 0]

    def unpack(self, packed: torch.Tensor) -> ModelInputs:
        """The inputs from the broadcast tensor."""
        ids, positions, slots, starts, lens, tables, kept = packed.split(self._sizes)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts.int(), seq_lens=lens.int(),
            block_tables=tables.int().view(self.num_seqs, self.table_width), positions=positions,
            query_lens=self.query_lens, context_lens=self.context_lens, block_size=self.block_size)
        return ModelInputs(ids, meta, self.block_copies, self.lora_ranges, None if self.num_kept is None else kept)

    def buffer(self, device: torch.device) -> torch.Tensor:
        """The tensor the broadcast lands in."""
        return torch.empty(sum(self._sizes), dtype=torch.long, device=device)


def pack_tensors(inputs: ModelInputs) -> torch.Tensor:
    """The forward pass's tensors as one int64 tensor, in `ForwardCommand.unpack`'s order."""
    meta = inputs.attention
    parts = [inputs.input_ids, meta.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
             meta.block_tables.flatten(), *([] if inputs.kept_rows is None else [inputs.kept_rows])]
    return torch.cat([part.long() for part in parts])


@dataclass
class RankStart:
    """What a rank's process needs to join the group and load its share."""

    rank: int
    size: int
    store_port: int
    backend: str
    config: EngineConfig
    model_config: ModelConfig


class WorkerGroup:
    """Every rank's `Worker`: rank 0's here, the others in child processes."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, replica: ReplicaPlan,
                 draft_config: ModelConfig | None = None) -> None:
        """Starts the other ranks, joins them and loads rank 0's share with theirs, and on
        rank 0 the draft model of `draft_config` where given.

        Raises:
            WorkerError: a rank failed to start or load (the message is that rank's error).
        """
        self.remote: list[ChildProcess] = []
        self._failed: str | None = None
        placements, backend = replica.placements, replica.backend
        size = len(placements)
        if size == 1:
            self.local = Worker(config, model_config, TensorParallelGroup(), draft_config)
            return
        store = TensorParallelGroup.open_store(size)
        try:
            for p in placements[1:]:
                start = RankStart(p.rank, size, store.port, backend, config, replace(model_config, device=p.device))
                self.remote.append(ChildProcess(f"tensor-parallel rank {p.rank}", "engine.worker.tp_worker:serve",
                                                start, threads=config.num_threads, cores=list(p.cores or []) or None))
            for child in self.remote:
                child.recv()  # imported and about to join: a rank that cannot start fails here, not in a wait
            group = TensorParallelGroup.connect(0, size, store, backend, placements[0].device)
            self.local = Worker(config, model_config, group, draft_config)
            for child in self.remote:
                child.recv()
        except BaseException as exc:
            self._fail(exc)
        logger.info("Tensor parallel over %d ranks (%s): %s; %d query and %d key/value heads per rank", size,
                    backend, "; ".join(p.describe() for p in placements), self.local.kv_cache.layers[0].num_heads,
                    self.local.kv_cache.layers[0].num_kv_heads)

    @property
    def pids(self) -> list[int]:
        """The process ids of the other ranks."""
        return [child.pid for child in self.remote]

    def execute_model(self, inputs: ModelInputs) -> torch.Tensor:
        """Runs the forward pass on every rank; rank 0's hidden states."""
        if not self.remote:
            return self.local.execute_model(inputs)
        with self._failing_as_worker_error():
            self._send("execute_remote", ForwardCommand.of(inputs))
            self.local.group.broadcast(pack_tensors(inputs))
            return self.local.execute_model(inputs)

    def logits(self, rows: torch.Tensor, host_rows: list[int]) -> torch.Tensor:
        """Logits [rows, vocab] of these rows of the last forward pass (`rows` on the
        device, `host_rows` the same as a list for the other ranks)."""
        if not self.remote:
            return self.local.logits(rows)
        with self._failing_as_worker_error():
            self._send("logits", host_rows)
            return self.local.logits(rows)

    def activate_adapters(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Puts a step's adapters into slots on every rank; their slot by lora_int_id."""
        if self.remote:
            with self._failing_as_worker_error():
                self._send("activate_adapters", requests)
        return self.local.activate_adapters(requests)

    def release(self) -> None:
        """Frees rank 0's share and stops the other ranks."""
        stop_all(self.remote)
        self.remote = []
        self.local.release()

    def _send(self, method: str, *args: object) -> None:
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel ranks were stopped after an earlier failure ({self._failed}); "
                              f"create a new LLM")
        for child in self.remote:
            child.send((method, args))

    @contextlib.contextmanager
    def _failing_as_worker_error(self) -> Iterator[None]:
        """Turns any failure inside a call across the ranks into `_fail`."""
        try:
            yield
        except BaseException as exc:
            if self._failed is None:
                self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Stops every rank after `exc` and raises the failing rank's error (or `exc`). An
        interrupt does not wait for the ranks' errors: closing rank 0's connections ends
        the collectives they wait in, and they exit."""
        if not isinstance(exc, Exception):  # an interrupt
            self._failed = type(exc).__name__
            self._stop()
            raise exc
        reason = next((why for child in self.remote if (why := child.failure()) is not None), None)
        self._stop()
        if reason is None and (isinstance(exc, WorkerError) or not isinstance(exc, RuntimeError)):
            self._failed = f"{type(exc).__name__}: {exc}"
            raise exc  # rank 0's own error (a collective's failure is a RuntimeError)
        self._failed = reason or f"the tensor-parallel ranks lost their connection ({exc})"
        raise WorkerError(self._failed) from exc

    def _stop(self) -> None:
        if hasattr(self, "local"):
            self.local.group.close()
        stop_all(self.remote)
