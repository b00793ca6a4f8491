"""R3 (rollout router replay) on the CPU's Megatron batches: the rollout's routes laid out as the router sees them.

Piece 10 (`r3_bshd`) of the plugin's Megatron CPU shim (`verl_dppo.rehearsal.megatron_shim`).

verl 0.9.1 lays R3's routes out for packed (THD) batches only: `set_router_replay_data` packs each sequence's routes
(`preprocess_thd_engine`: one row per token, sequences one after another) and each router replays row i at the
i-th token it routes. On the CPU every batch is unpacked (BSHD: THD needs TransformerEngine's attention), and there
the router routes `[S, B]` tokens, padding included, S-major (megatron-core's hidden states are [S, B, H]), with S
the padded length verl picks inside the model's forward (`preprocess_bshd_engine`, by default the mini-batch's
longest sequence: `pad_bshd_to_minibatch_max`). verl then stops at its own check ("Router replay tensors are not
aligned: scores=(S*B, E), targets=(T, k)").

The piece keeps verl's packing and moves the rows where the router reads them, once it knows S:

- `set_router_replay_data` (verl.workers.engine.megatron.transformer_impl, where the engine calls it): verl's own
  function, then each of the model's routers' targets is tagged with the sequences' lengths;
- `RouterReplay.get_replay_topk` (verl.utils.megatron.router_replay_patch): when the targets it is about to replay
  are tagged and the router's scores have S*B rows, the targets and their replay mask are laid out [S, B] as the
  batch is (a sequence's token t at row t*B + b; padding rows are not replayed: the mask is False there, so they
  keep the router's own choice), then verl's replay runs as written.

What the replay did is counted by the plugin's own patch of `RouterReplay.get_replay_topk`
(patches/megatron_router_replay.py), on the rows as laid out here, and reported by the loss on every step
(`actor/dppo/r3_replayed_frac`, `actor/dppo/r3_router_differs_frac`, `actor/dppo/r3_unrouted_frac`).

Any other shape (sequence parallelism splits the rows across TP ranks, context parallelism) is refused by name:
the CPU settings turn both off.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from verl_dppo.rehearsal.megatron_device import MegatronShimError, target

__all__ = ["bshd_rows", "piece_r3_bshd"]

_LENGTHS = "_dppo_bshd_lengths"


def bshd_rows(rows: torch.Tensor, lengths: list[int], padded: int) -> torch.Tensor:
    """Packed rows ([sum(lengths), ...], sequences one after another) -> the [S, B] order megatron-core's router reads
    ([S * B, ...], token t of sequence b at row t * B + b), zeros (False) at padding."""
    if sum(lengths) != rows.shape[0] or max(lengths) > padded:
        raise MegatronShimError(
            f"verl-dppo's Megatron CPU shim (r3_bshd): {rows.shape[0]} route rows for sequences "
            f"of {lengths} tokens padded to {padded}"
        )
    out = rows.new_zeros((padded, len(lengths), *rows.shape[1:]))
    for b, part in enumerate(rows.split(lengths)):
        out[: part.shape[0], b] = part
    return out.reshape(padded * len(lengths), *rows.shape[1:])


def _to_bshd(router, scores: torch.Tensor) -> Optional[tuple]:
    """Lay out the targets `router` is about to replay as `scores`' rows are laid out (see the module's docstring);
    returns them and their mask where it did, else None."""
    action = getattr(router.router_replay_action, "name", None)  # None or RECORD: nothing is replayed
    backward = action == "REPLAY_BACKWARD"
    if backward:
        if not router.replay_backward_list:
            return None
        indices, mask = router.replay_backward_list[0], router.replay_backward_mask_list[0]
    elif action == "REPLAY_FORWARD":
        indices, mask = router.target_topk_idx, router.target_replay_mask
    else:
        return None
    lengths = getattr(indices, _LENGTHS, None)
    if lengths is None:  # not tagged by set_router_replay_data, or laid out already
        return None
    rows, count = scores.shape[0], len(lengths)
    if rows % count:
        raise MegatronShimError(
            f"verl-dppo's Megatron CPU shim (r3_bshd): the router routes {rows} tokens, not a "
            f"multiple of the batch's {count} sequences (sequence parallelism is off on the CPU)"
        )
    indices = bshd_rows(indices, lengths, rows // count)
    if mask is not None:
        mask = bshd_rows(mask, lengths, rows // count)
    if backward:
        router.replay_backward_list[0], router.replay_backward_mask_list[0] = indices, mask
    else:
        router.target_topk_idx, router.target_replay_mask = indices, mask
    return indices, mask


def piece_r3_bshd() -> None:
    engine = importlib.import_module("verl.workers.engine.megatron.transformer_impl")
    utils = importlib.import_module("verl.utils.megatron.router_replay_utils")
    replay = target("verl.utils.megatron.router_replay_patch", "RouterReplay")
    original_set = target(engine.__name__, "set_router_replay_data")

    @functools.wraps(original_set)
    def set_router_replay_data(
        layers_topk_idx, attention_mask, tf_config, vp_rank=None, replay_mask=None, local_cp_size=None, model=None
    ):
        original_set(
            layers_topk_idx,
            attention_mask,
            tf_config,
            vp_rank,
            replay_mask=replay_mask,
            local_cp_size=local_cp_size,
            model=model,
        )
        if not getattr(layers_topk_idx, "is_nested", False) or model is None:
            return
        if local_cp_size is not None or getattr(tf_config, "context_parallel_size", 1) > 1:
            raise MegatronShimError("verl-dppo's Megatron CPU shim (r3_bshd): R3 with context parallelism")
        lengths = [int(n) for n in layers_topk_idx.offsets().diff().tolist()]
        for _, router in utils.iter_model_routers(model):
            setattr(router.target_topk_idx, _LENGTHS, lengths)  # the same object ends replay_backward_list

    engine.set_router_replay_data = set_router_replay_data
    original_get = replay.get_replay_topk

    @functools.wraps(original_get)
    def get_replay_topk(self, scores, topk, *args, **kwargs):
        _to_bshd(self, scores)
        return original_get(self, scores, topk, *args, **kwargs)

    replay.get_replay_topk = get_replay_topk
