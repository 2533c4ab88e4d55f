"""The main loop of a tensor-parallel rank other than 0, in its own process: join the
group, load this rank's share, then make each call rank 0 repeats to it, until rank 0
says stop (None) or its connection closes."""

from multiprocessing.connection import Connection

from engine.distributed.communicator import TensorParallelGroup
from engine.distributed.process import receive_message, send_message
from engine.worker.worker import Worker
from engine.worker.worker_group import ForwardCommand, RankStart


class _RemoteWorker(Worker):
    """A Worker whose forward passes arrive as `ForwardCommand`s plus a broadcast."""

    def execute_remote(self, command: ForwardCommand) -> None:
        packed = self.group.broadcast(command.buffer(self.device))
        self.execute_model(command.unpack(packed))


def serve(conn: Connection, start: RankStart) -> None:
    send_message(conn, "started")
    group = TensorParallelGroup.connect(start.rank, start.size, start.store_port, start.backend,
                                        start.model_config.device)
    worker = _RemoteWorker(start.config, start.model_config, group)
    send_message(conn, "ready")
    while True:
        try:
            message = receive_message(conn)
        except EOFError:
            return  # rank 0 is gone
        if message is None:
            worker.release()
            return
        method, args = message
        getattr(worker, method)(*args)
