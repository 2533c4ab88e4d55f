"""How often two steps claiming a Dagster pool of one slot at the same instant both get it,
on an instance stored in SQLite and on one stored in PostgreSQL (a server started on loopback
from Debian's package, as the tests start it).

Two processes, each with its own instance object on the same storage, meet at a barrier,
claim the slot for a run of their own, report, meet again and free it; repeated `--rounds`
times. A pool of one slot should have one winner a round.

    python benchmarks/pool_claim_race.py --rounds 30
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402

import dagster as dg  # noqa: E402

from tests.postgres import instance_yaml, running_server, unavailable_reason  # noqa: E402

POOL = "llm"


def _claimer(home: str, barrier: multiprocessing.Barrier, rounds: int, wins: multiprocessing.Queue) -> None:
    with dg.DagsterInstance.from_config(home) as instance:
        storage = instance.event_log_storage
        for round_ in range(rounds):
            run_id = uuid.uuid4().hex
            barrier.wait()
            wins.put((round_, storage.claim_concurrency_slot(POOL, run_id, "generate").is_claimed))
            barrier.wait()
            storage.free_concurrency_slots_for_run(run_id)


def race(postgres_url: str | None, rounds: int) -> dict[int, int]:
    """Rounds by their number of winners (0, 1 or 2)."""
    home = tempfile.mkdtemp(prefix="pool-race-")
    Path(home, "dagster.yaml").write_text(instance_yaml(postgres_url))
    with dg.DagsterInstance.from_config(home) as instance:
        instance.event_log_storage.set_concurrency_slots(POOL, 1)
    context = multiprocessing.get_context("spawn")
    barrier, wins = context.Barrier(2), context.Queue()
    claimers = [context.Process(target=_claimer, args=(home, barrier, rounds, wins)) for _ in range(2)]
    for claimer in claimers:
        claimer.start()
    per_round: dict[int, int] = dict.fromkeys(range(rounds), 0)
    for _ in range(2 * rounds):
        round_, claimed = wins.get(timeout=120)
        per_round[round_] += claimed
    for claimer in claimers:
        claimer.join()
    return {winners: sum(v == winners for v in per_round.values()) for winners in (0, 1, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"dagster {dg.__version__}: two claims of a one-slot pool at the same instant, {args.rounds} rounds")
    print(f"SQLite:     {race(None, args.rounds)}  (rounds by number of winners)")
    reason = unavailable_reason()
    if reason is not None:
        print(f"PostgreSQL: not measured, {reason}")
        return
    with running_server() as server:
        print(f"PostgreSQL: {race(server.create_database(), args.rounds)}")


if __name__ == "__main__":
    main()
