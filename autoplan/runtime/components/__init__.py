"""The training loop's parts (torchtitan's components/): data, optimizer, checkpoints, metrics, peak memory,
profiling, preemption and TensorBoard. They may use distributed/ (a rank's layout, collectives), never harness/."""
