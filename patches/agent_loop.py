"""Patch of `verl.experimental.agent_loop.agent_loop` (and the token builders' `align_response_metadata`): carry
the Top-K rows from the servers' `TokenOutput.extra_fields` to training-batch tensors aligned with `responses`.

verl 0.9.1's agent loops pass `extra_fields` through untouched (single turn: never truncated to the response
length; tool loop: only the first turn's are kept), so the top-K rows are not carried in `extra_fields` at all:

1. `LLMServerClient.generate` (every server call an agent loop makes, every turn, every resumed partial
   rollout) pops the rows out of `extra_fields` and appends (generated token ids, top-K ids, top-K log-probs) to
   the trajectory (a context variable set by the `AgentLoopWorker._run_agent_loop` patch; each trajectory runs in
   its own asyncio task).
   It also notes the `global_steps` of every reply that generated a token: `as_dict` (step 3) stores the
   oldest as `extra_fields[staleness.SAMPLED_VERSION]`, the version the staleness diagnostics measure the lag from
   (verl's `min_global_steps` takes the first reply's, even an abort that generated nothing).
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

`llm_server.sync_rollout_config` (patched into `LLMServerManager.__init__`, on the driver) hands K to the servers.
Why no extension point: verl 0.9.1's agent loops keep no per-token `extra_fields` (only distillation's named fields).
A verl with `align_response_metadata` taking arbitrary per-token metadata (or carrying `extra_fields` per token)
would make steps 1-3 unnecessary.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
from typing import Any, Optional

import numpy as np
import torch

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.patches._server_common import EXTRA_IDS, EXTRA_LOGPROBS, RolloutTopKError
from verl_dppo.plugin.staleness import SAMPLED_VERSION
from verl_dppo.plugin.topk_mode import TOPK_IDS, TOPK_LOGPROBS

__all__ = [
    "record_turn",
    "trajectory",
    "sample_identity",
    "current_sample",
    "align_topk_to_response",
    "patch_agent_loop",
]

logger = logging.getLogger("verl_dppo")


_TRAJECTORY: contextvars.ContextVar[Optional["_Trajectory"]] = contextvars.ContextVar(
    "verl_dppo_topk_trajectory", default=None
)


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
        self.sampling_versions: list[int] = []  # `global_steps` of each reply that generated a token
        self.merged_turns = 0  # replies the builder has already merged into the response
        self.layouts: list[tuple[list, list]] = []  # (response_mask, layout) after each builder merge, newest last
        self.sample: Optional[int] = None  # the sample's identity in the run (sample_identity), for the hf rollout

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
                np.array_equal(self.turns[i][0], wanted[offsets[i] - offsets[first] : offsets[i + 1] - offsets[first]])
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
            rows = self.rows_of_merge(merged[len(merged) - merge_result.appended_token_count :])
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


def sample_identity(trajectory_info: Any, kwargs: dict) -> Optional[int]:
    """A sample's identity in the run, the same on every replica, for any number of agent-loop workers and after a
    resume: its prompt's dataset index (verl's `trajectory["sample_index"]`), which of the prompt's samples it is,
    the step that asked for it, and whether it validates.

    Which sample: verl's v1 agent loop passes `session_id` (0 .. n-1). The legacy one (`trainer.use_v1=False`)
    repeats each prompt n times, splits the batch into one contiguous chunk per agent-loop worker and counts
    `rollout_n` within a chunk, so a prompt whose copies straddle two chunks counts from 0 again in the second
    (two samples, one identity); there the sample's `priority` tells them apart too: its position in the whole
    batch, which verl's `AgentLoopManager.generate_sequences` sets (np.arange) before it splits the batch (the
    identity then holds for a given number of workers, as a resume keeps it). In the v1 loop `priority` is 0 for
    every sample: the session id alone tells them apart.
    The step: the hf rollout seeds from the weight version as well, which is the same for every step before the
    first versioned weight push (and for several steps under separate_async), so a prompt drawn again at a later
    step on another replica (whose count of that prompt starts at 0) would repeat the earlier draw without it."""
    if not isinstance(trajectory_info, dict) or "sample_index" not in trajectory_info:
        return None
    index = _scalar(trajectory_info["sample_index"])
    if "session_id" in kwargs:
        draw = (_scalar(kwargs["session_id"]),)
    else:  # the legacy agent loop
        draw = (_scalar(trajectory_info.get("rollout_n", 0)), _scalar(kwargs.get("priority", -1)))
    step = _scalar(trajectory_info.get("step", -1))
    key = repr((index, draw, step, bool(trajectory_info.get("validate", False)))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def _scalar(value: Any) -> Any:
    """A plain Python value from a tensor, numpy scalar or one-element array (verl passes all three); the first of a
    batch-wide array (verl's v1 loop may hand the batch's global_steps, one per row, all equal)."""
    if hasattr(value, "reshape") and getattr(value, "size", None) not in (None, 1) and not callable(value.size):
        return _scalar(value.reshape(-1)[0]) if value.size else None
    if hasattr(value, "numel") and value.numel() != 1:
        return _scalar(value.reshape(-1)[0]) if value.numel() else None
    return value.item() if hasattr(value, "item") else value


def current_sample() -> Optional[int]:
    """The identity of the sample whose agent loop runs in this task (None outside an agent loop)."""
    current = _TRAJECTORY.get()
    return None if current is None else current.sample


class trajectory:  # noqa: N801 (a context manager, used like a function)
    """`with trajectory(): ...` collects the top-K rows of every server call made inside (one agent-loop run)."""

    def __init__(self, sample: Optional[int] = None):
        self.sample = sample

    def __enter__(self) -> _Trajectory:
        self._token = _TRAJECTORY.set(_Trajectory())
        _TRAJECTORY.get().sample = self.sample
        return _TRAJECTORY.get()

    def __exit__(self, *exc):
        _TRAJECTORY.reset(self._token)


def record_turn(token_output: Any) -> None:
    """Note the version of a server reply that generated tokens, and move its top-K rows out of extra_fields, into
    the current trajectory (if one is open)."""
    extra = getattr(token_output, "extra_fields", None)
    current = _TRAJECTORY.get()
    if not extra or current is None:
        return  # not inside an agent loop: leave the reply as the server sent it
    # An abort that generated nothing carries the version it waited under, not one that sampled the response.
    if token_output.token_ids is not None and len(token_output.token_ids) and extra.get("global_steps") is not None:
        current.sampling_versions.append(int(extra["global_steps"]))
    if EXTRA_IDS not in extra:
        return
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


def patch_agent_loop(module: Any) -> None:
    def make_run(original_run):
        async def _run_agent_loop(self, *args, **kwargs):
            # verl's signature: (sampling_params, trajectory, *, agent_name, trace, **kwargs); the v1 agent loop
            # passes `trajectory` by keyword, the legacy one by position.
            info = kwargs["trajectory"] if "trajectory" in kwargs else (args[1] if len(args) > 1 else None)
            with trajectory(sample_identity(info, kwargs)):
                return await original_run(self, *args, **kwargs)

        return _run_agent_loop

    def make_as_dict(original_as_dict):
        def as_dict(self):
            output = original_as_dict(self)
            current = _TRAJECTORY.get()
            if current is not None and current.sampling_versions:
                output["extra_fields"][SAMPLED_VERSION] = min(current.sampling_versions)
            aligned = align_topk_to_response(self.response_ids, self.response_mask, current)
            if aligned is not None:
                output[TOPK_IDS], output[TOPK_LOGPROBS] = aligned
            return output

        return as_dict

    def make_align(original_align):
        def align_response_metadata(
            self, merge_result, response_mask, response_logprobs=None, *, assistant_logprobs=None
        ):
            aligned_mask, aligned_logprobs = original_align(
                self, merge_result, response_mask, response_logprobs, assistant_logprobs=assistant_logprobs
            )
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
