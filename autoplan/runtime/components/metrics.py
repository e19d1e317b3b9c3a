"""Per-step throughput, model FLOPs utilization and peak memory, printed by rank 0; the files a run writes
them to step by step (AppendedJson)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.runtime.components.memory import PeakLiveMemory
from autoplan.runtime.distributed.mesh import RankLayout
from autoplan.runtime.distributed.parallel import max_over_ranks, peak_memory_bytes


@dataclass
class StepMetrics:
    """Numbers of the plan that turn a step time into throughput and MFU."""

    global_batch: int
    """Samples per optimizer step, all ranks together."""
    world_size: int
    """Processes (GPUs) the step ran on."""
    tokens_per_sample: int | None = None
    """Tokens per sample when the inputs are tokens (tokens/s is then logged)."""
    model_flops_per_step: float = 0.0
    """Forward+backward FLOPs of one step at the global batch, without recomputation (plan.json)."""
    peak_flops_per_gpu: float | None = None
    """Dense peak FLOP/s of one GPU of the planned kind in the planned dtype (None: MFU not logged)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """The device this rank trains on (its peak memory is read there)."""
    verbose: bool = False
    """Print each step's line (rank 0 does)."""
    history: list[dict] = field(default_factory=list)
    """One record per step: step, loss, seconds, samples_per_s, tokens_per_s, mfu, peak_memory_bytes (and on CUDA
    peak_reserved_bytes, the allocator's reserved peak)."""

    def record(self, step: int, loss: float, seconds: float, lr: float | None = None,
               grad_norm: float | None = None) -> dict:
        """Log a step (peak memory is the largest over ranks: a collective, so every rank calls it). On CUDA
        each step's peak is its own: the allocator's peak is reset after reading it (parallelize resets it
        after building the model), so a step's number holds neither the materialization nor an earlier step's
        compilation; the first step's holds its own compilation."""
        entry = {"step": step, "loss": loss, "seconds": seconds, "samples_per_s": self.global_batch / seconds,
                 "peak_memory_bytes": int(max_over_ranks(peak_memory_bytes(self.device), self.device))}
        if self.device.type == "cuda":  # what the caching allocator holds from the device, beside what tensors use
            entry["peak_reserved_bytes"] = int(max_over_ranks(torch.cuda.max_memory_reserved(self.device), self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        text = f"step {step} | loss {loss:.6f}"
        if lr is not None:
            entry["lr"] = lr
            text += f" | lr {lr:.3g}"
        if grad_norm is not None:
            entry["grad_norm"] = grad_norm
            text += f" | grad norm {grad_norm:.3f}"
        text += f" | {seconds * 1e3:.1f} ms | {entry['samples_per_s']:.1f} samples/s"
        if self.tokens_per_sample:
            entry["tokens_per_s"] = entry["samples_per_s"] * self.tokens_per_sample
            text += f" | {entry['tokens_per_s']:.0f} tokens/s"
        if self.peak_flops_per_gpu and self.model_flops_per_step:
            entry["mfu"] = self.model_flops_per_step / (seconds * self.world_size * self.peak_flops_per_gpu)
            text += f" | MFU {entry['mfu'] * 100:.1f}%"
        # on a CPU the per-step number is the resident set (libraries included); verify --measure
        # measures the live tensor memory of a step separately (PeakLiveMemory)
        what = "peak memory" if self.device.type == "cuda" else "peak RSS"
        text += f" | {what} {entry['peak_memory_bytes'] / 2**30:.2f} GiB"
        self.history.append(entry)
        if self.verbose:
            print(text, flush=True)
        return entry


def gather_rank_metrics(rank: RankLayout, stages: list[int], history: list[dict],
                        memory: PeakLiveMemory) -> list[dict] | None:
    """Every rank's step times and peak live tensor memory (of the step `memory` tracked), gathered on
    rank 0 (None elsewhere). A collective: every rank calls it."""
    mine = {"rank": rank.rank, "pp_rank": rank.pp_rank, "dp_rank": rank.dp_rank, "tp_rank": rank.tp_rank,
            "stages": stages, "step_times_s": [entry["seconds"] for entry in history],
            "memory_tracked_step": len(history) - 1, "peak_memory_bytes": memory.peak_bytes,
            "baseline_memory_bytes": memory.baseline_bytes, "peak_memory_parts": memory.peak_parts}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    return gathered if rank.rank == 0 else None


class AppendedJson:
    """A JSON list on disk (with `fields`, an object of those fields and the list under `key`), extended in
    place after every step, so a run killed at step k leaves its k steps readable: the file is valid JSON
    after each append (the closing brackets are rewritten behind the new item), and an append costs the item,
    not the list so far. `path` None: a no-op (ranks other than 0, no --losses-out)."""

    def __init__(self, path: Path | None, fields: dict | None = None, key: str = "steps") -> None:
        self.count = 0
        self.file = None if path is None else open(path, "wb")
        if self.file is None:
            return
        if fields is None:
            head, self.tail = "[", b"]"
        else:
            head, self.tail = json.dumps({**fields, key: []})[:-2], b"]}"
        self.file.write(head.encode() + self.tail)
        self.file.flush()

    def append(self, item) -> None:
        if self.file is None:
            return
        self.file.seek(-len(self.tail), os.SEEK_END)
        self.file.write((", " if self.count else "").encode() + json.dumps(item).encode() + self.tail)
        self.file.flush()
        self.count += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def write_json(path: Path, value) -> None:
    """Replace `path` with `value` as JSON (indented) in one rename: a reader never sees it half-written."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(value, indent=2))
    os.replace(partial, path)
