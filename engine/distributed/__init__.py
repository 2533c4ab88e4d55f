"""Low-level plumbing of running over several processes: the collectives layers call
(`communicator`), where each process goes (`plan`) and how processes are started and stopped
(`process`, `child`). The rank fan-out lives in `engine.worker`, whole-engine replicas in
`engine.entrypoints.data_parallel`."""
