"""Batch plumbing of Top-K DPPO: from the servers' `TokenOutput.extra_fields` to training-batch tensors.

verl 0.9.1's agent loops pass `extra_fields` through untouched (single turn: never truncated to the response
length; tool loop: only the first turn's are kept), so the top-K rows are not carried in `extra_fields` at all:

1. `LLMServerClient.generate` (every server call an agent loop makes, every turn, every resumed partial
   rollout) pops the rows out of `extra_fields` and appends (generated token ids, top-K ids, top-K log-probs) to
   the trajectory (a context variable set by the `AgentLoopWorker._run_agent_loop` patch; each trajectory runs in
   its own asyncio task).
2. `ContinuousTokenBuilder.align_response_metadata`: verl's agent loops build the response with a token builder
   that edits the stream at turn boundaries (GLM drops a generated `<|observation|>` / `<|user|>` and re-renders it
   as context; Qwen, MiniMax, Gemma4, DeepSeek-V4 insert boundary tokens; DeepSeek drops a context token), and this
   method applies those edits to `response_mask` / `response_logprobs`. The patch runs verl's same method once more
   on a list of row numbers in place of the log-probs, so each row goes wherever verl puts its token's log-prob.
3. `AgentLoopOutput.as_dict` (v1 trainer, the TransferQueue path) lays the rows onto the response where step 2 put
   them (zero rows elsewhere: tool replies, re-rendered and inserted boundary tokens, all with response_mask 0),
   truncated to the response length. The generated token ids must equal the response tokens at those positions,
   else it raises: never a silently shifted top-K. An agent loop that builds its response without a token builder
   gets the j-th generated token's row at the j-th position with response_mask = 1.
   It adds `rollout_topk_ids` [response_len, K] int64 and `rollout_topk_logprobs` [response_len, K] float32.
4. `construct_minimal_padding_template` (v1 batch padding) resizes the two fields of a synthetic padding sample to
   its one-token response (zeros; its response_mask is 0, so the hook never reads them).

`sync_rollout_config` (patched into `LLMServerManager.__init__`, on the driver) hands K to the servers.
A verl with `align_response_metadata` taking arbitrary per-token metadata (or carrying `extra_fields` per token)
would make steps 1-3 unnecessary.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, Optional

import numpy as np
import torch

from verl_dppo.adapter.topk_actor import TOPK_IDS, TOPK_LOGPROBS, is_topk_mode
from verl_dppo.adapter.topk_import_hook import patch_once
from verl_dppo.adapter.topk_rollout import CUSTOM_KEY, EXTRA_IDS, EXTRA_LOGPROBS, RolloutTopKError

__all__ = [
    "sync_rollout_config",
    "record_turn",
    "trajectory",
    "align_topk_to_response",
    "patch_llm_server",
    "patch_agent_loop",
    "patch_padding_utils",
]

logger = logging.getLogger("verl_dppo")

VLLM_DEFAULT_MAX_LOGPROBS = 20

_TRAJECTORY: contextvars.ContextVar[Optional["_Trajectory"]] = contextvars.ContextVar("verl_dppo_topk_trajectory",
                                                                                     default=None)


def sync_rollout_config(config: Any) -> Optional[int]:
    """Driver side: copy K = actor.policy_loss.topk into rollout.custom.dppo_topk and check the rollout settings.

    Returns K, or None when the loss mode is not a Top-K mode (then nothing is touched).
    """
    from omegaconf import open_dict

    arr = config.actor_rollout_ref
    policy_loss = arr.actor.get("policy_loss", None)
    mode = policy_loss.get("loss_mode", None) if policy_loss is not None else None
    if not is_topk_mode(mode):
        return None
    k = policy_loss.get("topk", None)
    if k is None:
        raise ValueError(
            f"{mode} needs policy_loss.topk: set actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig "
            "(topk defaults to 20; +actor_rollout_ref.actor.policy_loss.topk=K to change it)"
        )
    k = int(k)
    rollout = arr.rollout
    if rollout.name not in ("vllm", "sglang"):
        raise ValueError(f"{mode} captures the top-K in vLLM or SGLang: set actor_rollout_ref.rollout.name=vllm or sglang")
    if not rollout.get("calculate_log_probs", False):
        raise ValueError(f"{mode} needs the rollout's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=True")
    if not config.get("trainer", {}).get("use_v1", True):
        raise ValueError(f"{mode} carries the top-K through verl's v1 trainer only: set trainer.use_v1=True")
    if arr.model.get("use_fused_kernels", False):
        raise ValueError(f"{mode} needs the actor's logits: set actor_rollout_ref.model.use_fused_kernels=False")
    logprobs_mode = rollout.get("logprobs_mode", "processed_logprobs")
    if logprobs_mode is not None and "logprobs" not in str(logprobs_mode):
        raise ValueError(
            f"{mode} needs log-probs from the rollout, got rollout.logprobs_mode={logprobs_mode}: set "
            "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs"
        )
    with open_dict(rollout):
        custom = dict(rollout.get("custom", None) or {})
        if custom.get(CUSTOM_KEY, k) != k:
            raise ValueError(
                f"actor_rollout_ref.rollout.custom.{CUSTOM_KEY}={custom[CUSTOM_KEY]} disagrees with "
                f"actor_rollout_ref.actor.policy_loss.topk={k}: set only policy_loss.topk (the plugin copies it)"
            )
        custom[CUSTOM_KEY] = k
        rollout.custom = custom
        if rollout.name == "vllm":
            if rollout.get("engine_kwargs", None) is None:
                rollout.engine_kwargs = {}
            if rollout.engine_kwargs.get("vllm", None) is None:
                rollout.engine_kwargs.vllm = {}
            current = rollout.engine_kwargs.vllm.get("max_logprobs", None)
            if current is None:
                if k > VLLM_DEFAULT_MAX_LOGPROBS:
                    rollout.engine_kwargs.vllm.max_logprobs = k
            elif int(current) < k:
                raise ValueError(
                    f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs={current} < policy_loss.topk={k}: "
                    f"raise it to at least {k} (or leave it unset: the plugin sets it)"
                )
    return k


# ------------------------------------------------------------------------------------------ per-trajectory rows


class _Trajectory:
    """One agent-loop run: the engine's top-K rows, and where verl's token builder put each generated token.

    A layout is a list parallel to `response_mask`: at each response position, the 1-based number of the engine's
    row for the token there (rows of all replies concatenated, in order), or 0 where no engine row belongs (prompt-
    side context, boundary tokens the builder inserted). verl's own `align_response_metadata` edits it, so it moves
    exactly as `response_logprobs` does.
    """

    def __init__(self):
        self.turns: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (generated ids, top-K ids, log-probs)
        self.merged_turns = 0  # replies the builder has already merged into the response
        self.layouts: list[tuple[list, list]] = []  # (response_mask, layout) after each builder merge, newest last

    def generated(self) -> np.ndarray:
        return np.concatenate([t[0] for t in self.turns])

    def layout_before(self, response_mask: list) -> list:
        """The layout of the response_mask verl passes in: the one a previous merge returned with it."""
        for mask, layout in reversed(self.layouts):
            if mask is response_mask:
                return layout
        for mask, layout in reversed(self.layouts):
            if list(mask) == list(response_mask):
                return layout
        return [0] * len(response_mask)  # no builder merge made this mask: no engine rows known in it

    def rows_of_merge(self, assistant_token_ids: list) -> list[int]:
        """Row numbers of the assistant tokens verl merges: the next replies not merged yet, whole and in order
        (several replies when a partial rollout was resumed); a reply that was never merged is skipped."""
        wanted = np.asarray(assistant_token_ids, dtype=np.int64)
        offsets = np.cumsum([0] + [t[0].size for t in self.turns])
        for first in range(self.merged_turns, len(self.turns) + 1):
            last = first
            while last < len(self.turns) and offsets[last] - offsets[first] < wanted.size:
                last += 1
            if offsets[last] - offsets[first] == wanted.size and all(
                np.array_equal(self.turns[i][0], wanted[offsets[i] - offsets[first]: offsets[i + 1] - offsets[first]])
                for i in range(first, last)
            ):
                self.merged_turns = last
                return list(range(int(offsets[first]) + 1, int(offsets[last]) + 1))
        raise RolloutTopKError(
            f"verl's token builder merged {wanted.size} assistant tokens that are not the tokens the rollout engine "
            f"generated in its next replies: the top-K rows cannot be aligned with `responses` (an agent loop must "
            "merge the engine's token ids unchanged)"
        )

    def follow(self, builder: Any, original_align, merge_result: Any, response_mask: list, aligned_mask: list):
        """Apply to the layout the edits verl just applied to response_mask / response_logprobs (one source of truth:
        verl's own `align_response_metadata`, with row numbers in place of log-probs)."""
        if not self.turns:
            return  # Top-K is off (no reply carried rows): nothing to follow
        layout = self.layout_before(response_mask)
        rows = None
        if merge_result.kind == "assistant":
            merged = merge_result.token_ids
            rows = self.rows_of_merge(merged[len(merged) - merge_result.appended_token_count:])
        _, layout = original_align(builder, merge_result, response_mask, layout, assistant_logprobs=rows)
        self.layouts.append((aligned_mask, [int(slot) for slot in layout]))

    def layout_of_response(self, response_mask: list) -> Optional[list]:
        """The layout of the final response: the newest merge whose mask the response's mask is a prefix of (verl
        truncates to response_length, and `ToolAgentLoop` discards a context merge that would overflow it)."""
        if not self.layouts:
            return None
        n = len(response_mask)
        for mask, layout in reversed(self.layouts):
            if len(mask) >= n and list(mask[:n]) == list(response_mask):
                return layout[:n]
        raise RolloutTopKError(
            "the response's response_mask is not one verl's token builder produced (the agent loop edited it after "
            "`align_response_metadata`): the top-K rows cannot be aligned with `responses`"
        )


class trajectory:  # noqa: N801 (a context manager, used like a function)
    """`with trajectory(): ...` collects the top-K rows of every server call made inside (one agent-loop run)."""

    def __enter__(self) -> _Trajectory:
        self._token = _TRAJECTORY.set(_Trajectory())
        return _TRAJECTORY.get()

    def __exit__(self, *exc):
        _TRAJECTORY.reset(self._token)


def record_turn(token_output: Any) -> None:
    """Move a server reply's top-K rows out of extra_fields into the current trajectory (if one is open)."""
    extra = getattr(token_output, "extra_fields", None)
    if not extra or EXTRA_IDS not in extra:
        return
    current = _TRAJECTORY.get()
    if current is None:
        return  # not inside an agent loop: leave the reply as the server sent it
    ids, logprobs = extra.pop(EXTRA_IDS), extra.pop(EXTRA_LOGPROBS)
    token_ids = np.asarray(list(token_output.token_ids), dtype=np.int64)
    if ids.shape[0] != token_ids.shape[0]:
        raise RolloutTopKError(f"{ids.shape[0]} top-K rows for {token_ids.shape[0]} generated tokens")
    current.turns.append((token_ids, np.asarray(ids), np.asarray(logprobs)))


def align_topk_to_response(response_ids, response_mask, current: Optional[_Trajectory]):
    """Top-K rows laid onto the response, as [response_len, K] int64 ids and float32 log-probs (None: Top-K off).

    Where verl's token builder made the response, each generated token's row goes where the builder's edits put
    the token (the positions where `response_logprobs` holds its log-prob); a loop that builds its response without
    a builder gets the j-th generated token's row at the j-th position with response_mask = 1.
    """
    if current is None or not current.turns:
        return None
    generated = current.generated()
    ids = np.concatenate([t[1] for t in current.turns])
    logprobs = np.concatenate([t[2] for t in current.turns])
    response_ids = np.asarray(response_ids, dtype=np.int64)
    mask = np.asarray(response_mask)
    layout = current.layout_of_response(list(response_mask))
    if layout is None:
        positions = np.nonzero(mask)[0]
        rows = np.arange(positions.size)
        if positions.size > generated.size or not np.array_equal(response_ids[positions], generated[: positions.size]):
            raise RolloutTopKError(
                "the response's tokens with response_mask=1 are not the tokens the rollout engine generated, in order, "
                "and the agent loop did not build the response with verl's token builder: the top-K rows cannot be "
                "aligned with `responses`; Top-K DPPO needs agent loops that merge the engine's token ids unchanged"
            )
    else:
        layout = np.asarray(layout, dtype=np.int64)
        positions = np.nonzero(layout)[0]
        rows = layout[positions] - 1
        missing = np.nonzero((mask != 0) & (layout == 0))[0]
        shifted = positions[response_ids[positions] != generated[rows]]
        if missing.size or shifted.size:
            where = int(missing[0]) if missing.size else int(shifted[0])
            raise RolloutTopKError(
                f"response position {where} holds a generated token without its own top-K row: the top-K rows "
                "cannot be aligned with `responses` (the agent loop changed the response after verl's token builder)"
            )
    k = ids.shape[1]
    out_ids = torch.zeros((response_ids.size, k), dtype=torch.int64)
    out_lps = torch.zeros((response_ids.size, k), dtype=torch.float32)
    out_ids[torch.from_numpy(positions)] = torch.from_numpy(ids[rows])
    out_lps[torch.from_numpy(positions)] = torch.from_numpy(logprobs[rows]).float()
    return out_ids, out_lps


# ----------------------------------------------------------------------------------------------------- patches


def patch_llm_server(module: Any) -> None:
    def make_init(original_init):
        def __init__(self, config, *args, **kwargs):
            from verl_dppo.adapter.run_config import check_run_config

            check_run_config(config)
            sync_rollout_config(config)
            original_init(self, config, *args, **kwargs)

        return __init__

    def make_generate(original_generate):
        async def generate(self, *args, **kwargs):
            output = await original_generate(self, *args, **kwargs)
            record_turn(output)
            return output

        return generate

    patch_once(module.LLMServerManager, "__init__", make_init)
    patch_once(module.LLMServerClient, "generate", make_generate)


def patch_agent_loop(module: Any) -> None:
    def make_run(original_run):
        async def _run_agent_loop(self, *args, **kwargs):
            with trajectory():
                return await original_run(self, *args, **kwargs)

        return _run_agent_loop

    def make_as_dict(original_as_dict):
        def as_dict(self):
            output = original_as_dict(self)
            aligned = align_topk_to_response(self.response_ids, self.response_mask, _TRAJECTORY.get())
            if aligned is not None:
                output[TOPK_IDS], output[TOPK_LOGPROBS] = aligned
            return output

        return as_dict

    def make_align(original_align):
        def align_response_metadata(self, merge_result, response_mask, response_logprobs=None, *,
                                     assistant_logprobs=None):
            aligned_mask, aligned_logprobs = original_align(self, merge_result, response_mask, response_logprobs,
                                                            assistant_logprobs=assistant_logprobs)
            current = _TRAJECTORY.get()
            if current is not None:
                current.follow(self, original_align, merge_result, response_mask, aligned_mask)
            return aligned_mask, aligned_logprobs

        return align_response_metadata

    # Every builder verl 0.9.1 ships inherits this one method (none overrides it), and verl's agent loops call it
    # after every merge; agent_loop imports the builders, so the class is loaded by now.
    from verl.utils.tokenizer.continuous_token import ContinuousTokenBuilder

    patch_once(module.AgentLoopWorker, "_run_agent_loop", make_run)
    patch_once(module.AgentLoopOutput, "as_dict", make_as_dict)
    patch_once(ContinuousTokenBuilder, "align_response_metadata", make_align)


def patch_padding_utils(module: Any) -> None:
    def make(original):
        def construct_minimal_padding_template(source_td, source_tag, eos_token_id):
            template_sample, template_tag = original(source_td, source_tag, eos_token_id)
            length = template_sample["responses"].shape[0]
            for key in (TOPK_IDS, TOPK_LOGPROBS):
                value = template_sample.get(key, None)
                if isinstance(value, torch.Tensor):
                    template_sample[key] = value.new_zeros((length, *value.shape[1:]))
            return template_sample, template_tag

        return construct_minimal_padding_template

    patch_once(module, "construct_minimal_padding_template", make)
