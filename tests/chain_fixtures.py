"""Hand-built profiles and clusters for the cost-model and solver tests (no torch).

gpt_profile() reproduces what capture + profile give for examples/gpt.py, op for op: the same ATen
ops, module stacks (ModuleList absent, residual adds owned by the block), data-flow edges, input
shapes, FLOPs (2mkn per matmul, 4 b s^2 h per attention, backward twice forward), bytes and saved
bytes (each storage counted once: the attention saves the qkv output it views), and a tied LM head.
tests/fixtures/gpt_capture.json is a real capture it is checked against (test_cost_model.py).
With device="cpu" times follow a simple pretend device (FLOP/s, bytes/s, launch overhead) and are
"measured"; otherwise they are the profile's roofline estimate on that accelerator.
"""

from __future__ import annotations

from autoplan.hardware.profiles import load_hardware
from autoplan.hardware.types import Cluster, Gpu, HardwareProfile, Link
from autoplan.profile.roofline import backward_bytes, roofline_seconds
from autoplan.profile_data import ModelProfile, OpProfile

GIB = 2**30
FLOPS_PER_S = 1e12
"""Speed of the pretend device the synthetic CPU times assume."""
BYTES_PER_S = 1e11
LAUNCH_S = 5e-6
ELEMENT = 4
"""float32 capture, as autoplan captures."""


class _Builder:
    def __init__(self, parameters: dict[str, int], device: str) -> None:
        self.ops: list[OpProfile] = []
        self.parameters = parameters
        self.gpu = None if device == "cpu" else make_gpu() if device == "testgpu" else load_hardware(device).gpu

    def add(self, node, op, stack, inputs=(), params=(), shapes=(), flops=0.0, out=0, act_in=0, saved=0,
            backward=True, view=False):
        """`out`, `act_in`, `saved` in bytes; parameter bytes are added to the inputs here."""
        param_bytes = sum(self.parameters[p] for p in params) * ELEMENT
        in_bytes = act_in + param_bytes
        if view:
            t_fwd = t_bwd = 0.0
        elif self.gpu is None:
            t_fwd = flops / FLOPS_PER_S + (in_bytes + out) / BYTES_PER_S + LAUNCH_S
            t_bwd = 2 * t_fwd if backward else 0.0
        else:
            t_fwd = roofline_seconds(flops, in_bytes + out, self.gpu, "bf16")
            t_bwd = roofline_seconds(2 * flops, backward_bytes(in_bytes, out, in_bytes), self.gpu, "bf16") \
                if backward else 0.0
        self.ops.append(OpProfile(
            node=node, op=op, module=stack[-1] if stack else "", module_stack=tuple(stack), inputs=tuple(inputs),
            params=tuple(params), input_shapes=tuple(shapes), dtype="float32", flops_fwd=float(flops),
            flops_bwd=2.0 * flops if backward else 0.0, input_bytes=in_bytes, output_bytes=out, saved_bytes=saved,
            time_fwd_s=t_fwd, time_bwd_s=t_bwd, source="measured" if self.gpu is None else "estimated"))
        return node


def gpt_parameters(n_layer: int, n_embd: int, vocab: int, seq: int, tied: bool = True) -> dict[str, int]:
    h = n_embd
    params = {"wte.weight": vocab * h, "wpe.weight": seq * h}
    for i in range(n_layer):
        blk = f"blocks.{i}"
        for name, fan_in, fan_out in (("attn.qkv", h, 3 * h), ("attn.proj", h, h), ("mlp.fc", h, 4 * h),
                                      ("mlp.proj", 4 * h, h)):
            if name == "attn.qkv":
                params[f"{blk}.ln_1.weight"] = params[f"{blk}.ln_1.bias"] = h
            if name == "mlp.fc":
                params[f"{blk}.ln_2.weight"] = params[f"{blk}.ln_2.bias"] = h
            params[f"{blk}.{name}.weight"] = fan_in * fan_out
            params[f"{blk}.{name}.bias"] = fan_out
    params["ln_f.weight"] = params["ln_f.bias"] = h
    if not tied:
        params["lm_head.weight"] = vocab * h
    return params


def gpt_profile(n_layer: int = 4, n_embd: int = 128, vocab: int = 512, seq: int = 64, batch: int = 2,
                n_head: int = 4, tied: bool = True, device: str = "cpu", attention: str = "sdpa") -> ModelProfile:
    """attention="sdpa" is examples/gpt.py; "megatron" is benchmarks/models/megatron_gpt.py (explicit
    scores, softmax and dropout as Megatron-LM ran the published runs, plus hidden dropout)."""
    params = gpt_parameters(n_layer, n_embd, vocab, seq, tied)
    b = _Builder(params, device)
    h, e, hd = n_embd, ELEMENT, n_embd // n_head
    tok = batch * seq
    act = tok * h * e  # one hidden-state tensor, bytes
    x3 = (batch, seq, h)
    pos = b.add("arange", "aten.arange.default", (), out=seq * 8, backward=False)
    wte = b.add("embedding", "aten.embedding.default", ("wte",), params=("wte.weight",),
                shapes=((vocab, h), (batch, seq)), out=act, act_in=tok * 8, saved=tok * 8 + 16)
    wpe = b.add("embedding_1", "aten.embedding.default", ("wpe",), inputs=(pos,), params=("wpe.weight",),
                shapes=((seq, h), (seq,)), out=seq * h * e, act_in=seq * 8, saved=seq * 8)
    x = b.add("add", "aten.add.Tensor", (), inputs=(wte, wpe), shapes=(x3, (seq, h)), out=act,
              act_in=act + seq * h * e)

    def norm(node, stack, inp, name):
        return b.add(node, "aten.layer_norm.default", stack, inputs=(inp,), params=(f"{name}.weight", f"{name}.bias"),
                     shapes=(x3, (h,), (h,)), out=act, act_in=act, saved=act + 2 * tok * e)

    def linear(node, stack, inp, name, fan_in, fan_out, saved, bias=True):
        weight = f"{name}.weight" if name != "lm_head" or not tied else "wte.weight"
        names = (weight, f"{name}.bias") if bias else (weight,)
        shapes = ((batch, seq, fan_in), (fan_out, fan_in)) + (((fan_out,),) if bias else ())
        return b.add(node, "aten.linear.default", stack, inputs=(inp,), params=names, shapes=shapes,
                     flops=2 * tok * fan_in * fan_out, out=tok * fan_out * e, act_in=tok * fan_in * e, saved=saved)

    for i in range(n_layer):
        blk, attn, mlp = f"blocks.{i}", f"blocks.{i}.attn", f"blocks.{i}.mlp"
        n1 = norm(f"ln1_{i}", (blk, f"{blk}.ln_1"), x, f"{blk}.ln_1")
        qkv = linear(f"qkv_{i}", (blk, attn, f"{attn}.qkv"), n1, f"{attn}.qkv", h, 3 * h, act)
        split = b.add(f"split_{i}", "aten.split.Tensor", (blk, attn), inputs=(qkv,), shapes=((batch, seq, 3 * h),),
                      out=3 * act, act_in=3 * act, view=True)
        if attention == "sdpa":
            merged = _sdpa(b, i, (blk, attn), split, batch, seq, n_head, hd, act)
        else:
            merged = _megatron_attention(b, i, (blk, attn), split, batch, seq, n_head, hd, act)
        proj = linear(f"attn_proj_{i}", (blk, attn, f"{attn}.proj"), merged, f"{attn}.proj", h, h,
                      0 if attention == "sdpa" else act)
        if attention != "sdpa":
            proj = _dropout(b, f"drop1_{i}", (blk, f"{blk}.dropout"), proj, (x3,), act)
        x1 = b.add(f"res1_{i}", "aten.add.Tensor", (blk,), inputs=(x, proj), shapes=(x3, x3), out=act, act_in=2 * act)
        n2 = norm(f"ln2_{i}", (blk, f"{blk}.ln_2"), x1, f"{blk}.ln_2")
        fc = linear(f"fc_{i}", (blk, mlp, f"{mlp}.fc"), n2, f"{mlp}.fc", h, 4 * h, act)
        gelu = b.add(f"gelu_{i}", "aten.gelu.default", (blk, mlp), inputs=(fc,), shapes=((batch, seq, 4 * h),),
                     out=4 * act, act_in=4 * act, saved=4 * act)
        down = linear(f"mlp_proj_{i}", (blk, mlp, f"{mlp}.proj"), gelu, f"{mlp}.proj", 4 * h, h, 4 * act)
        if attention != "sdpa":
            down = _dropout(b, f"drop2_{i}", (blk, f"{blk}.dropout"), down, (x3,), act)
        x = b.add(f"res2_{i}", "aten.add.Tensor", (blk,), inputs=(x1, down), shapes=(x3, x3), out=act, act_in=2 * act)
    nf = norm("ln_f", ("ln_f",), x, "ln_f")
    logits = linear("lm_head", ("lm_head",), nf, "lm_head", h, vocab, act, bias=False)
    return ModelProfile(model=f"synthetic gpt l={n_layer} h={h}", batch_size=batch, dtype="float32", device=device,
                        ops=tuple(b.ops), parameters=params, tokens_per_sample=seq, output_nodes=(logits,))


def _sdpa(b: _Builder, i: int, stack, split: str, batch: int, seq: int, n_head: int, hd: int, act: int) -> str:
    """examples/gpt.py: q, k, v views into F.scaled_dot_product_attention (saves the qkv storage)."""
    heads = []
    for j in range(3):
        view = b.add(f"view_{i}_{j}", "aten.view.default", stack, inputs=(split,), shapes=((batch, seq, n_head * hd),),
                     out=act, act_in=act, view=True)
        heads.append(b.add(f"transpose_{i}_{j}", "aten.transpose.int", stack, inputs=(view,),
                           shapes=((batch, seq, n_head, hd),), out=act, act_in=act, view=True))
    q4 = (batch, n_head, seq, hd)
    sdpa = b.add(f"sdpa_{i}", "aten.scaled_dot_product_attention.default", stack, inputs=tuple(heads),
                 shapes=(q4, q4, q4), flops=4 * batch * seq * seq * n_head * hd, out=act, act_in=3 * act,
                 saved=3 * act + act + batch * n_head * seq * ELEMENT)
    back = b.add(f"transpose_out_{i}", "aten.transpose.int", stack, inputs=(sdpa,), shapes=(q4,), out=act, act_in=act,
                 view=True)
    return b.add(f"view_out_{i}", "aten.view.default", stack, inputs=(back,), shapes=((batch, seq, n_head, hd),),
                 out=act, act_in=act, view=True)


def _megatron_attention(b: _Builder, i: int, stack, split: str, batch: int, seq: int, n_head: int, hd: int,
                        act: int) -> str:
    """Megatron-LM's CoreAttention: one baddbmm for the scaled, masked scores (b h s s), softmax, dropout
    (a byte mask), one bmm with V; q, k, v and the context are reshaped copies."""
    bh = batch * n_head
    scores = bh * seq * seq * ELEMENT
    flops = 2 * bh * seq * seq * hd
    heads = []
    for j in range(3):
        view = b.add(f"view_{i}_{j}", "aten.view.default", stack, inputs=(split,), shapes=((batch, seq, n_head * hd),),
                     out=act, act_in=act, view=True)
        turn = b.add(f"transpose_{i}_{j}", "aten.transpose.int", stack, inputs=(view,),
                     shapes=((batch, seq, n_head, hd),), out=act, act_in=act, view=True)
        heads.append(b.add(f"reshape_{i}_{j}", "aten.reshape.default", stack, inputs=(turn,),
                           shapes=((batch, n_head, seq, hd),), out=act, act_in=act))
    full = b.add(f"mask_{i}", "aten.full.default", stack, out=seq * seq * ELEMENT, backward=False)
    triu = b.add(f"triu_{i}", "aten.triu.default", stack, inputs=(full,), shapes=((seq, seq),),
                 out=seq * seq * ELEMENT, act_in=seq * seq * ELEMENT, backward=False)
    bias = b.add(f"expand_{i}", "aten.expand.default", stack, inputs=(triu,), shapes=((seq, seq),), out=scores,
                 act_in=seq * seq * ELEMENT, view=True)
    k_t = b.add(f"transpose_k_{i}", "aten.transpose.int", stack, inputs=(heads[1],), shapes=((bh, seq, hd),),
                out=act, act_in=act, view=True)
    score = b.add(f"baddbmm_{i}", "aten.baddbmm.default", stack, inputs=(bias, heads[0], k_t),
                  shapes=((bh, seq, seq), (bh, seq, hd), (bh, hd, seq)), flops=flops, out=scores,
                  act_in=scores + 2 * act, saved=2 * act)
    probs = b.add(f"softmax_{i}", "aten.softmax.int", stack, inputs=(score,), shapes=((bh, seq, seq),), out=scores,
                  act_in=scores, saved=scores)
    dropped = _dropout(b, f"attn_drop_{i}", (*stack, f"{stack[-1]}.dropout"), probs, ((bh, seq, seq),), scores)
    context = b.add(f"bmm_{i}", "aten.bmm.default", stack, inputs=(dropped, heads[2]),
                    shapes=((bh, seq, seq), (bh, seq, hd)), flops=flops, out=act, act_in=scores + act,
                    saved=scores + act)
    view = b.add(f"view_out_{i}", "aten.view.default", stack, inputs=(context,), shapes=((bh, seq, hd),), out=act,
                 act_in=act, view=True)
    turn = b.add(f"transpose_out_{i}", "aten.transpose.int", stack, inputs=(view,),
                 shapes=((batch, n_head, seq, hd),), out=act, act_in=act, view=True)
    return b.add(f"reshape_out_{i}", "aten.reshape.default", stack, inputs=(turn,),
                 shapes=((batch, seq, n_head, hd),), out=act, act_in=act)


def _dropout(b: _Builder, node: str, stack, inp: str, shapes, nbytes: int) -> str:
    """torch dropout: saves a one-byte mask per element."""
    return b.add(node, "aten.dropout.default", stack, inputs=(inp,), shapes=shapes, out=nbytes, act_in=nbytes,
                 saved=nbytes // ELEMENT)


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


def a100_cluster(num_gpus: int, memory_gib: float | None = None) -> Cluster:
    """The packaged A100 80GB profile, 8 GPUs per node."""
    hw = load_hardware("a100-sxm4-80gb")
    return Cluster(hw, num_gpus, 8, None if memory_gib is None else memory_gib * GIB)


def read_runs(path) -> list[dict[str, str]]:
    """Rows of a runs.csv like shared/reference/runs.csv (published training runs)."""
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_profile(row: dict[str, str], attention: str = "megatron") -> ModelProfile:
    """The Megatron-shaped GPT of a published run, profiled on its accelerator."""
    return gpt_profile(n_layer=int(row["layers"]), n_embd=int(row["hidden"]), vocab=int(row["vocab"]),
                       seq=int(row["seq_len"]), batch=2, n_head=int(row["heads"]), device=row["gpu"],
                       attention=attention)


def run_pins(row: dict[str, str]) -> str:
    """The published layout as a --pin string (micro-batch size and virtual stages left to the search).
    Narayanan et al. SC21 ran tensor parallelism without sequence parallelism (Korthikanti et al. 2022 came
    later): sp=off; and eager PyTorch with Megatron-LM's own fused kernels, not torch.compile: compile=off."""
    pp = int(row["pp"])
    schedule = row["schedule"] if pp > 1 else "1f1b"
    return (f"tp={row['tp']},sp=off,pp={pp},dp={row['dp']},zero=0,recompute={row['recompute']},"
            f"schedule={schedule},compile=off")


def run_cluster(row: dict[str, str]) -> Cluster:
    return Cluster(load_hardware(row["gpu"]), int(row["gpus"]), int(row["gpus_per_node"]))


def paper_flops(row: dict[str, str]) -> float:
    """FLOPs per iteration with full recompute (Narayanan et al. SC21 Eq. 3):
    96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    b, s, l, h, v = (int(row[k]) for k in ("global_batch_seqs", "seq_len", "layers", "hidden", "vocab"))
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
