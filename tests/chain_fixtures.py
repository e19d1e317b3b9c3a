"""Hand-built profiles and clusters for the cost-model and solver tests (no torch).

gpt_profile() mirrors what torch.export gives for examples/gpt.py: the same op names, module stacks
(ModuleList absent, block residual adds owned by the block), data-flow edges and a tied LM head;
FLOPs follow the matmul rule (2mkn, backward twice forward), bytes follow the shapes, and times
follow a simple device (FLOP/s, bytes/s, launch overhead) so that tests can predict them.
"""

from __future__ import annotations

from autoplan.hardware.types import Cluster, Gpu, HardwareProfile, Link
from autoplan.profile.types import ModelProfile, OpProfile

GIB = 2**30
FLOPS_PER_S = 1e12
"""Speed of the pretend device the synthetic times assume."""
BYTES_PER_S = 1e11
LAUNCH_S = 5e-6


class _Builder:
    def __init__(self, batch: int, element: int) -> None:
        self.ops: list[OpProfile] = []
        self.batch, self.element = batch, element

    def add(self, node, op, stack, inputs=(), params=(), flops=0.0, out_elems=0, in_elems=0, saved_elems=0,
            param_elems=0, out_bytes=None, saved_bytes=None):
        e = self.element
        out_b = out_elems * e if out_bytes is None else out_bytes
        in_b = (in_elems + param_elems) * e
        time_fwd = flops / FLOPS_PER_S + (in_b + out_b) / BYTES_PER_S + LAUNCH_S
        time_bwd = 2 * flops / FLOPS_PER_S + 2 * (in_b + out_b) / BYTES_PER_S + 2 * LAUNCH_S
        self.ops.append(OpProfile(
            node=node, op=op, module=stack[-1] if stack else "", module_stack=tuple(stack),
            inputs=tuple(inputs), params=tuple(params), input_shapes=(), dtype="float32",
            flops_fwd=flops, flops_bwd=2 * flops, input_bytes=in_b, output_bytes=out_b,
            saved_bytes=saved_elems * e if saved_bytes is None else saved_bytes,
            time_fwd_s=time_fwd, time_bwd_s=time_bwd, source="measured"))
        return node


def gpt_profile(n_layer: int = 4, n_embd: int = 128, vocab: int = 512, seq: int = 64, batch: int = 2,
                tied: bool = True, device: str = "cpu") -> ModelProfile:
    b = _Builder(batch, 4)
    t, h, v = batch * seq, n_embd, vocab
    params: dict[str, int] = {"wte.weight": v * h, "wpe.weight": seq * h}
    pos = b.add("arange", "aten.arange.default", (), out_bytes=seq * 8)
    tok = b.add("embedding", "aten.embedding.default", ("wte",), params=("wte.weight",), out_elems=t * h,
                saved_bytes=t * 8)
    pe = b.add("embedding_1", "aten.embedding.default", ("wpe",), inputs=(pos,), params=("wpe.weight",),
               out_elems=seq * h, saved_bytes=seq * 8)
    x = b.add("add", "aten.add.Tensor", (), inputs=(tok, pe), out_elems=t * h, in_elems=2 * t * h)
    for i in range(n_layer):
        blk = f"blocks.{i}"
        for name, n in (("ln_1", h), ("ln_2", h)):
            params[f"{blk}.{name}.weight"] = params[f"{blk}.{name}.bias"] = n
        for name, fan_in, fan_out in (("attn.qkv", h, 3 * h), ("attn.proj", h, h), ("mlp.fc", h, 4 * h),
                                      ("mlp.proj", 4 * h, h)):
            params[f"{blk}.{name}.weight"] = fan_in * fan_out
            params[f"{blk}.{name}.bias"] = fan_out

        def linear(node, name, inp, fan_in, fan_out, stack):
            return b.add(node, "aten.linear.default", stack, inputs=(inp,),
                         params=(f"{blk}.{name}.weight", f"{blk}.{name}.bias"), flops=2 * t * fan_in * fan_out,
                         out_elems=t * fan_out, in_elems=t * fan_in, saved_elems=t * fan_in,
                         param_elems=fan_in * fan_out + fan_out)

        def norm(node, name, inp):
            return b.add(node, "aten.layer_norm.default", (blk, f"{blk}.{name}"), inputs=(inp,),
                         params=(f"{blk}.{name}.weight", f"{blk}.{name}.bias"), flops=5 * t * h,
                         out_elems=t * h, in_elems=t * h, saved_elems=t * h + 2 * t, param_elems=2 * h)

        n1 = norm(f"ln1_{i}", "ln_1", x)
        qkv = linear(f"qkv_{i}", "attn.qkv", n1, h, 3 * h, (blk, f"{blk}.attn", f"{blk}.attn.qkv"))
        att = b.add(f"sdpa_{i}", "aten.scaled_dot_product_attention.default", (blk, f"{blk}.attn"), inputs=(qkv,),
                    flops=4 * batch * seq * seq * h, out_elems=t * h, in_elems=3 * t * h, saved_elems=4 * t * h)
        proj = linear(f"attn_proj_{i}", "attn.proj", att, h, h, (blk, f"{blk}.attn", f"{blk}.attn.proj"))
        x1 = b.add(f"res1_{i}", "aten.add.Tensor", (blk,), inputs=(x, proj), out_elems=t * h, in_elems=2 * t * h)
        n2 = norm(f"ln2_{i}", "ln_2", x1)
        fc = linear(f"fc_{i}", "mlp.fc", n2, h, 4 * h, (blk, f"{blk}.mlp", f"{blk}.mlp.fc"))
        act = b.add(f"gelu_{i}", "aten.gelu.default", (blk, f"{blk}.mlp"), inputs=(fc,), flops=8 * t * 4 * h,
                    out_elems=4 * t * h, in_elems=4 * t * h, saved_elems=4 * t * h)
        mp = linear(f"mlp_proj_{i}", "mlp.proj", act, 4 * h, h, (blk, f"{blk}.mlp", f"{blk}.mlp.proj"))
        x = b.add(f"res2_{i}", "aten.add.Tensor", (blk,), inputs=(x1, mp), out_elems=t * h, in_elems=2 * t * h)
    params["ln_f.weight"] = params["ln_f.bias"] = h
    nf = b.add("ln_f", "aten.layer_norm.default", ("ln_f",), inputs=(x,), params=("ln_f.weight", "ln_f.bias"),
               flops=5 * t * h, out_elems=t * h, in_elems=t * h, saved_elems=t * h + 2 * t, param_elems=2 * h)
    head = "wte.weight" if tied else "lm_head.weight"
    if not tied:
        params[head] = v * h
    logits = b.add("lm_head", "aten.linear.default", ("lm_head",), inputs=(nf,), params=(head,),
                   flops=2 * t * h * v, out_elems=t * v, in_elems=t * h, saved_elems=t * h, param_elems=v * h)
    return ModelProfile(model=f"synthetic gpt l={n_layer} h={h}", batch_size=batch, dtype="float32",
                        device=device, ops=tuple(b.ops), parameters=params, tokens_per_sample=seq,
                        output_nodes=(logits,))


def gpt_param_formula(n_layer: int, h: int, vocab: int, seq: int) -> float:
    """Narayanan et al. SC21 Eq. 2 (tied head): 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
    return 12 * n_layer * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * n_layer * h))


def make_gpu(memory_gib: float = 80.0, name: str = "testgpu") -> Gpu:
    return Gpu(name=name, peak_flops={"fp32": 20e12, "bf16": 320e12}, memory_bytes=memory_gib * GIB,
               memory_bandwidth_bytes_per_s=2e12, matmul_efficiency=0.7, memory_efficiency=0.8,
               kernel_overhead_s=LAUNCH_S, memory_reserved_bytes=0.0, source="test")


def cluster(num_gpus: int = 8, memory_gib: float = 80.0, gpus_per_node: int = 8,
            intra_bw: float = 200e9, inter_bw: float = 20e9, latency_s: float = 1e-5) -> Cluster:
    hw = HardwareProfile(
        gpu=make_gpu(memory_gib),
        intra_node=Link("nvlink", intra_bw, latency_s, "test"),
        inter_node=Link("infiniband", inter_bw, 2 * latency_s, "test"),
        default_gpus_per_node=gpus_per_node,
    )
    return Cluster(hardware=hw, num_gpus=num_gpus, gpus_per_node=gpus_per_node)
