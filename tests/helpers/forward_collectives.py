"""Run under torchrun: for each (output folder, model spec) given as arguments, apply the folder's plan to the model
with autoplan.parallelize and record the collectives each module's forward issues (torch's CommDebugMode); rank 0
writes them as JSON to the path given first: {folder: {module: {collective: count}}}."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import autoplan
from autoplan.contract import call_model, load_source
from autoplan.runtime.distributed.tensor_parallel import tensor_parallel_context


def forward_collectives(folder: str, spec: str) -> dict[str, dict[str, int]]:
    source = load_source(spec)
    torch.manual_seed(0)
    model = source.build_model()
    mesh = autoplan.init_mesh(folder, torch.device("cpu"))
    inputs, _ = source.example_batch(8)
    parallel = autoplan.parallelize(model, folder, mesh, device=torch.device("cpu"))
    comm = CommDebugMode()
    found: dict[str, dict[str, int]] = {}

    def counts() -> dict[str, int]:
        return {str(op).rpartition(".")[2]: n for op, n in comm.get_comm_counts().items()}

    def before(module, args):
        module._collectives_before = counts()

    def after(name: str):
        def hook(module, args, output):
            now, then = counts(), module._collectives_before
            found[name] = {op: n - then.get(op, 0) for op, n in now.items() if n - then.get(op, 0)}
        return hook

    for name, module in parallel.model.named_modules():
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after(name))
    with tensor_parallel_context(True), torch.no_grad(), comm:
        call_model(parallel.model, inputs)
    return found


def main() -> None:
    out, pairs = Path(sys.argv[1]), sys.argv[2:]
    found = {folder: forward_collectives(folder, spec) for folder, spec in zip(pairs[::2], pairs[1::2])}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
