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

The first replay in a process logs one line: the rows replayed; on how many of them the experts the router then
hands to the MoE layer (what the update computes with) are the replayed ones; on how many its own choice differs
from those; and on how many its own choice equals the rollout's route (at the first update, on the weights that
sampled, in float32 on both sides, the two agree on nearly every row when the rows line up, and by chance when
they do not). With the same weights on both sides the router would choose the rollout's experts anyway, so a
replay that does nothing would look like one that works: `VERL_DPPO_R3_RENAME_EXPERTS=1` (the Megatron tier sets
it) renames every replayed expert e -> (e + 1) mod E, a route the router's own choice almost never is, so the line
then shows replay acting: the experts used are the replayed ones on every row, the router's own choice differs on
nearly every row, and still equals the rollout's (before renaming) where the rows line up.

Any other shape (sequence parallelism splits the rows across TP ranks, context parallelism) is refused by name:
the CPU settings turn both off.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Optional

import torch

from verl_dppo.rehearsal.megatron_device import MegatronShimError, target

__all__ = ["bshd_rows", "piece_r3_bshd"]

_LENGTHS = "_dppo_bshd_lengths"
_REPORTED: list = []
RENAME = "VERL_DPPO_R3_RENAME_EXPERTS"
"""Set to 1: the rehearsal's check that replay acts (see the module's docstring); never on a real run."""


def _renamed(indices: torch.Tensor, experts: int) -> torch.Tensor:
    return (indices + 1) % experts if os.environ.get(RENAME) == "1" else indices


def _unrenamed(indices: torch.Tensor, experts: int) -> torch.Tensor:
    return (indices - 1) % experts if os.environ.get(RENAME) == "1" else indices


def bshd_rows(rows: torch.Tensor, lengths: list[int], padded: int) -> torch.Tensor:
    """Packed rows ([sum(lengths), ...], sequences one after another) -> the [S, B] order megatron-core's router reads
    ([S * B, ...], token t of sequence b at row t * B + b), zeros (False) at padding."""
    if sum(lengths) != rows.shape[0] or max(lengths) > padded:
        raise MegatronShimError(f"verl-dppo's Megatron CPU shim (r3_bshd): {rows.shape[0]} route rows for sequences "
                                f"of {lengths} tokens padded to {padded}")
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
        raise MegatronShimError(f"verl-dppo's Megatron CPU shim (r3_bshd): the router routes {rows} tokens, not a "
                                f"multiple of the batch's {count} sequences (sequence parallelism is off on the CPU)")
    indices = _renamed(bshd_rows(indices, lengths, rows // count), scores.shape[1])
    if mask is not None:
        mask = bshd_rows(mask, lengths, rows // count)
    if backward:
        router.replay_backward_list[0], router.replay_backward_mask_list[0] = indices, mask
    else:
        router.target_topk_idx, router.target_replay_mask = indices, mask
    return indices, mask


def _report(scores, topk, replayed, mask, used, compute_topk) -> None:
    """Once per process, at the first replay: the rows replayed; on how many the experts the router hands on (`used`)
    are the replayed ones; on how many its own choice (the trainer's weights) differs from those; and on how many
    its own choice equals the rollout's route (see the module's docstring)."""
    from verl_dppo.plugin.log_once import warn_once

    _, native = compute_topk(scores, topk)
    rows = (mask.bool() if mask is not None else torch.ones(scores.shape[0], dtype=torch.bool)).to(native.device)
    replayed = replayed.to(native.device)

    def same(a, b):
        return (a.sort(-1).values == b.sort(-1).values).all(-1)[rows]

    used_replayed = same(used.to(native.device), replayed)
    differs = ~same(native, replayed)
    agrees = same(native, _unrenamed(replayed, scores.shape[1]))
    renamed = " (experts renamed e -> e+1 mod E before replay: " + RENAME + ")" if os.environ.get(RENAME) == "1" else ""
    warn_once("r3_bshd", "verl-dppo: R3 on the CPU's BSHD batches: the router replays the rollout's experts on %d of "
              "%d rows%s; the update uses the replayed experts on %d of them; the router's own choice differs from "
              "them on %d and agrees with the rollout's route on %d", int(rows.sum()), rows.numel(), renamed,
              int(used_replayed.sum()), int(differs.sum()), int(agrees.sum()))


def piece_r3_bshd() -> None:
    engine = importlib.import_module("verl.workers.engine.megatron.transformer_impl")
    utils = importlib.import_module("verl.utils.megatron.router_replay_utils")
    replay = target("verl.utils.megatron.router_replay_patch", "RouterReplay")
    original_set = target(engine.__name__, "set_router_replay_data")

    @functools.wraps(original_set)
    def set_router_replay_data(layers_topk_idx, attention_mask, tf_config, vp_rank=None, replay_mask=None,
                               local_cp_size=None, model=None):
        original_set(layers_topk_idx, attention_mask, tf_config, vp_rank, replay_mask=replay_mask,
                     local_cp_size=local_cp_size, model=model)
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
        laid_out = _to_bshd(self, scores)
        result = original_get(self, scores, topk, *args, **kwargs)
        if laid_out is not None and not _REPORTED and kwargs.get("default_compute_topk") is not None:
            _REPORTED.append(True)  # verl passes its routing (and the group settings) by keyword
            compute = functools.partial(kwargs["default_compute_topk"], num_groups=kwargs.get("num_groups"),
                                        group_topk=kwargs.get("group_topk"))
            _report(scores, topk, *laid_out, result[1], compute)
        return result

    replay.get_replay_topk = get_replay_topk
