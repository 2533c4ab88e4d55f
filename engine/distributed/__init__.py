"""Running the engine over several processes: tensor-parallel ranks of one model
(`communicator`, `tp_worker`), data-parallel replicas (`data_parallel`), where each
process goes (`plan`) and how the processes are started and stopped (`process`)."""
