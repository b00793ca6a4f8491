"""Drive verl 0.9.1's real `ActorRolloutRefWorker` the way its v1 trainer does, with the plugin's loss modes.

Shared by the CPU end-to-end tests (`tests/e2e/`) and the GPU benchmark (`bench/gpu_real_worker.py`); the device and
the sizes are parameters. One training step here is what `PPOTrainer._step_once` (trainer/ppo/v1/trainer_base.py)
does for the actor, with the inference engine replaced by a bf16 copy of the policy:

    sync weights (engine.get_per_tensor_param) -> the bf16 copy samples, reporting mu(a) and mu's top-K per token
    -> reward -> [compute_log_prob unless bypass_mode] -> GRPO advantages (verl's core_algos) -> update_actor

The config of every run is composed from this project's recipes (`sanity_1p5b` x the method that uses the loss
mode, as `verl-dppo run ... --dry-run` composes it) plus overrides that shrink the model and the batch.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

# The one import of the plugin's recipe composition: update it here when the module moves.
from verl_dppo.launch.compose import compose_recipe, recipes_dir, validate_recipe

# The plugin's launch step on the driver (README, Top-K: "on the driver the plugin copies [K] into
# actor_rollout_ref.rollout.custom.dppo_topk"), which tells the rollout servers to report mu's top-K.
from verl_dppo.patches.llm_server import sync_rollout_config

SETUP = "sanity_1p5b"
PLUGIN_LOGGER = "verl_dppo"

__all__ = [
    "ModelSize",
    "RunShape",
    "TINY_MODEL",
    "GPU_MODEL",
    "TINY_MOE",
    "GPU_MOE",
    "R3_OVERRIDES",
    "plugin_loss_modes",
    "method_for_mode",
    "save_model",
    "compose_config",
    "init_distributed",
    "build_worker",
    "RolloutCopy",
    "Rollout",
    "Trainer",
    "LogCapture",
]


# ---------------------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """A Qwen3 architecture, randomly initialised (no download)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    """Std of the random weights. Larger values give peaked next-token distributions, as a trained LM has."""
    max_position_embeddings: int = 4096
    num_experts: int = 0
    """> 0: a Qwen3-MoE (every layer sparse, as Qwen3-30B-A3B) with this many experts and `experts_per_token` of
    them per token, each of `moe_intermediate_size`."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0


TINY_MODEL = ModelSize(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    initializer_range=0.3,
    max_position_embeddings=256,
)
"""About 0.1M parameters: small enough for many worker builds on 2 CPU cores, peaked enough to mask tokens."""

TINY_MOE = ModelSize(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    initializer_range=0.3,
    max_position_embeddings=256,
    num_experts=8,
    experts_per_token=2,
    moe_intermediate_size=32,
)
"""TINY_MODEL's widths as a Qwen3-MoE of 8 experts, top-2 (the CPU smoke path of R3 through verl's worker)."""

GPU_MOE = ModelSize(
    vocab_size=151_936,
    hidden_size=2048,
    num_layers=4,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=6144,
    tie_word_embeddings=False,
    initializer_range=0.02,
    max_position_embeddings=8192,
    num_experts=128,
    experts_per_token=8,
    moe_intermediate_size=768,
)
"""Qwen3-30B-A3B's layer shape (hidden 2,048, 128 experts of 768, top-8, 32 heads of 128, 4 KV heads) and real
vocabulary with 4 of its 48 layers: about 3.1B parameters, 2.4B of them experts (R3 on verl's FSDP engine, issue
72.6): about 50 GB of fp32 weights, gradients and Adam state on one GPU, beside the bf16 rollout copy's 6 GB."""

GPU_MODEL = ModelSize(
    vocab_size=151_936,
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    tie_word_embeddings=True,
    initializer_range=0.02,
    max_position_embeddings=8192,
)
"""Qwen3-0.6B's widths and real vocabulary with 8 of its 28 layers: about 280M parameters."""


@dataclass(frozen=True)
class RunShape:
    """The batch of one training step and how verl splits it."""

    prompts: int = 4
    """Prompts per step (data.train_batch_size)."""
    samples_per_prompt: int = 4
    """GRPO group size (actor_rollout_ref.rollout.n)."""
    mini_batches: int = 2
    """Optimizer steps per training step: ppo_mini_batch_size = prompts / mini_batches."""
    prompt_length: int = 8
    """Longest prompt; prompts are drawn between half of it and it."""
    response_length: int = 16
    """data.max_response_length; responses are cut between half of it and it (as if EOS came early)."""
    token_budget: int = 64
    """ppo_max_token_len_per_gpu = log_prob_max_token_len_per_gpu (dynamic batch size): sets the micro-batches."""
    lr: Optional[float] = 1e-2
    """None: the recipe's learning rate (1e-6)."""
    topk: Optional[int] = None
    """None: the recipe's policy_loss.topk (K=20)."""
    seed: int = 0

    @property
    def batch_size(self) -> int:
        return self.prompts * self.samples_per_prompt


# ---------------------------------------------------------------------------------------------------------------
# The plugin's loss modes and the recipes that use them
# ---------------------------------------------------------------------------------------------------------------


def plugin_loss_modes() -> list[str]:
    """Every loss mode the plugin registered in verl's POLICY_LOSS_REGISTRY (marked `__verl_dppo__`)."""
    import verl  # noqa: F401  (loads the plugin through the verl.plugins entry point)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return sorted(name for name, fn in POLICY_LOSS_REGISTRY.items() if getattr(fn, "__verl_dppo__", False))


def method_settings() -> dict[str, dict[str, Any]]:
    """method name -> its loss_mode, anchor and bypass_mode, read from recipes/method/*.yaml."""
    from omegaconf import OmegaConf

    settings = {}
    for path in sorted((recipes_dir() / "method").glob("*.yaml")):
        if path.stem.startswith("_"):
            continue
        node = OmegaConf.load(path)
        policy_loss = OmegaConf.select(node, "actor_rollout_ref.actor.policy_loss", default={}) or {}
        settings[path.stem] = {
            "loss_mode": policy_loss.get("loss_mode"),
            "anchor": policy_loss.get("anchor", "rollout"),
            "bypass_mode": OmegaConf.select(node, "algorithm.rollout_correction.bypass_mode", default=True),
        }
    return settings


def method_for_mode(loss_mode: str, anchor: str = "rollout") -> str:
    """The recipe method that runs `loss_mode`: with anchor="rollout", the paper's setting (the method named after
    the mode, else the first by name that uses it with the rollout anchor in bypass mode); with anchor="recompute",
    the first decoupled method (recomputed anchor, bypass mode off) that uses it."""
    settings = method_settings()
    if anchor == "rollout" and settings.get(loss_mode, {}).get("loss_mode") == loss_mode:
        return loss_mode
    candidates = [
        name
        for name, s in settings.items()
        if s["loss_mode"] == loss_mode and s["anchor"] == anchor and bool(s["bypass_mode"]) == (anchor == "rollout")
    ]
    if not candidates:
        raise LookupError(
            f"no recipe method in {recipes_dir() / 'method'} uses loss mode {loss_mode!r} with anchor={anchor}"
        )
    return candidates[0]


# ---------------------------------------------------------------------------------------------------------------
# The model on disk and the run's config
# ---------------------------------------------------------------------------------------------------------------


def save_model(directory: str | Path, size: ModelSize, seed: int = 0) -> Path:
    """A random-init Qwen3 and a word-level tokenizer over its vocabulary, written with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(size.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", eos_token="t1").save_pretrained(
        directory
    )
    settings = dict(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=size.tie_word_embeddings,
        initializer_range=size.initializer_range,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    if size.num_experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **settings,
            num_experts=size.num_experts,
            num_experts_per_tok=size.experts_per_token,
            moe_intermediate_size=size.moe_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        build = Qwen3MoeForCausalLM
    else:
        config, build = Qwen3Config(**settings), Qwen3ForCausalLM
    with torch.random.fork_rng():  # leave the caller's random state alone
        torch.manual_seed(seed)
        build(config).save_pretrained(directory)
    return directory


R3_OVERRIDES = (
    "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
)
"""R3 on verl's FSDP engine (the plugin's replay): the rollout's routes (`Rollout.routed_experts`) replayed."""


_composed: dict[str, Any] = {}


def compose_recipes(methods: set[str], trainer_mode: Optional[str] = None) -> None:
    """Hydra's composition of each recipe, done now (compose_config reuses them; forked processes inherit them);
    `trainer_mode`: the recipes' switch to one of verl's v1 trainers (None: sync)."""
    for method in sorted(methods):
        if (method, trainer_mode) not in _composed:
            _composed[method, trainer_mode] = compose_recipe(SETUP, method, trainer_mode=trainer_mode)


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """Command-line overrides (`key=value`, `+key=value`), parsed by Hydra's own override parser and set on an
    already composed config, as Hydra sets them (plain keys must exist; `+` adds one)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_delete():
            raise ValueError(f"deletions are not supported here: {override.input_line}")
        OmegaConf.update(
            config,
            override.key_or_group,
            override.value(),
            merge=True,
            force_add=override.is_add() or override.is_force_add(),
        )
    return config


def compose_config(
    loss_mode: str,
    model_dir: str | Path,
    shape: RunShape,
    device: str = "cpu",
    world_size: int = 1,
    method: Optional[str] = None,
    overrides: tuple[str, ...] = (),
    reuse_composition: bool = True,
    trainer_mode: Optional[str] = None,
) -> Any:
    """The run's config: sanity_1p5b x the method (default: the mode's paper setting) x the sizing overrides x
    `overrides`, validated like `verl-dppo run --dry-run`, resolved.

    With `reuse_composition`, the recipe (verl's ppo_trainer.yaml -> dppo.yaml -> setup -> method) is composed by
    Hydra once per method and process, and the overrides are parsed by Hydra's parser and set on a copy: Hydra reads
    some 30 YAML files per composition (about 2 s on a small CPU), and the suite builds dozens of workers. Without
    it, everything goes through one `compose_recipe` call, as `verl-dppo run` does (the suite checks both agree)."""
    from omegaconf import OmegaConf

    method = method or method_for_mode(loss_mode)
    all_overrides = [*sizing_overrides(model_dir, shape, device, world_size), *overrides]
    if reuse_composition:
        compose_recipes({method}, trainer_mode)
        config = apply_overrides(copy.deepcopy(_composed[method, trainer_mode]), all_overrides)
    else:
        config = compose_recipe(SETUP, method, all_overrides, trainer_mode=trainer_mode)
    validate_recipe(config)
    OmegaConf.resolve(config)
    return config


def sizing_overrides(model_dir: str | Path, shape: RunShape, device: str, world_size: int) -> list[str]:
    """The overrides that fit a recipe to the model, the batch and the machine (the recipes' values are for a
    1.5B model on 8 GPUs)."""
    mini_batch = shape.prompts // shape.mini_batches
    if mini_batch * shape.mini_batches != shape.prompts:
        raise ValueError(f"{shape.prompts} prompts do not split into {shape.mini_batches} mini-batches")
    sizing = [
        f"actor_rollout_ref.model.path={model_dir}",
        # verl's default is flash_attention_2, which neither the CPU nor a wheel-less GPU machine has.
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"data.train_batch_size={shape.prompts}",
        f"actor_rollout_ref.rollout.n={shape.samples_per_prompt}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"data.max_prompt_length={shape.prompt_length}",
        f"data.max_response_length={shape.response_length}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={shape.token_budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={shape.token_budget}",
        # The entropy, for the masked_entropy_mean diagnostic.
        "actor_rollout_ref.actor.calculate_entropy=True",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.use_torch_compile=False",
        f"trainer.n_gpus_per_node={world_size}",
        "trainer.nnodes=1",
    ]
    if shape.lr is not None:
        sizing.append(f"actor_rollout_ref.actor.optim.lr={shape.lr}")
    if shape.topk is not None:
        sizing.append(f"actor_rollout_ref.actor.policy_loss.topk={shape.topk}")
    if device == "cpu":
        sizing += [
            # FSDP1 needs an accelerator; FSDP2 runs on CPU. fp32 learner, as the bf16 copy is the rollout engine.
            "actor_rollout_ref.actor.strategy=fsdp2",
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision="
            "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        ]
    else:
        sizing += ["actor_rollout_ref.actor.strategy=fsdp"]
    return sizing


def rollout_topk(config: Any) -> Optional[int]:
    """K of the top-K the rollout engine reports per generated token for this run, or None when it reports none:
    what the plugin's launch step writes into `rollout.custom.dppo_topk` (run here on a copy of the config)."""
    launched = copy.deepcopy(config)
    sync_rollout_config(launched)
    k = (launched.actor_rollout_ref.rollout.get("custom", None) or {}).get("dppo_topk", None)
    return None if k is None else int(k)


# ---------------------------------------------------------------------------------------------------------------
# Process group and worker
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str, rank: int = 0, world_size: int = 1, port: Optional[int] = None) -> None:
    """The environment verl's Worker reads, and the default process group (gloo on CPU, nccl on CUDA)."""
    if device == "cpu":
        from verl_dppo.rehearsal import platform as cpu_platform

        cpu_platform.install()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port or os.environ.get("MASTER_PORT") or free_port()),
    )
    if not torch.distributed.is_initialized():
        if device != "cpu":
            torch.cuda.set_device(rank)
        backend = "gloo" if device == "cpu" else "nccl"
        # One process: an in-memory store (no port to race for with processes started beside this one).
        store = torch.distributed.HashStore() if world_size == 1 else None
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size, store=store)


def build_worker(config: Any) -> Any:
    """verl's ActorRolloutRefWorker in the actor role, its model and optimizer built (init_model)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def full_state(worker: Any) -> dict[str, torch.Tensor]:
    """The actor's parameters, gathered from their FSDP shards (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    state = worker.actor.engine.module.state_dict()
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().float().cpu().clone()
        for name, value in state.items()
    }


# ---------------------------------------------------------------------------------------------------------------
# The inference engine: a bf16 copy of the policy
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """What the agent loop hands the trainer for each sample: ids, mu(a) and mu's top-K, per response token."""

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    topk_ids: list[torch.Tensor]
    topk_log_probs: list[torch.Tensor]
    group: list[int]
    """GRPO group (prompt index) of each sample."""
    routed_experts: Optional[list[torch.Tensor]] = None
    """An MoE's routes per sample, as verl's agent loop stores vLLM's: [prompt + response, layers, top-k] int16, the
    experts of every token the engine fed (all but the response's last, whose row is zeros)."""

    def checksum(self) -> str:
        """Of the sampled data (prompts, responses, mu(a)); the top-K rows depend on the K asked for."""
        digest = hashlib.sha256()
        for rows in (self.prompts, self.responses, self.rollout_log_probs):
            for row in rows:
                digest.update(row.contiguous().cpu().numpy().tobytes())
        return digest.hexdigest()[:16]


class RolloutCopy:
    """The rollout engine: the policy in bf16 (as vLLM/SGLang serve it), re-synced from the actor before sampling.

    It samples at temperature 1 with top_p 1 and top_k -1 (the recipes' sampling) and reports, as a vLLM/SGLang
    server does with `logprobs=K`, the float32 log-softmax of its own bf16 logits at each sampled token and the
    K most likely tokens. mu != pi because the arithmetic differs (bf16 vs the learner's precision)."""

    def __init__(self, model_dir: str | Path, device: str):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
            .to(device)
            .eval()
        )
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)

    @torch.no_grad()
    def sync(self, worker: Any) -> None:
        """The weight sync of an RL step: verl's engine export (engine.get_per_tensor_param), cast to bf16."""
        params, _ = worker.actor.engine.get_per_tensor_param()
        self.load(params)

    @torch.no_grad()
    def load(self, params) -> None:
        """Load (name, tensor) pairs as a checkpoint engine delivers them, cast to bf16; every parameter must come."""
        state = self.model.state_dict()
        loaded = set()
        for name, tensor in params:
            if name in state:
                state[name].copy_(tensor.to(state[name].device, torch.bfloat16))
                loaded.add(name)
        missing = set(state) - loaded
        if self.model.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise RuntimeError(f"weight sync left parameters of the rollout copy unset: {sorted(missing)[:5]}")

    @torch.no_grad()
    def sample(self, shape: RunShape, generator: torch.Generator, topk: int) -> Rollout:
        """shape.prompts random prompts x shape.samples_per_prompt samples, each cut at a random length."""
        vocab = self.model.config.vocab_size
        prompts, groups = [], []
        for index in range(shape.prompts):
            low = max(1, shape.prompt_length // 2)
            length = int(torch.randint(low, shape.prompt_length + 1, (), generator=generator))
            prompt = torch.randint(2, vocab, (length,), generator=generator)
            prompts += [prompt] * shape.samples_per_prompt
            groups += [index] * shape.samples_per_prompt
        lengths = torch.randint(
            max(1, shape.response_length // 2), shape.response_length + 1, (len(prompts),), generator=generator
        )
        responses, log_probs, ids, values = self._generate(prompts, shape.response_length, generator, topk)
        cut = [int(n) for n in lengths]
        responses = [r[:n] for r, n in zip(responses, cut)]
        return Rollout(
            prompts=prompts,
            responses=responses,
            rollout_log_probs=[lp[:n] for lp, n in zip(log_probs, cut)],
            topk_ids=[i[:n] for i, n in zip(ids, cut)],
            topk_log_probs=[v[:n] for v, n in zip(values, cut)],
            group=groups,
            routed_experts=self.routes(prompts, responses),
        )

    @torch.no_grad()
    def routes(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """For an MoE copy, each sample's routes as an engine returns them and verl's agent loop pads them: the
        experts the copy's routers choose for every token fed (the prompt, then each response token but the last),
        in one uncached forward of the sequence, and a zero row for the last token. None for a dense copy."""
        from verl_dppo.plugin.moe.router_replay import routers_of

        routers = routers_of(self.model)
        if not routers:
            return None
        layers, top_k = int(self.model.config.num_hidden_layers), int(self.model.config.num_experts_per_tok)
        found = []
        for prompt, response in zip(prompts, responses):
            fed = torch.cat([prompt, response[:-1]]).to(self.device)[None]
            chosen: dict[int, torch.Tensor] = {}
            hooks = [
                router.register_forward_hook(lambda _m, _i, out, i=i: chosen.__setitem__(i, out[2]))
                for i, router in routers
            ]
            try:
                self.model(input_ids=fed)
            finally:
                for hook in hooks:
                    hook.remove()
            rows = torch.zeros(fed.shape[1] + 1, layers, top_k, dtype=torch.int16)
            for index, experts in chosen.items():
                rows[:-1, index] = experts.reshape(fed.shape[1], top_k).to(torch.int16).cpu()
            found.append(rows)
        return found

    def _generate(self, prompts, length, generator, topk):
        """Token-by-token sampling with a KV cache, left-padded prompts; the sampling uses `generator` only."""
        from transformers import DynamicCache

        batch = len(prompts)
        width = max(p.numel() for p in prompts)
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        attention = torch.zeros(batch, width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - prompt.numel() :] = prompt
            attention[row, width - prompt.numel() :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        tokens, log_probs, top_ids, top_values = [], [], [], []
        step_ids, step_positions = input_ids, positions
        for _ in range(length):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            token = self._draw(logp, generator)
            tokens.append(token[:, 0])
            log_probs.append(logp.gather(1, token)[:, 0])
            top = logp.topk(topk, dim=-1)
            top_ids.append(top.indices)
            top_values.append(top.values)
            attention = torch.cat([attention, torch.ones_like(token)], dim=1)
            step_ids, step_positions = token, step_positions[:, -1:] + 1
        stack = lambda xs: torch.stack(xs, dim=1).cpu()  # noqa: E731
        responses, log_probs, top_ids, top_values = stack(tokens), stack(log_probs), stack(top_ids), stack(top_values)
        return list(responses), list(log_probs), list(top_ids), list(top_values)

    def _draw(self, logp, generator):
        """One token per row from the log-probs, drawn on the CPU with `generator` (reproducible on any device)."""
        return torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(self.device)


# ---------------------------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------------------------


def target_token_reward(rollout: Rollout, modulus: int = 8) -> torch.Tensor:
    """A toy outcome reward: the fraction of a response's tokens whose id is a multiple of `modulus`."""
    return torch.tensor([float((r % modulus == 0).float().mean()) if r.numel() else 0.0 for r in rollout.responses])


# ---------------------------------------------------------------------------------------------------------------
# The v1 trainer's actor-side calls
# ---------------------------------------------------------------------------------------------------------------


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([r.contiguous() for r in rows], layout=torch.jagged)


def _from_nested(values: torch.Tensor) -> list[torch.Tensor]:
    return list(values.unbind())


class Trainer:
    """The v1 trainer's actor side for one worker (one data-parallel rank): the batch as TransferQueue stores it,
    the non-tensor settings `_compute_old_log_prob` and `_update_actor` assign, and their metric reduction."""

    def __init__(self, config: Any, worker: Any, rank: int = 0, world_size: int = 1):
        self.config = config
        self.worker = worker
        self.rank = rank
        self.world_size = world_size
        self.topk = rollout_topk(config)
        """K when the rollout reports mu's top-K (the plugin's agent loop then adds the rows to each sample)."""

    @property
    def replays(self) -> bool:
        """Whether the rollout returns its routes (`enable_rollout_routing_replay`): the batch then carries them."""
        return bool(self.config.actor_rollout_ref.rollout.get("enable_rollout_routing_replay", False))

    @property
    def bypass_mode(self) -> bool:
        return bool(self.config.algorithm.rollout_correction.bypass_mode)

    def fields(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Per-sample rows, as `AgentLoopWorkerTQ._agent_loop_postprocess` puts them into TransferQueue."""
        rows: dict[str, list[torch.Tensor]] = {
            key: []
            for key in (
                "prompts",
                "responses",
                "input_ids",
                "position_ids",
                "response_mask",
                "loss_mask",
                "rollout_log_probs",
                "rm_scores",
            )
        }
        if self.topk is not None:
            rows["rollout_topk_ids"], rows["rollout_topk_logprobs"] = [], []
        if rollout.routed_experts is not None and self.replays:
            rows["routed_experts"] = list(rollout.routed_experts)
        for i, (prompt, response) in enumerate(zip(rollout.prompts, rollout.responses)):
            mask = torch.ones(response.numel(), dtype=torch.int64)
            scores = torch.zeros(response.numel(), dtype=torch.float32)
            scores[-1] = rewards[i]
            rows["prompts"].append(prompt)
            rows["responses"].append(response)
            rows["input_ids"].append(torch.cat([prompt, response]))
            rows["position_ids"].append(torch.arange(prompt.numel() + response.numel()))
            rows["response_mask"].append(mask)
            rows["loss_mask"].append(mask)
            rows["rollout_log_probs"].append(rollout.rollout_log_probs[i].float())
            rows["rm_scores"].append(scores)
            if self.topk is not None:  # the copy's top-K is sorted: its first K columns are mu's top-K
                if rollout.topk_ids[i].shape[-1] < self.topk:
                    raise ValueError(f"a top-{rollout.topk_ids[i].shape[-1]} rollout; the run asks K={self.topk}")
                rows["rollout_topk_ids"].append(rollout.topk_ids[i][:, : self.topk].long())
                rows["rollout_topk_logprobs"].append(rollout.topk_log_probs[i][:, : self.topk].float())
        return rows

    def local_indices(self, batch_size: int) -> list[int]:
        """This rank's samples. verl's dispatch hands rank r the r-th contiguous chunk of the (balanced) batch and
        each rank cuts its chunk into mini-batches; the batch is laid out here so that the k-th mini-batches of all
        ranks together are the k-th mini-batch of a single-rank run: the same data per optimizer step at any
        data-parallel size."""
        arr = self.config.actor_rollout_ref
        mini_batch = arr.actor.ppo_mini_batch_size * arr.rollout.n
        per_rank = mini_batch // self.world_size
        return [
            start + self.rank * per_rank + offset
            for start in range(0, batch_size, mini_batch)
            for offset in range(per_rank)
        ]

    @staticmethod
    def tensordict(
        rows: dict[str, list[torch.Tensor]],
        indices: list[int],
        extra_info: dict,
        extra_fields: Optional[list[dict]] = None,
    ) -> Any:
        from tensordict import NonTensorStack, TensorDict

        from verl.utils import tensordict_utils as tu

        data = TensorDict(
            {key: _nested([values[i] for i in indices]) for key, values in rows.items()}, batch_size=[len(indices)]
        )
        if extra_fields is not None:  # the agent loop's per-sample dict (min/max_global_steps: the versions)
            data.set("extra_fields", NonTensorStack(*[dict(extra_fields[i]) for i in indices]))
        for key, value in extra_info.items():  # what the TransferQueue bridge does with KVBatchMeta.extra_info
            tu.assign_non_tensor_data(tensor_dict=data, key=key, val=value)
        return data

    def advantages(self, rows: dict[str, list[torch.Tensor]], group: list[int]) -> list[torch.Tensor]:
        """verl's GRPO estimator (core_algos) over the whole batch, with the run's algorithm settings."""
        from verl.trainer.ppo.core_algos import get_adv_estimator_fn

        algorithm = self.config.algorithm
        width = max(r.numel() for r in rows["response_mask"])
        mask = torch.zeros(len(group), width)
        scores = torch.zeros(len(group), width)
        for i, (m, s) in enumerate(zip(rows["response_mask"], rows["rm_scores"])):
            mask[i, : m.numel()] = m
            scores[i, : s.numel()] = s
        estimator = get_adv_estimator_fn(algorithm.adv_estimator)
        advantages, _ = estimator(
            token_level_rewards=scores,
            response_mask=mask,
            index=np.array(group, dtype=object),
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
            config=algorithm,
        )
        return [advantages[i, : m.numel()] for i, m in enumerate(rows["response_mask"])]

    def step(
        self, rollout: Rollout, rewards: torch.Tensor, extra_fields: Optional[list[dict]] = None
    ) -> dict[str, float]:
        """One training step on this rank's share of `rollout`; returns the actor metrics the trainer logs.
        `extra_fields`: each sample's `extra_fields` as the async trainers' agent loop stores it."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import response_from_nested

        arr = self.config.actor_rollout_ref
        rows = self.fields(rollout, rewards)
        indices = self.local_indices(len(rollout.responses))
        extra_info: dict[str, Any] = {"temperature": arr.rollout.temperature}  # _step_once, at sampling
        # _compute_old_log_prob
        if self.bypass_mode:
            rows["old_log_probs"] = list(rows["rollout_log_probs"])
        else:
            extra_info.update(calculate_entropy=True, compute_loss=False, temperature=arr.rollout.temperature)
            output = self.worker.compute_log_prob(self.tensordict(rows, indices, extra_info))
            local = self.tensordict(rows, indices, {})
            for key, name in (("log_probs", "old_log_probs"), ("entropy", "entropy")):
                values = _from_nested(response_from_nested(tu.get(output, key), local["response_mask"]))
                rows[name] = self._gather_rows(values, indices, len(rollout.responses))
        # _compute_advantage (bypass mode computes no rollout-correction weights; neither do the DPPO recipes)
        rows["advantages"] = self.advantages(rows, rollout.group)
        rows["returns"] = list(rows["advantages"])
        # _update_actor
        mini_batch = arr.actor.ppo_mini_batch_size * arr.rollout.n
        extra_info.update(
            calculate_entropy=bool(arr.actor.calculate_entropy or arr.actor.entropy_coeff != 0.0),
            distillation_use_topk=False,
            distillation_only=False,
            global_batch_size=mini_batch,
            mini_batch_size=mini_batch,
            epochs=arr.actor.ppo_epochs,
            seed=arr.actor.data_loader_seed,
            dataloader_kwargs={"shuffle": arr.actor.shuffle},
            temperature=arr.rollout.temperature,
        )
        output = self.worker.update_actor(self.tensordict(rows, indices, extra_info, extra_fields))
        return reduce_actor_metrics(tu.get(output, "metrics"))

    def _gather_rows(self, local_rows: list[torch.Tensor], indices: list[int], batch_size: int) -> list[torch.Tensor]:
        """compute_log_prob's per-rank outputs put back in batch order (the trainer's TransferQueue put)."""
        pairs = list(zip(indices, (row.cpu() for row in local_rows)))
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, pairs)
            pairs = [pair for part in gathered for pair in part]
        rows: list[Any] = [None] * batch_size
        for index, row in pairs:
            rows[index] = row
        return rows

    def mini_batch_tokens(self, rollout: Rollout) -> list[int]:
        """Tokens (prompt + response) of each mini-batch of the step, over all ranks."""
        arr = self.config.actor_rollout_ref
        mini_batch = arr.actor.ppo_mini_batch_size * arr.rollout.n
        lengths = [p.numel() + r.numel() for p, r in zip(rollout.prompts, rollout.responses)]
        return [sum(lengths[i : i + mini_batch]) for i in range(0, len(lengths), mini_batch)]


def reduce_actor_metrics(metrics: dict) -> dict[str, float]:
    """`_update_actor`'s reduction: the prefix, mfu moved under perf/, verl's reduce_metrics."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    metrics = rename_dict(dict(metrics), "actor/")
    if "actor/mfu" in metrics:
        metrics["perf/mfu/actor"] = metrics.pop("actor/mfu")
    return {key: float(value) for key, value in reduce_metrics(metrics).items()}


# ---------------------------------------------------------------------------------------------------------------
# The plugin's log
# ---------------------------------------------------------------------------------------------------------------


class LogCapture(logging.Handler):
    """Collects what the plugin logs (logger "verl_dppo")."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []
        logging.getLogger(PLUGIN_LOGGER).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def in_effect(self, loss_mode: str, since: int = 0) -> list[str]:
        prefix = f"verl-dppo {loss_mode} in effect:"
        return [m for m in self.messages[since:] if m.startswith(prefix)]
