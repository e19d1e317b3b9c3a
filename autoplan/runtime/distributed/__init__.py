"""Applying a plan to a model (torchtitan's distributed/): the device mesh and a rank's place in it, the layout
(ParallelConfig: one autoplan.layout.Parallelism and the modules it names), the pipeline split and its steps, data/tensor/context/expert parallelism, FSDP2, recompute,
compile, the initial weights, a batch's division, and the gradients' norm and full tensors across the layout.
Imports nothing else of autoplan.runtime: components/, harness/ and runtime's own modules build on it."""
