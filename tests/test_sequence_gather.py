"""Sequence parallelism's all-gather as Megatron-LM runs it (runtime/distributed/sequence_gather.py), on 2 gloo ranks:
the column-parallel Linears that read one tensor (q, k, v; gate and up) share one all-gather, autograd keeps
the shard instead of the gathered tensor (Korthikanti et al. 2022, Eq. 4 counts it at 1/tp), and outputs and
gradients still equal one device's. The bytes kept for backward are counted with runtime.memory's live-storage
tracker: with the shard kept they drop by the two gathered inputs' (1 - 1/tp) share against torch's
ColwiseParallel gathering per Linear, closed form below."""

import textwrap

import pytest

from helpers.ranks import assert_every_rank_matches

pytestmark = pytest.mark.slow  # one 2-process torchrun launch

SCRIPT = textwrap.dedent('''
    import copy, gc, os
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from autoplan.runtime.components import memory
    import importlib
    tpm = importlib.import_module("autoplan.runtime.distributed.tensor_parallel")

    B, S, H = 2, 16, 32

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
            self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
            self.gate, self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

        def forward(self, x):
            h = self.norm1(x)
            x = x + self.o(torch.tanh(self.q(h)) * self.k(h) + self.v(h))
            h = self.norm2(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    PLAN = {f"blocks.{i}.{n}": s for i in range(2) for n, s in
            [("q", "colwise"), ("k", "colwise"), ("v", "colwise"), ("o", "rowwise"),
             ("gate", "colwise"), ("up", "colwise"), ("down", "rowwise")]}

    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(0)
    reference = Model()
    x = torch.randn(B, S, H)
    (reference(x) ** 2).sum().backward()

    def sharded(keep_shard):
        model = tpm.tensor_parallel(copy.deepcopy(reference), mesh, PLAN, sp=True)
        if not keep_shard:  # torch's ColwiseParallel alone: each Linear gathers and keeps what it gathered
            for module in model.modules():
                for hooks in (module._forward_pre_hooks, module._forward_hooks):
                    for key, hook in list(hooks.items()):
                        if getattr(hook, "__self__", None).__class__.__name__ == "SequenceGather":
                            del hooks[key]
        model.zero_grad(set_to_none=True)
        return model

    def kept_bytes(model):
        """Live bytes after forward (what backward will read) minus before it, once every rank's collectives
        are done (gloo's threads may hold a collective's buffers for a moment after it returns)."""
        live = memory._LiveStorages(torch.device("cpu"))
        live.start()
        before = live.live_bytes
        out = model(x)
        dist.barrier()
        gc.collect()
        kept = live.live_bytes - before
        live.stop()
        return out, kept

    gathers = {}
    kept = {}
    for keep_shard in (True, False):
        model = sharded(keep_shard)
        with CommDebugMode() as comm:
            with tpm.tensor_parallel_context(True):
                out, kept[keep_shard] = kept_bytes(model)
        gathers[keep_shard] = sum(n for op, n in comm.get_comm_counts().items() if "all_gather" in str(op))
        with tpm.tensor_parallel_context(True):
            (out ** 2).sum().backward()
        tpm.reduce_partial_gradients(model)
        torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(full, q.grad, rtol=1e-4, atol=1e-5, msg=name)

    # the input enters whole (replicated), so the first attention needs no gather; after it, every region's
    # input is a sequence shard: attention and MLP each gather once (q, k, v share one; gate, up share one)
    # instead of once per Linear (3 + 2); the output is gathered once more (outputs_to_plain)
    assert gathers[True] == 1 + 2 + 1, gathers
    assert gathers[False] == 2 + 5 + 1, gathers
    # kept for backward: each gathered input is 4 B S H bytes (fp32) whole; gathering per Linear keeps each
    # Linear's own copy, the shared gather keeps one shard (1/tp) per input: the first MLP and the second block
    full = 4 * B * S * H
    saved = kept[False] - kept[True]
    assert saved == (2 * full - full / tp) + (5 * full - 2 * full / tp), (kept, saved)
    print(f"rank {rank} matches: gathers {gathers}, kept {kept}")
    dist.destroy_process_group()
''')


def test_column_linears_share_one_gather_and_keep_the_shard_for_backward(tmp_path):
    script = tmp_path / "sequence_gather.py"
    script.write_text(SCRIPT)
    assert_every_rank_matches(script, 2)
