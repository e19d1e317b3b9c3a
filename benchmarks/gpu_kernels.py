"""The kernels autoplan's cost model prices by one efficiency each, timed on this machine's GPU (a step of
benchmarks/gpu_check.sh): what each sustains against the dense bf16 GEMM peak measured here and the profile's peak.

    python benchmarks/gpu_kernels.py --device cuda --results DIR [--budget-s 90]

Sections (each prints its rows and goes into DIR/kernels.json; a section that fails is recorded with its error and
the next one runs):
  gemm       bf16 dense matmul 8192^3 (random data): the measured ceiling the others are read against
  copy       device-to-device copy, bytes read + written per second
  attention  F.scaled_dot_product_attention under each backend torch has here (flash, cudnn, efficient), causal and
             not, forward and forward + backward, head dim 128 at 8K..64K tokens (the long-context ladders' shapes);
             efficiency = FLOPs as torch's FlopCounterMode counts them (attention_flops: causal counted as full, as
             cost/calibration.ATTENTION_EFFICIENCY is defined) / time / the profile's dense bf16 peak
  mla        DeepSeek-V3's attention shape (query/key head dim 192, value 128) under SDPA's backends and
             FlexAttention (compiled), which torchtitan runs for it
  grouped    torch._grouped_mm over stacked expert weights (what transformers' MoE blocks run) at mixture-of-experts
             shapes (Qwen3-30B-A3B, DeepSeek-V3-16B) with tokens spread evenly, forward and forward + backward,
             against one dense matmul of the same FLOPs
--device cpu is the dry run (tiny shapes, fp32 where bf16 kernels are missing): it checks the script, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _timer(device):
    import torch

    if device.type == "cuda":
        def run(fn, repeat: int) -> list[float]:
            times = []
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return times
    else:
        def run(fn, repeat: int) -> list[float]:
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            return times
    return run


def median_s(fn, device, target_s: float = 0.15, warmup: int = 2) -> float:
    """The median time of fn after warm-up, repeated about target_s seconds (3 to 50 times)."""
    run = _timer(device)
    first = min(run(fn, warmup))
    repeat = max(3, min(50, int(target_s / max(first, 1e-6))))
    return statistics.median(run(fn, repeat))


def first_line(error: BaseException) -> str:
    """An error's first line (160 characters at most), or its type's name when it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else type(error).__name__


def attention_flops(q, k, v) -> tuple[int, int]:
    """Forward and backward FLOPs of attention as torch's FlopCounterMode counts them (utils/flop_counter.py
    sdpa_flop_count, sdpa_backward_flop_count: the scores and their product with the values, causal counted as
    full; backward recomputes the scores and takes three more products): 2bhs^2(d_qk + d_v) and
    2bhs^2(3 d_qk + 2 d_v)."""
    b, h, s, d_qk = q.shape
    d_v = v.shape[-1]
    return 2 * b * h * s * k.shape[2] * (d_qk + d_v), 2 * b * h * s * k.shape[2] * (3 * d_qk + 2 * d_v)


def section_gemm(ctx) -> dict:
    import torch

    n = ctx.n_gemm
    a = torch.randn(n, n, device=ctx.device, dtype=ctx.dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=ctx.dtype)
    seconds = median_s(lambda: a @ b, ctx.device)
    rate = 2 * n ** 3 / seconds
    ctx.gemm_peak = rate
    print(f"gemm   {n}^3 {ctx.dtype}: {seconds * 1e3:.3f} ms, {rate / 1e12:.1f} TFLOP/s "
          f"({rate / ctx.profile_peak:.3f} of the profile's peak {ctx.profile_peak / 1e12:.0f})")
    return {"n": n, "seconds": seconds, "flops_per_s": rate, "of_profile_peak": rate / ctx.profile_peak}


def section_copy(ctx) -> dict:
    import torch

    src = torch.randn(ctx.copy_elements, device=ctx.device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_s(lambda: dst.copy_(src), ctx.device)
    rate = 2 * src.numel() * 4 / seconds
    print(f"copy   {src.numel() * 4 / 2**30:.2f} GiB: {rate / 1e12:.3f} TB/s (read + written)")
    return {"bytes": src.numel() * 4, "seconds": seconds, "bytes_per_s": rate}


def _backends():
    from torch.nn.attention import SDPBackend

    return {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
"""SDPA's backends by name; "default" is the call with no backend named (what a model's SDPA call runs)."""


def _attention_row(ctx, label: str, call, q, k, v) -> dict:
    """Forward and forward + backward of one attention call: time, FlopCounterMode's FLOPs, efficiency."""
    import torch

    grad = torch.randn(q.shape[:-1] + (v.shape[-1],), device=ctx.device, dtype=ctx.dtype)

    def forward():
        with torch.no_grad():
            return call(q, k, v)

    def both():
        out = call(q, k, v)
        out.backward(grad)

    forward_flops, backward_flops = attention_flops(q, k, v)
    both_flops = forward_flops + backward_flops
    forward_s = median_s(forward, ctx.device)
    both_s = median_s(both, ctx.device)
    row = {"forward_s": forward_s, "forward_backward_s": both_s, "forward_flops": forward_flops,
           "forward_backward_flops": both_flops,
           "forward_efficiency": forward_flops / forward_s / ctx.profile_peak,
           "forward_backward_efficiency": both_flops / both_s / ctx.profile_peak,
           "forward_backward_of_measured_gemm": both_flops / both_s / ctx.gemm_peak if ctx.gemm_peak else None}
    print(f"{label}: fwd {forward_s * 1e3:8.3f} ms ({row['forward_efficiency']:.3f} of peak), fwd+bwd "
          f"{both_s * 1e3:8.3f} ms ({row['forward_backward_efficiency']:.3f} of peak"
          + (f", {row['forward_backward_of_measured_gemm']:.3f} of the measured GEMM)" if ctx.gemm_peak else ")"))
    return row


def _qkv(ctx, heads: int, seq: int, qk_dim: int, v_dim: int):
    import torch

    def make(dim):
        return torch.randn(1, heads, seq, dim, device=ctx.device, dtype=ctx.dtype, requires_grad=True)

    return make(qk_dim), make(qk_dim), make(v_dim)


def _sdpa(backend, causal: bool):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def section_attention(ctx) -> dict:
    rows = {}
    for name, backend in _backends().items():
        if name == "math" and ctx.device.type == "cuda":
            continue
        for seq in ctx.attention_seqs:
            for causal in (True, False):
                label = f"attention {name:9s} s={seq:6d} h={ctx.heads} d=128 {'causal' if causal else 'full  '}"
                if ctx.over_budget():
                    print(f"{label}: skipped (the step's time budget is spent)")
                    continue
                q, k, v = _qkv(ctx, ctx.heads, seq, 128, 128)
                try:
                    rows[f"{name}/{seq}/{'causal' if causal else 'full'}"] = _attention_row(
                        ctx, label, _sdpa(backend, causal), q, k, v)
                except RuntimeError as error:  # a backend this build or GPU cannot run for this shape
                    first = first_line(error)
                    print(f"{label}: not run here ({first})")
                    rows[f"{name}/{seq}/{'causal' if causal else 'full'}"] = {"error": first}
    return rows


def section_mla(ctx) -> dict:
    import torch

    rows = {}
    seq = ctx.mla_seq
    for name, backend in _backends().items():
        if name == "math" and ctx.device.type == "cuda":
            continue
        label = f"mla       {name:9s} s={seq:6d} h={ctx.heads} qk=192 v=128 causal"
        q, k, v = _qkv(ctx, ctx.heads, seq, 192, 128)
        try:
            rows[name] = _attention_row(ctx, label, _sdpa(backend, True), q, k, v)
        except RuntimeError as error:
            first = first_line(error)
            print(f"{label}: not run here ({first})")
            rows[name] = {"error": first}
    if ctx.device.type == "cuda" and not ctx.over_budget():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        mask = create_block_mask(causal, None, None, seq, seq, device=str(ctx.device))
        compiled = torch.compile(flex_attention)
        q, k, v = _qkv(ctx, ctx.heads, seq, 192, 128)
        label = f"mla       flex      s={seq:6d} h={ctx.heads} qk=192 v=128 causal (block mask)"
        try:
            started = time.perf_counter()
            compiled(q, k, v, block_mask=mask).sum().backward()
            print(f"flex_attention compiled in {time.perf_counter() - started:.1f} s")
            rows["flex"] = _attention_row(ctx, label, lambda a, b, c: compiled(a, b, c, block_mask=mask), q, k, v)
        except Exception as error:  # noqa: BLE001 -- inductor's failures come as many types; recorded, not hidden
            first = first_line(error)
            print(f"{label}: not run here ({type(error).__name__}: {first})")
            rows["flex"] = {"error": f"{type(error).__name__}: {first}"}
    return rows


def section_grouped(ctx) -> dict:
    import torch

    rows = {}
    for name, experts, hidden, ffn, tokens, top_k in ctx.moe_shapes:
        rows_per_expert = tokens * top_k // experts
        m = rows_per_expert * experts
        x = torch.randn(m, hidden, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
        w_up = torch.randn(experts, hidden, 2 * ffn, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
        w_down = torch.randn(experts, ffn, hidden, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
        offs = torch.arange(1, experts + 1, device=ctx.device, dtype=torch.int32) * rows_per_expert
        grad = torch.randn(m, hidden, device=ctx.device, dtype=ctx.dtype)

        def experts_mlp():
            up = torch._grouped_mm(x, w_up, offs=offs)
            gate, value = up.chunk(2, dim=-1)
            return torch._grouped_mm(torch.nn.functional.silu(gate) * value, w_down, offs=offs)

        def forward():
            with torch.no_grad():
                return experts_mlp()

        def both():
            experts_mlp().backward(grad)

        flops = 2 * m * hidden * 3 * ffn  # the three projections' multiply-adds
        label = f"grouped {name:16s} E={experts} rows/expert={rows_per_expert} {hidden}x{ffn}"
        try:
            forward_s = median_s(forward, ctx.device)
            both_s = median_s(both, ctx.device)
        except (RuntimeError, AttributeError) as error:
            first = first_line(error)
            print(f"{label}: not run here ({first})")
            rows[name] = {"error": first}
            continue
        dense_a = torch.randn(m, hidden, device=ctx.device, dtype=ctx.dtype)
        dense_b = torch.randn(hidden, 3 * ffn, device=ctx.device, dtype=ctx.dtype)
        dense_s = median_s(lambda: dense_a @ dense_b, ctx.device)
        row = {"experts": experts, "rows_per_expert": rows_per_expert, "hidden": hidden, "ffn": ffn,
               "forward_s": forward_s, "forward_backward_s": both_s, "flops_forward": flops,
               "forward_efficiency": flops / forward_s / ctx.profile_peak,
               "forward_backward_efficiency": 3 * flops / both_s / ctx.profile_peak,
               "dense_same_flops_efficiency": flops / dense_s / ctx.profile_peak}
        rows[name] = row
        print(f"{label}: fwd {forward_s * 1e3:.3f} ms ({row['forward_efficiency']:.3f} of peak), fwd+bwd "
              f"{both_s * 1e3:.3f} ms ({row['forward_backward_efficiency']:.3f}); one dense matmul of the same "
              f"FLOPs {row['dense_same_flops_efficiency']:.3f}")
    return rows


class Context:
    def __init__(self, device_name: str, budget_s: float):
        import torch

        self.device = torch.device(device_name)
        self.started = time.perf_counter()
        self.budget_s = budget_s
        self.gemm_peak = None
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        if cuda:
            from autoplan.hardware.profiles import load_hardware

            name = torch.cuda.get_device_name(0).lower()
            profile = "h200-sxm-141gb" if "h200" in name else "h100-sxm5-80gb"
            self.profile_peak = load_hardware(profile).gpu.peak_flops["bf16"]
            self.n_gemm, self.copy_elements, self.heads = 8192, 2**30 // 4, 16
            self.attention_seqs = (8192, 16384, 32768, 65536)
            self.mla_seq = 4096
            # (name, experts, hidden, expert ffn, tokens on the rank, top k): published configs
            self.moe_shapes = (("qwen3-30b-a3b", 128, 2048, 768, 16384, 8),
                               ("deepseek-v3-16b", 64, 2048, 1408, 16384, 6),
                               ("mixtral-8x7b", 8, 4096, 14336, 8192, 2))
        else:
            self.profile_peak = 1e11  # the dry run's nominal peak: its ratios check the arithmetic, not a CPU
            self.n_gemm, self.copy_elements, self.heads = 256, 2**20, 2
            self.attention_seqs = (128,)
            self.mla_seq = 64
            self.moe_shapes = (("tiny", 4, 32, 16, 64, 2),)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.budget_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="after this many seconds the attention sections skip their remaining shapes")
    args = parser.parse_args(argv)
    import torch

    ctx = Context(args.device, args.budget_s)
    torch.manual_seed(0)
    found = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
             "torch": torch.__version__, "profile_peak_flops_per_s": ctx.profile_peak}
    for name, section in (("gemm", section_gemm), ("copy", section_copy), ("attention", section_attention),
                          ("mla", section_mla), ("grouped", section_grouped)):
        try:
            found[name] = section(ctx)
        except Exception as error:  # noqa: BLE001 -- one section's failure is recorded; the others still run
            first = first_line(error)
            print(f"{name}: FAILED ({type(error).__name__}: {first})")
            found[name] = {"error": f"{type(error).__name__}: {first}"}
        if args.device == "cuda":
            torch.cuda.empty_cache()
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "kernels.json").write_text(json.dumps(found, indent=2) + "\n")
    print(f"kernels: {time.perf_counter() - ctx.started:.0f} s, written to {args.results / 'kernels.json'}")


if __name__ == "__main__":
    main()
