"""The model as a chain (torch-free): the ordered modules pipeline stages are cut from, the
tensor-parallel pairs found in the graph, and the op-kind table. What cost/ and solve/ share.

- ops.py              the op-kind table (which ATen ops are views, pointwise, attention, gemms ...)
- modules.py          ModuleChain: a profile's ops coarsened into an ordered chain of modules
- tensor_parallel.py  Megatron-style column/row pairs and vocabulary-parallel heads found in the graph
- batch_statistics.py modules that normalize over the batch (BatchNorm): cross-sample state
"""
