"""The `hf` rollout's generation engine: a transformers causal LM generating batches of requests with a KV cache.

Requests that arrive together are generated together: `generate` queues a request and a scheduler task takes every
request queued by then (up to `max_num_seqs`) into one batch: one left-padded prefill, then one decode step per
token for the whole batch, each step in a worker thread so that the event loop keeps answering (new requests
queue for the next batch; aborts stop a request at the next step and return its tokens so far).

Sampling follows vLLM (`verl_dppo.rehearsal.hf_rollout.sampling`: the settings it accepts and the draw).

Reproducible: each request draws its noise from its own generator, seeded from the rollout seed, the weight
version, the sample's identity in the run (its prompt's dataset index, which of the prompt's n samples it is, and
whether it validates: handed on by the plugin's patch of `LLMServerClient.generate`), the prompt, and how many times
that (identity, prompt) was seen at that version on this server; so the samples of a prompt are distinct draws on any
number of replicas, and a run restarted from a checkpoint samples what the uninterrupted run sampled, whatever the
order the requests arrive in. Without an identity (a caller other than verl's agent loop), the n samples of a prompt
are told apart by their order of arrival on one server.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from verl_dppo.rehearsal.hf_rollout.sampling import HFRolloutError, SamplingSettings, parse_sampling_params, sample_next
from verl_dppo.rehearsal.hf_rollout.weights import WeightTargets

__all__ = [
    "SamplingSettings",
    "GenerationResult",
    "HFGenerationEngine",
    "parse_sampling_params",
    "sample_next",
    "HFRolloutError",
]

logger = logging.getLogger("verl_dppo")


@dataclass
class GenerationResult:
    token_ids: list[int]
    log_probs: Optional[list[float]]
    stop_reason: str  # "completed" or "aborted"
    topk_ids: Optional[np.ndarray] = None  # [T, K] int64
    topk_logprobs: Optional[np.ndarray] = None  # [T, K] float32
    routed_experts: Optional[np.ndarray] = None  # [prompt + T - 1, layers, top-k] int16, as vLLM returns them


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    settings: SamplingSettings
    topk: Optional[int]
    rng: torch.Generator
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[np.ndarray] = field(default_factory=list)
    topk_lps: list[np.ndarray] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    aborted: bool = False
    done: bool = False


class HFGenerationEngine:
    """Batches of requests through one transformers model; one instance per rollout server."""

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: list[int],
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        pad_token_id: int = 0,
        record_routes: bool = False,
    ):
        self.model = model
        self._routers = _routers_to_record(model) if record_routes else None
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max(1, max_num_seqs)
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.version: Optional[int] = None
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._seen: dict[tuple, int] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._scheduler: Optional[asyncio.Task] = None
        self.batch_sizes: list[int] = []  # size of every batch generated, for tests and diagnostics
        self._weights = WeightTargets(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------------------------------------ requests

    def _request_seed(self, prompt_ids: list[int], settings: SamplingSettings, sample: Optional[int]) -> int:
        if settings.seed is not None:
            return settings.seed
        sample = -1 if sample is None else int(sample)
        key = (self.version, sample, tuple(prompt_ids))
        occurrence = self._seen.get(key, 0)
        self._seen[key] = occurrence + 1
        digest = hashlib.blake2b(
            np.asarray(
                [self.seed, -1 if self.version is None else self.version, sample, occurrence, *prompt_ids],
                dtype=np.int64,
            ).tobytes(),
            digest_size=8,
        ).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)

    async def generate(
        self,
        prompt_ids: list[int],
        settings: SamplingSettings,
        request_id: str,
        topk: Optional[int] = None,
        sample: Optional[int] = None,
    ) -> GenerationResult:
        """Queue one request; `sample` is its identity in the run (patches/agent_loop.sample_identity): with it, its
        draws depend neither on the order in which the samples of one prompt arrive nor on the replica serving it."""
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise HFRolloutError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the model's context of "
                f"{self.max_model_len} tokens: lower data.max_prompt_length or raise actor_rollout_ref.rollout."
                "max_model_len (at most the model's max_position_embeddings)"
            )
        if settings.max_tokens < 1:
            raise HFRolloutError(f"max_tokens={settings.max_tokens}: a request must allow at least one token")
        settings = SamplingSettings(**{**settings.__dict__, "max_tokens": min(settings.max_tokens, room)})
        rng = torch.Generator().manual_seed(self._request_seed(prompt_ids, settings, sample))
        request = _Request(
            request_id, list(prompt_ids), settings, topk, rng, asyncio.get_running_loop().create_future()
        )
        self._queue.append(request)
        self._ensure_scheduler()
        self._wakeup.set()
        return await request.future

    def abort(self, request_id: Optional[str] = None) -> list[str]:
        """Mark one request (or, with None, every queued and running one) aborted; each returns its tokens so far
        at the next step. Returns the ids marked."""
        marked = []
        for request in [*self._running, *self._queue]:
            if not request.done and (request_id is None or request.request_id == request_id):
                request.aborted = True
                marked.append(request.request_id)
        if self._queue and self._loop is not None:
            self._wakeup.set()
        return marked

    async def wait_idle(self) -> None:
        while self._running or self._queue:
            await asyncio.sleep(0.005)

    # ------------------------------------------------------------------------------------------------ weights

    async def load_weights(self, named_tensors, version: Optional[int] = None, lora: Optional[dict] = None) -> int:
        """Copy (name, tensor) pairs into the model, in the names vLLM takes (Hugging Face names, LoRA's base-layer
        names, per-expert MoE names: `weights.WeightTargets`); `lora` marks an adapter sync's tensors, merged at
        `finish_weights`. Returns how many tensors were taken; an unknown name raises."""
        self._bind_loop()
        async with self._model_lock:
            count = self._weights.load(named_tensors, lora)
            if version is not None:
                self.set_version(version)
            return count

    async def finish_weights(self, lora: Optional[dict] = None) -> int:
        """The push is complete: merge an adapter sync's LoRA tensors into the weights; returns how many merged."""
        self._bind_loop()
        async with self._model_lock:
            return self._weights.finish(lora)

    def set_version(self, version: Optional[int]) -> None:
        if version != self.version:
            self._seen.clear()
        self.version = version

    # ------------------------------------------------------------------------------------------------ scheduler

    def _bind_loop(self) -> None:
        """The scheduler, its event and the model lock belong to the running event loop (one in a Ray actor; each
        asyncio.run of a caller outside Ray brings its own)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._scheduler = loop, None
            self._wakeup, self._model_lock = asyncio.Event(), asyncio.Lock()

    def _ensure_scheduler(self) -> None:
        self._bind_loop()
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = self._loop.create_task(self._schedule())

    async def _schedule(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(0.002)  # requests sent together arrive a few event-loop turns apart: take them all
            while self._queue:
                batch, self._queue = self._queue[: self.max_num_seqs], self._queue[self.max_num_seqs :]
                self._running = batch
                try:
                    async with self._model_lock:
                        await self._run_batch(batch)
                except Exception as error:  # every caller gets the error instead of a hang
                    logger.exception("hf rollout: a generation batch failed")
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(error)
                finally:
                    self._running = []

    def _finish(self, request: _Request) -> None:
        request.done = True
        if request.future.done():
            return
        has_topk = request.topk and request.tokens
        routes = np.concatenate(request.routes) if self._routers is not None and request.routes else None
        request.future.set_result(
            GenerationResult(
                routed_experts=routes,
                token_ids=list(request.tokens),
                log_probs=list(request.logprobs) if request.settings.logprobs else None,
                stop_reason="aborted" if request.aborted else "completed",
                topk_ids=np.stack(request.topk_ids).astype(np.int64) if has_topk else None,
                topk_logprobs=np.stack(request.topk_lps).astype(np.float32) if has_topk else None,
            )
        )

    async def _run_batch(self, batch: list[_Request]) -> None:
        live = [r for r in batch if not r.aborted]
        for request in batch:
            if request.aborted:
                self._finish(request)
        if not live:
            return
        self.batch_sizes.append(len(live))
        device = self.device
        width = max(len(r.prompt_ids) for r in live)
        input_ids = torch.full((len(live), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(live), width), dtype=torch.long)
        for i, request in enumerate(live):  # left padding: every row's next token is at the last column
            input_ids[i, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[i, width - len(request.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        temperature = torch.tensor([r.settings.temperature for r in live], dtype=torch.float32, device=device)
        top_k = torch.tensor([r.settings.top_k for r in live], dtype=torch.long, device=device)
        top_p = torch.tensor([r.settings.top_p for r in live], dtype=torch.float32, device=device)
        k = max((r.topk or 0) for r in live)
        state = {"cache": None, "mask": mask, "positions": (mask.cumsum(-1) - 1).clamp_min(0), "ids": input_ids}
        steps = max(r.settings.max_tokens for r in live)
        for step in range(steps):
            tokens, logprobs, topk, routes = await asyncio.to_thread(
                self._step, state, temperature, top_k, top_p, [r.rng for r in live], k
            )
            tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
            if topk is not None:
                topk_ids, topk_lps = topk[0].cpu().numpy(), topk[1].float().cpu().numpy()
            for i, request in enumerate(live):
                if request.done:
                    continue
                if request.aborted:  # aborted while this step ran: its token is not returned, nor the route of
                    self._finish(request)  # the token it fed (vLLM's rows: prompt + T - 1; verl's resume re-feeds it)
                    continue
                if routes is not None:  # the routes of the tokens this step fed: the prompt, then the last token
                    request.routes.append(routes[i, width - len(request.prompt_ids) :] if step == 0 else routes[i])
                token = tokens_l[i]
                request.tokens.append(token)
                request.logprobs.append(logprobs_l[i])
                if request.topk:
                    request.topk_ids.append(topk_ids[i, : request.topk])
                    request.topk_lps.append(topk_lps[i, : request.topk])
                stops = request.settings.stop_token_ids + (() if request.settings.ignore_eos else self.eos_token_ids)
                if token in stops or len(request.tokens) >= request.settings.max_tokens:
                    self._finish(request)
            if all(r.done for r in live):
                return
            state["ids"] = tokens[:, None]
            state["mask"] = torch.cat([state["mask"], torch.ones_like(state["ids"])], dim=-1)
            state["positions"] = state["positions"][:, -1:] + 1
        for request in live:
            self._finish(request)

    @torch.no_grad()
    def _step(self, state: dict, temperature, top_k, top_p, generators: list, k: int):
        from transformers import DynamicCache

        if state["cache"] is None:
            state["cache"] = DynamicCache()
        captured: dict[int, torch.Tensor] = {}
        hooks = [
            router.register_forward_hook(lambda _m, _i, out, index=index: captured.__setitem__(index, out[2]))
            for index, router in (self._routers or [])
        ]
        try:
            out = self.model(
                input_ids=state["ids"],
                attention_mask=state["mask"],
                position_ids=state["positions"],
                past_key_values=state["cache"],
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            for hook in hooks:
                hook.remove()
        state["cache"] = out.past_key_values
        routes = None
        if self._routers is not None:  # [rows, layers, top-k] by absolute layer index (zeros where a layer is dense)
            rows, per_token = state["ids"].numel(), next(iter(captured.values())).shape[-1]
            routes = np.zeros((rows, int(self.model.config.num_hidden_layers), per_token), dtype=np.int16)
            for index, experts in captured.items():
                routes[:, index] = experts.reshape(rows, per_token).cpu().numpy()
            routes = routes.reshape(*state["ids"].shape, *routes.shape[1:])
        logits = out.logits[:, -1, :].float()
        # Each row's noise from its request's own generator (on the CPU: the same draws on any device).
        noise = torch.stack([torch.empty(logits.shape[-1]).exponential_(generator=g) for g in generators])
        return (*sample_next(logits, temperature, top_k, top_p, noise.to(logits.device), k or None), routes)


def _routers_to_record(model: torch.nn.Module) -> list:
    """The model's MoE routers, whose choices the rollout returns as vLLM's `enable_return_routed_experts` does
    (actor_rollout_ref.rollout.enable_rollout_routing_replay: what R3 on the FSDP engine replays)."""
    from verl_dppo.plugin.moe.router_replay import ROUTER_CLASSES, routers_of

    routers = routers_of(model)
    if not routers:
        raise HFRolloutError(
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True, but the model has no MoE "
            f"router to record ({', '.join(ROUTER_CLASSES)}): a dense model routes nothing"
        )
    return routers
