"""Synthetic data for the generated program, identical on every rank and in the reference.

At step t every process seeds torch with seed + 1000 + t and calls example_batch(global_batch); a
data-parallel rank keeps its contiguous slice along dim 0. Inputs may be a Tensor, a tuple or a dict
of tensors (called as model(x), model(*x), model(**x)).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from autoplan.errors import UserError
from autoplan.runtime.distributed.batches import batch_size_of, shard

DATA_SEED_OFFSET = 1000
"""Step t draws its batch with seed + DATA_SEED_OFFSET + t, away from the weight-init seed."""


def step_batch(example_batch: Callable[[int], Any], global_batch: int, seed: int, step: int) -> tuple[Any, Any]:
    """The whole global batch of step `step`, the same in every process."""
    torch.manual_seed(seed + DATA_SEED_OFFSET + step)
    batch = example_batch(global_batch)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise UserError("example_batch(batch_size) must return (inputs, targets)")
    got = batch_size_of(batch)
    if got != global_batch:
        raise UserError(f"example_batch({global_batch}) returned {got} samples along dim 0")
    return batch[0], batch[1]


class TrainingData:
    """The batches of one data-parallel rank, step by step.

    If the model file defines make_dataloader(rank, world_size[, batch_size]), rank r of the
    world_size data-parallel ranks trains on the batches of its loader (which should shard the data
    with a DistributedSampler(num_replicas=world_size, rank=rank)); batch_size, if the function takes
    it, is the per-rank batch. Else every rank draws the global batch of step t from example_batch
    (seeded with seed + 1000 + t) and keeps its contiguous slice. Either way the global batch of a
    step is the ranks' batches in rank order, which is what the single-device reference trains on.
    """

    def __init__(self, source: Any, global_batch: int, seed: int, dp_rank: int, dp: int) -> None:
        if global_batch % dp:
            raise UserError(f"global batch {global_batch} does not split into {dp} data-parallel ranks")
        self.source, self.global_batch, self.seed = source, global_batch, seed
        self.dp_rank, self.dp = dp_rank, dp
        self.make_dataloader = getattr(source.module, "make_dataloader", None) if source is not None else None
        self._loaders: dict[int, _LoaderCursor] = {}

    def batch(self, step: int) -> tuple[Any, Any]:
        """This rank's (inputs, targets) of step `step`."""
        if self.make_dataloader is None:
            whole = step_batch(self.source.example_batch, self.global_batch, self.seed, step)
            return shard(whole, self.dp_rank, self.dp)
        return self._loader_batch(self.dp_rank, step)

    def global_batch_of(self, step: int) -> tuple[Any, Any]:
        """The whole global batch of step `step` (the single-device reference trains on it)."""
        if self.make_dataloader is None:
            return step_batch(self.source.example_batch, self.global_batch, self.seed, step)
        parts = [self._loader_batch(rank, step) for rank in range(self.dp)]
        return pytree.tree_map(lambda *ts: torch.cat(ts) if isinstance(ts[0], torch.Tensor) else ts[0], *parts)

    def position(self) -> dict[str, Any]:
        """Where this rank's data stands, for a checkpoint (runtime.Checkpointer): with make_dataloader, its
        loader's own state_dict() where it has one (torchdata's StatefulDataLoader) and the epoch; without, nothing
        beyond the steps done (a step's batch is drawn from its seed)."""
        cursor = self._loaders.get(self.dp_rank)
        return {"dp_rank": self.dp_rank, "dp": self.dp,
                "loader": cursor.position() if cursor is not None else None}

    def restore(self, position: dict[str, Any] | None, steps_done: int) -> None:
        """Continue after `steps_done` steps: from a loader's saved state when `position` (this rank's, from
        position()) holds one, else by skipping the batches of the steps done (drawing them as the uninterrupted
        run did, so a loader that draws from torch's generator leaves it where that run did). Without
        make_dataloader, nothing to do."""
        if self.make_dataloader is None:
            return
        cursor = self._cursor(self.dp_rank)
        saved = (position or {}).get("loader")
        if saved is not None and saved.get("state") is not None and hasattr(cursor.loader, "load_state_dict"):
            cursor.resume(saved, steps_done)
        else:
            cursor.skip(steps_done)

    def _cursor(self, rank: int) -> _LoaderCursor:
        if rank not in self._loaders:
            self._loaders[rank] = _LoaderCursor(self._make_loader(rank))
        return self._loaders[rank]

    def _loader_batch(self, rank: int, step: int) -> tuple[Any, Any]:
        batch = self._cursor(rank).get(step)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise UserError("make_dataloader's batches must be (inputs, targets)")
        got, want = batch_size_of(batch), self.global_batch // self.dp
        if got != want:
            raise UserError(f"make_dataloader gave {got} samples per batch, the plan needs global batch "
                            f"{self.global_batch} / {self.dp} data-parallel ranks = {want}")
        return batch[0], batch[1]

    def _make_loader(self, rank: int) -> Any:
        import inspect

        kwargs = {}
        if "batch_size" in inspect.signature(self.make_dataloader).parameters:
            kwargs["batch_size"] = self.global_batch // self.dp
        torch.manual_seed(self.seed + DATA_SEED_OFFSET)
        return self.make_dataloader(rank, self.dp, **kwargs)


class _LoaderCursor:
    """Batch `step` of a loader, epoch after epoch (set_epoch on its sampler, as DistributedSampler wants)."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.epoch, self.next_step, self.iterator, self.in_epoch = loader, 0, 0, None, 0

    def position(self) -> dict[str, Any]:
        state = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
        return {"state": state, "epoch": self.epoch, "in_epoch": self.in_epoch, "next_step": self.next_step}

    def resume(self, saved: dict[str, Any], steps_done: int) -> None:
        """Continue from a loader state saved after `steps_done` steps (position())."""
        self.loader.load_state_dict(saved["state"])
        self.epoch, self.in_epoch, self.next_step, self.iterator = saved["epoch"], saved["in_epoch"], steps_done, None
        if self.in_epoch == 0:  # the saved state is at an epoch's start: iterating it begins the epoch
            return
        self.iterator = self._begin_epoch_iterator()

    def skip(self, steps_done: int) -> None:
        """Draw the batches of the first `steps_done` steps, as the uninterrupted run did."""
        if steps_done > 0:
            self.get(steps_done - 1)

    def _begin_epoch_iterator(self) -> Any:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        return iter(self.loader)

    def get(self, step: int) -> Any:
        if step < self.next_step:
            raise UserError(f"data loader asked for step {step} after step {self.next_step - 1}")
        while True:
            if self.iterator is None:
                self.iterator, self.in_epoch = self._begin_epoch_iterator(), 0
            try:
                batch = next(self.iterator)
            except StopIteration:
                if self.in_epoch == 0:
                    raise UserError("make_dataloader returned an empty loader") from None
                self.iterator, self.epoch = None, self.epoch + 1
                continue
            self.next_step, self.in_epoch = self.next_step + 1, self.in_epoch + 1
            if self.next_step > step:
                return batch
