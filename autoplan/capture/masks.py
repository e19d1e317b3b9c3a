"""Which attention masks a transformers model passes to SDPA when it runs eagerly.

transformers builds its causal mask as a tensor when it traces (torch.export: an exported graph would fix is_causal
for the example's shapes, pytorch#108108), and passes is_causal=True and no mask instead when it runs eagerly and the
mask would be exactly SDPA's causal triangle (transformers.masking_utils._ignore_causal_mask_sdpa: no padding mask,
as many queries as keys at the same offset, no window shorter than the sequence). So the captured graph holds a mask
the program does not: the capture records, for each mask transformers built, whether it would have been left to
is_causal eagerly (`recording_mask_skips`), from what is known without values (`causal_triangle`). Without the
mask, transformers also passes grouped-query keys and values unrepeated (enable_gqa): chain/attention.py
run_time_saved_bytes prices what the program's call keeps."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn


def positions_in(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the forward arguments hand `model` position ids (a transformers model's `position_ids` argument), or
    might (they do not bind to its forward's signature)."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return True
    for name, value in list(bound.items()):  # what **kwargs collected
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(value)
    return bound.get("position_ids") is not None


def causal_triangle(arguments: Mapping[str, Any]) -> bool:
    """Whether the mask transformers' _ignore_causal_mask_sdpa is asked about (its bound `arguments`) would be
    exactly SDPA's causal triangle: no padding mask, as many queries as keys at the same offset, and no window
    shorter than the sequence (a window of 0 is none: Qwen2-MoE's config, without a sliding window, still has a
    "sliding" mask built with local_attention_size 0, which none of its layers reads)."""
    q_offset, kv_offset, window = (arguments.get("q_offset"), arguments.get("kv_offset"),
                                   arguments.get("local_attention_size"))
    return ("padding_mask" in arguments and arguments["padding_mask"] is None
            and isinstance(arguments.get("q_length"), int) and arguments.get("q_length") == arguments.get("kv_length")
            and isinstance(q_offset, int) and q_offset == kv_offset
            and (not window or arguments["kv_length"] < window))


@contextmanager
def mask_questions_answered(answer: Callable[[bool, Callable[[], bool]], bool],
                            positions_given: bool) -> Iterator[None]:
    """While the block runs, transformers' two questions about a causal mask (transformers.masking_utils) are
    answered from what is known without values, as transformers answers them eagerly on an unpadded batch:
    - _ignore_causal_mask_sdpa: `answer(triangle, own)`, `triangle` causal_triangle's answer for the call and
      `own()` transformers' own (a mask, under tracing);
    - find_packed_sequence_indices: no packed sequences when the model numbers its positions itself (not
      `positions_given`: transformers numbers each row 0..S-1; under tracing it cannot read that from the
      values), else its own answer.
    Nothing changes for a model whose library is not transformers (its masking module not loaded)."""
    masking = sys.modules.get("transformers.masking_utils")
    ignore_mask = getattr(masking, "_ignore_causal_mask_sdpa", None)
    find_packed = getattr(masking, "find_packed_sequence_indices", None)
    if ignore_mask is None or find_packed is None:
        yield
        return
    signature = inspect.signature(ignore_mask)

    def ignore_causal_mask(*args, **kwargs):
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        return answer(causal_triangle(given.arguments), lambda: ignore_mask(*args, **kwargs))

    def packed_sequences(*args, **kwargs):
        return find_packed(*args, **kwargs) if positions_given else None

    masking._ignore_causal_mask_sdpa, masking.find_packed_sequence_indices = ignore_causal_mask, packed_sequences
    try:
        yield
    finally:
        masking._ignore_causal_mask_sdpa, masking.find_packed_sequence_indices = ignore_mask, find_packed


def recording_mask_skips(record: list[bool], positions_given: bool):
    """While a transformers model is captured: append to `record`, for each mask transformers asks whether SDPA's
    is_causal could replace, causal_triangle's answer (what it does eagerly on an unpadded batch), leaving its own
    answer (a mask, under tracing) unchanged; packed sequences as mask_questions_answered says."""

    def recorded(triangle: bool, own: Callable[[], bool]) -> bool:
        record.append(triangle)
        return own()

    return mask_questions_answered(recorded, positions_given)
