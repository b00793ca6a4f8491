"""The `hf` rollout server: the Ray actor verl's replica launches and its agent loop calls (token in, token out).

It answers what verl 0.9.1's `RolloutReplica`, `CheckpointEngineManager` and `LLMServerClient` call on a vLLM server
(`verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer`): `generate` -> `TokenOutput`, `wake_up`,
`sleep`, the KV-cache calls, `set_global_steps`, `wait_for_requests_to_drain`, `abort_all_requests` /
`resume_generation` (partial rollout: aborted requests return their tokens so far with stop_reason "aborted", and
requests arriving while generation is paused wait for the resume), `abort_request`, profiling no-ops; and the
weight push of the plugin's server adapter (`load_weights` per bucket, then `finish_weight_update`).

For the Top-K modes and TROLL the reply carries mu's top-K rows in `extra_fields` under the keys the vLLM/SGLang
patches use (`verl_dppo.plugin.rollout_fields`), so `patches/` carries them to the batch unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Optional

import torch

from verl_dppo.rehearsal.hf_rollout.engine import HFGenerationEngine, HFRolloutError, parse_sampling_params

__all__ = ["HFRolloutServer", "server_name"]

logger = logging.getLogger("verl_dppo")


def server_name(replica_rank: int, node_rank: int, suffix: str = "") -> str:
    """The Ray actor name of a server, which the server adapter of the same replica looks up."""
    return f"hf_server_{replica_rank}_{node_rank}{suffix}"


def _dtype(name: str) -> torch.dtype:
    name = str(name).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise HFRolloutError(
            f"actor_rollout_ref.rollout.dtype={name} is not a torch dtype (bfloat16, float16, float32)"
        )
    return dtype


class HFRolloutServer:
    """One transformers model answering verl's server calls; same code on CPU and CUDA (the platform's device)."""

    def __init__(
        self,
        config: Any,
        model_config: Any,
        rollout_mode: Any = None,
        replica_rank: int = 0,
        node_rank: int = 0,
        visible_devices: Optional[str] = None,
        device: Optional[str] = None,
    ):
        from verl.utils.config import omega_conf_to_dataclass

        if visible_devices:  # the GPU(s) of this replica's workers, before CUDA is initialised in this process
            from verl.utils.device import get_visible_devices_keyword

            os.environ[get_visible_devices_keyword()] = visible_devices
        self.config = omega_conf_to_dataclass(config)
        self.model_config = model_config
        self.rollout_mode = rollout_mode
        self.replica_rank, self.node_rank = replica_rank, node_rank
        self.global_steps: Optional[int] = None
        self._device = device
        self._paused = False
        self._rejecting = False
        self._resume = asyncio.Event()
        self._resume.set()
        self.engine: Optional[HFGenerationEngine] = None
        self._offloaded = False

    # ---------------------------------------------------------------------------------------------- lifecycle

    def _build(self) -> HFGenerationEngine:
        from transformers import AutoModelForCausalLM

        if self._device is None:
            from verl.utils.device import get_device_name

            self._device = get_device_name()
        device = torch.device("cuda", 0) if self._device == "cuda" else torch.device(self._device)
        path = getattr(self.model_config, "local_path", None) or self.model_config.path
        override = dict(getattr(self.model_config, "override_config", None) or {})
        model = (
            AutoModelForCausalLM.from_pretrained(
                path,
                dtype=_dtype(self.config.dtype),
                trust_remote_code=bool(self.model_config.trust_remote_code),
                attn_implementation=override.get("attn_implementation", "sdpa"),
            )
            .to(device)
            .eval()
        )
        hf_config = model.config
        context = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or None
        max_model_len = (
            self.config.max_model_len or context or (self.config.prompt_length + self.config.response_length)
        )
        eos = getattr(getattr(self.model_config, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        pad = getattr(hf_config, "pad_token_id", None)
        return HFGenerationEngine(
            model,
            eos_ids,
            int(max_model_len),
            int(self.config.max_num_seqs),
            int(self.config.seed),
            0 if pad is None else int(pad),
            record_routes=bool(self.config.get("enable_rollout_routing_replay", False)),
        )

    async def init_engine(self) -> None:
        if self.engine is None:
            self.engine = await asyncio.to_thread(self._build)

    def get_rollout_config(self):
        return self.config

    async def wake_up(self, tags: Optional[list[str]] = None):
        """Back on the device after `sleep` (weights come back; the KV cache lives per batch)."""
        if self._offloaded:
            self.engine.model.to(torch.device("cuda", 0) if self._device == "cuda" else self._device)
            self._offloaded = False

    async def sleep(self):
        """Hybrid mode on an accelerator: free the device for training (weights to host memory)."""
        if self._device != "cpu" and self.config.free_cache_engine and not self._offloaded:
            await self.engine.wait_idle()
            self.engine.model.to("cpu")
            self._offloaded = True
            torch.cuda.empty_cache()

    async def clear_kv_cache(self):
        return None  # the KV cache lives only while a batch generates

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps
        self.engine.set_version(global_steps)

    # ---------------------------------------------------------------------------------------------- weights

    async def load_weights(self, named_tensors: list, lora: Optional[dict] = None) -> int:
        """One bucket of the weight push: (name, tensor) pairs in the names vLLM takes; `lora` (an adapter sync's
        settings, `weights.lora_settings`) marks PEFT adapter tensors."""
        return await self.engine.load_weights(named_tensors, lora=lora)

    async def finish_weight_update(
        self, global_steps: Optional[int] = None, loaded: int = 0, lora: Optional[dict] = None
    ):
        merged = await self.engine.finish_weights(lora)
        if merged:
            from verl_dppo.plugin.log_once import warn_once

            warn_once(
                "hf lora",
                "verl-dppo hf rollout: LoRA adapter merged into %d weights (base + %g x B @ A) at every weight push",
                merged,
                lora["scaling"],
            )
        if global_steps is not None:
            await self.set_global_steps(global_steps)
        logger.info(
            "hf rollout %s: %d weight tensors loaded%s (version %s)",
            self.replica_rank,
            loaded,
            f", LoRA merged into {merged} weights" if merged else "",
            global_steps,
        )

    async def get_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights as the server generates with them (for checks of the weight push)."""
        return {name: t.detach().cpu().clone() for name, t in self.engine.model.state_dict().items()}

    # ---------------------------------------------------------------------------------------------- generation

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        **kwargs: Any,
    ):
        from verl.workers.rollout.replica import TokenOutput

        from verl_dppo.plugin.rollout_fields import SAMPLE_KWARG
        from verl_dppo.plugin.rollout_fields import EXTRA_IDS, EXTRA_LOGPROBS, rollout_topk, warn_truncated_sampling

        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise HFRolloutError(
                "the hf rollout generates from text only: image/video/audio inputs need "
                "actor_rollout_ref.rollout.name=vllm or sglang"
            )
        while self._paused:  # a weight push is under way: wait for resume_generation (or fail over)
            if self._rejecting:
                return TokenOutput(
                    token_ids=[],
                    log_probs=None,
                    stop_reason="aborted",
                    extra_fields={"global_steps": self.global_steps},
                )
            await self._resume.wait()
        prompt_ids = [int(t) for t in prompt_ids]
        default = min(
            self.config.response_length, self.config.prompt_length + self.config.response_length - len(prompt_ids)
        )
        params = dict(sampling_params)
        params.setdefault("ignore_eos", bool(self.config.get("ignore_eos", False)))  # as verl's vLLM server does
        settings = parse_sampling_params(params, max(1, default))
        k = rollout_topk(self.config)
        if k is not None:  # sampled log-prob of the truncated distribution, rows of the full one: vLLM's warning
            warn_truncated_sampling(params, "processed_logprobs")
        result = await self.engine.generate(prompt_ids, settings, request_id, topk=k, sample=kwargs.get(SAMPLE_KWARG))
        extra: dict[str, Any] = {"global_steps": self.global_steps}
        if k is not None and result.topk_ids is not None:
            extra[EXTRA_IDS], extra[EXTRA_LOGPROBS] = result.topk_ids, result.topk_logprobs
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            stop_reason=result.stop_reason,
            routed_experts=result.routed_experts,
            extra_fields=extra,
        )

    async def wait_for_requests_to_drain(self):
        await self.engine.wait_idle()

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Pause admission, stop every queued and running request (each returns its tokens so far), wait until
        none runs: after this the weights may change."""
        self._paused, self._rejecting = True, reject_request
        self._resume.clear()
        request_ids = self.engine.abort() if self.engine is not None else []
        if self.engine is not None:
            await self.engine.wait_idle()
        if request_ids:
            logger.info("hf rollout %s: aborted %d requests", self.replica_rank, len(request_ids))
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_generation(self):
        self._paused = self._rejecting = False
        self._resume.set()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        marked = self.engine.abort(request_id) if self.engine is not None else []
        if not marked:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        return {"aborted": True, "request_id": request_id}
