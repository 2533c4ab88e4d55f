"""Data parallelism: replicas 1.. of the model in child processes, each a whole engine
(with tensor-parallel ranks of its own when asked), beside the engine of the `LLM` that
owns them, which is replica 0.

A call's prompts are dealt out by estimated work (`deal`); each replica runs its share
with continuous batching and sends each request's output as it finishes, with its
counters and unfinished work about twice a second, so that `generate_as_completed`
merges the streams as they come and a progress estimate sees every replica. A replica
with nothing left waits on its connection and takes no CPU. Requests carry their own
seed, so a seeded request gives the same tokens on whichever replica runs it; replica
d's engine seed (for requests without one) is the LLM's seed + d.
"""

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait

from engine.config import EngineConfig
from engine.distributed.plan import ReplicaPlan
from engine.distributed.process import ChildProcess, WorkerError, receive_message, send_message, stop_all
from engine.entrypoints.inputs import Request
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput, UnfinishedOutput

logger = logging.getLogger(__name__)

# How often a busy replica reports its counters and unfinished work without a finished request.
_REPORT_INTERVAL_S = 0.5
# A generated token counts this many prompt tokens of work: decode runs one token per
# sequence per step, where a prompt's tokens go through in one or a few steps.
_DECODE_WEIGHT = 4


@dataclass
class ReplicaStart:
    """What a replica's process needs to build its engine."""

    config: EngineConfig
    replica: ReplicaPlan


@dataclass
class Assignment:
    """Requests for a replica, each with its index in the call, under call number `call`."""

    call: int
    requests: list[tuple[int, str, Request]]


@dataclass
class ReplicaReport:
    """What a replica sends while it works: requests finished since its last report (by
    index in the call), its counters, its unfinished work, and whether the call's share
    is done."""

    call: int
    finished: list[tuple[int, RequestOutput]] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    unfinished: list[UnfinishedOutput] = field(default_factory=list)
    done: bool = False


def estimated_work(request: Request, max_model_len: int) -> int:
    """A request's work in prompt-token units: its prompt, plus every completion's most
    tokens weighted by `_DECODE_WEIGHT`."""
    params = request.sampling_params
    prompt = len(request.prompt_token_ids)
    return prompt + _DECODE_WEIGHT * params.n * params.max_output_tokens(prompt, max_model_len)


def deal(requests: list[Request], num_replicas: int, max_model_len: int) -> list[list[int]]:
    """The indices of the requests each replica runs: largest first to the replica with
    the least work so far (ties to the lowest replica), each share in input order."""
    loads = [0] * num_replicas
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    work = [estimated_work(r, max_model_len) for r in requests]
    for index in sorted(range(len(requests)), key=lambda i: -work[i]):
        replica = min(range(num_replicas), key=lambda d: (loads[d], d))
        loads[replica] += work[index]
        shares[replica].append(index)
    return [sorted(share) for share in shares]


class ReplicaPool:
    """Replicas 1.. of an LLM's model, in child processes."""

    def __init__(self, config: EngineConfig, replicas: list[ReplicaPlan]) -> None:
        """Starts the replicas' processes; `wait_ready` waits until their engines are loaded."""
        threads = config.num_threads or config.default_threads_per_rank()
        self.replicas: list[ChildProcess] = []
        self._calls = itertools.count(1)
        self._broken: str | None = None
        self.stats = [EngineStats() for _ in replicas]
        self.unfinished: list[list[UnfinishedOutput]] = [[] for _ in replicas]
        for plan in replicas:
            rank0 = plan.placements[0]
            start = ReplicaStart(replace(config, seed=config.seed + rank0.replica, num_threads=threads), plan)
            self.replicas.append(ChildProcess(f"data-parallel replica {rank0.replica}",
                                              "engine.entrypoints.data_parallel:serve", start, threads=threads,
                                              cores=list(rank0.cores or []) or None))

    @property
    def pids(self) -> list[int]:
        """The replicas' process ids (their own tensor-parallel ranks not included)."""
        return [replica.pid for replica in self.replicas]

    def wait_ready(self) -> None:
        """Waits until every replica has loaded its model.

        Raises:
            WorkerError: a replica failed to start (its error); every replica is stopped.
        """
        try:
            for replica in self.replicas:
                replica.recv()
        except BaseException:
            self.close()
            raise

    def total_stats(self) -> EngineStats:
        """The replicas' counters summed, as last reported."""
        return sum(self.stats, EngineStats())

    def all_unfinished(self) -> list[UnfinishedOutput]:
        """The replicas' unfinished work, as last reported."""
        return [u for unfinished in list(self.unfinished) for u in unfinished]

    def start_call(self, shares: list[list[tuple[int, str, Request]]]) -> int:
        """Sends each replica its share of a call; returns the call's number."""
        self._check()
        call = next(self._calls)
        for position, share in enumerate(shares):
            self._send(position, Assignment(call, share))
        return call

    def reports(self, call: int, timeout: float | None) -> Iterator[tuple[int, ReplicaReport]]:
        """Reports of `call` that arrive within `timeout` seconds (None: until one does),
        with the replica's position; reports of earlier calls are dropped."""
        conns = {replica.conn: i for i, replica in enumerate(self.replicas)}
        for conn in wait(list(conns), timeout):
            position = conns[conn]
            report = self._receive(position)
            if report.call == call:
                yield position, report

    def abort(self, call: int, busy: set[int]) -> None:
        """Stops call `call` on the replicas still working on it (`busy`), and waits
        until each has dropped its requests."""
        for position in busy:
            try:
                self._send(position, ("abort", call))
                while not ((report := self._receive(position)).done and report.call == call):
                    pass
            except WorkerError:
                continue  # that replica is gone; the call fails with its error

    def reset_prefix_cache(self) -> bool:
        """Forgets every replica's cached prefixes; False if any had requests running."""
        self._check()
        for position in range(len(self.replicas)):
            self._send(position, ("reset_prefix_cache", None))
        return all([self._reply(position) for position in range(len(self.replicas))])

    def close(self) -> None:
        """Stops every replica."""
        stop_all(self.replicas)
        self.replicas = []

    def _send(self, position: int, message: object) -> None:
        try:
            self.replicas[position].send(message)
        except WorkerError as exc:
            self._broken = str(exc)
            raise

    def _receive(self, position: int) -> "ReplicaReport | object":
        """The replica's next message; a report's counters and unfinished work are kept."""
        try:
            message = self.replicas[position].recv()
        except WorkerError as exc:
            self._broken = str(exc)
            raise
        if isinstance(message, ReplicaReport):
            self.stats[position] = message.stats
            self.unfinished[position] = message.unfinished
        return message

    def _reply(self, position: int) -> object:
        """The replica's answer to a request, past any report of an aborted call."""
        while isinstance(message := self._receive(position), ReplicaReport):
            pass
        return message

    def _check(self) -> None:
        if self._broken is not None:
            raise WorkerError(f"a data-parallel replica failed earlier ({self._broken.splitlines()[0]}); "
                              f"create a new LLM")


# -- in the replica's process --------------------------------------------------------------


def serve(conn: Connection, start: ReplicaStart) -> None:
    """A replica's main loop: build the engine, then run each call's share, reporting as
    requests finish, until the parent says stop (None) or its connection closes."""
    engine = LLMEngine(start.config, start.replica)
    send_message(conn, "ready")
    while True:
        try:
            message = receive_message(conn)
        except EOFError:
            return  # the parent is gone
        if message is None:
            engine.release()
            return
        if isinstance(message, Assignment):
            _run_share(conn, engine, message)
        elif message[0] == "reset_prefix_cache":
            send_message(conn, engine.block_manager.reset_prefix_cache())
        elif message[0] == "abort":  # the share had finished before the abort arrived
            send_message(conn, ReplicaReport(message[1], stats=engine.stats, done=True))


def _run_share(conn: Connection, engine: LLMEngine, assignment: Assignment) -> None:
    index_of = {}
    for index, request_id, request in assignment.requests:
        request.submit(engine, request_id)
        index_of[request_id] = index
    report = ReplicaReport(assignment.call)
    last_report = time.monotonic()
    while engine.has_unfinished_requests():
        report.finished += [(index_of[seq.request_id], engine.output(seq)) for seq in engine.step_requests()]
        if conn.poll():  # only an abort can arrive while a share runs
            receive_message(conn)
            engine.abort_all()
            break
        if report.finished or time.monotonic() - last_report > _REPORT_INTERVAL_S:
            report.stats, report.unfinished = engine.stats, engine.unfinished_outputs()
            send_message(conn, report)
            report, last_report = ReplicaReport(assignment.call), time.monotonic()
    report.stats, report.done = engine.stats, True
    send_message(conn, report)
