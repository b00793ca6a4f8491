"""Checks of a whole run's config (the driver's view: actor, rollout and algorithm together) for the DPPO modes.

The loss sees one micro-batch and the actor's config; whether verl recomputed `old_log_probs` (bypass mode) and
how the rollout engine computed mu are settings of other sections. They are decided here, from the configuration,
on the driver: by `verl-dppo run` (also in a dry run) and at launch (the plugin's `LLMServerManager.__init__`
patch), before anything slow starts.

Under verl's asynchronous v1 trainers (`trainer.v1.trainer_mode=colocate_async` / `separate_async`) the rollout
policy lags the trained one. What `PPOTrainerSeparateAsync.__init__` asserts (verl 0.9.1,
`trainer/ppo/v1/trainer_separate_async.py`) is refused here for every loss mode, one line naming the key, so that a
dry run catches it; what it turns off with a warning and runs is warned. What the DPPO modes need there (the
rollout's per-token log-probs, the anchor) is checked for the DPPO modes.
"""

from __future__ import annotations

from typing import Any

from verl_dppo.plugin.log_once import warn_once

__all__ = [
    "ASYNC_TRAINER_MODES",
    "RunConfigError",
    "async_trainer_mode",
    "check_run_config",
    "is_plugin_mode",
    "fsdp_router_replay_warning",
    "recompute_pass_warning",
]


ASYNC_TRAINER_MODES = ("colocate_async", "separate_async")
"""verl 0.9.1's asynchronous v1 trainers (`get_trainer_cls`); both resume aborted responses across weight updates
(`FullyAsyncLLMServerClient`)."""

"""Warnings already logged in this process: the check runs once per server manager (separate_async builds two)."""


class RunConfigError(ValueError):
    """A DPPO mode cannot run as configured; the message names the setting to change."""


def _dppo_mode(config: Any) -> str | None:
    from verl_dppo.plugin.extras import DPPO_MODES

    policy_loss = config.actor_rollout_ref.actor.get("policy_loss", None)
    mode = policy_loss.get("loss_mode", None) if policy_loss is not None else None
    return mode if mode in DPPO_MODES else None


def is_plugin_mode(config: Any) -> bool:
    """Whether the run's loss mode is one of the plugin's."""
    return _dppo_mode(config) is not None


def async_trainer_mode(config: Any) -> str | None:
    """`colocate_async` / `separate_async` when verl will run that trainer, else None (`main_ppo` reads
    `trainer.v1.trainer_mode` only with `trainer.use_v1=True`)."""
    trainer = config.get("trainer", None) or {}
    if not trainer.get("use_v1", True):
        return None
    mode = (trainer.get("v1", None) or {}).get("trainer_mode", "sync")
    return mode if mode in ASYNC_TRAINER_MODES else None


def _check_separate_async(config: Any) -> list[str]:
    """What `PPOTrainerSeparateAsync.__init__` asserts before anything starts (verl 0.9.1); returns the warning verl
    logs where it turns a setting off and runs."""
    switch = "trainer.v1.trainer_mode=separate_async"
    arr = config.actor_rollout_ref
    rollout = arr.rollout
    separate = config.trainer.v1.get("separate_async", None) or {}
    sync_step = int(separate.get("parameter_sync_step", 4))
    mini_batch = int(arr.actor.ppo_mini_batch_size)
    train_batch = int(config.data.train_batch_size)
    # Weights reach the rollout every parameter_sync_step mini-batch updates, and one step trains one batch.
    if train_batch != sync_step * mini_batch:
        raise RunConfigError(
            f"{switch} needs data.train_batch_size == trainer.v1.separate_async.parameter_sync_step * "
            f"actor_rollout_ref.actor.ppo_mini_batch_size, got {train_batch} != {sync_step} * {mini_batch}: set "
            f"data.train_batch_size={sync_step * mini_batch} (or change parameter_sync_step / ppo_mini_batch_size)."
        )
    # The rollout runs on its own GPUs (a standalone server pool beside the trainer's trainer.nnodes x
    # trainer.n_gpus_per_node); verl's default rollout.nnodes is 0.
    for key in ("nnodes", "n_gpus_per_node"):
        if int(rollout.get(key, 0) or 0) <= 0:
            raise RunConfigError(
                f"{switch} runs the rollout on GPUs of its own: set actor_rollout_ref.rollout.{key} > 0 (got "
                f"{rollout.get(key, None)}), beside trainer.nnodes / trainer.n_gpus_per_node for the trainer."
            )
    backend = (rollout.get("checkpoint_engine", None) or {}).get("backend", "naive")
    if backend == "naive":
        raise RunConfigError(
            f"{switch} sends weights to a separate rollout pool, which the naive checkpoint engine cannot: set "
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl (or nixl, mooncake, hccl)."
        )
    reward_model = (config.get("reward", None) or {}).get("reward_model", None) or {}
    if reward_model.get("enable", False) and not reward_model.get("enable_resource_pool", False):
        raise RunConfigError(
            f"{switch} cannot colocate the reward model (the standalone rollout never pauses to free GPU memory): "
            "set reward.reward_model.enable_resource_pool=True."
        )
    hybrid = separate.get("hybrid_rollout", None) or {}
    if not hybrid.get("enable_switch", False):
        return []
    # verl first turns the switch off (a warning, and the run goes on) when the trainer's GPUs host no rollout
    # replica to lend; only a switch still on meets the disaggregation check.
    if not arr.get("hybrid_engine", True):
        return [
            f"{switch}: trainer.v1.separate_async.hybrid_rollout.enable_switch=True is ignored with "
            "actor_rollout_ref.hybrid_engine=False (no rollout replica on the trainer's GPUs to switch): verl turns "
            "it off; set enable_switch=False (or hybrid_engine=True to lend the trainer's GPUs to the rollout)."
        ]
    if (rollout.get("disaggregation", None) or {}).get("enabled", False):
        raise RunConfigError(
            f"{switch}: trainer.v1.separate_async.hybrid_rollout.enable_switch=True with "
            "actor_rollout_ref.hybrid_engine=True does not support actor_rollout_ref.rollout.disaggregation.enabled="
            "True: set one of them to False (or actor_rollout_ref.hybrid_engine=False, under which verl ignores the "
            "switch)."
        )
    return []


FLASH_ATTENTIONS = ("flash_attention_2", "flash_attention_3")
"""What verl 0.9.1's Ulysses sequence parallelism works with: `apply_monkey_patch` swaps its all-to-all in around
transformers' `_flash_attention_forward` only (verl/models/transformers/monkey_patch.py:544-552)."""


def fsdp_router_replay_warning(config: Any) -> str | None:
    """The rollout's routes returned on the FSDP engine with no replay or measurement to read them (verl's own MoE
    load-balance metrics still do): a run that probably meant R3. None otherwise."""
    actor = config.actor_rollout_ref.actor
    if str(actor.get("strategy", "fsdp")) not in ("fsdp", "fsdp2"):
        return None
    mode = str(((actor.get("fsdp_config", None) or {}).get("router_replay", None) or {}).get("mode", "disabled"))
    if mode != "disabled" or not config.actor_rollout_ref.rollout.get("enable_rollout_routing_replay", False):
        return None
    return (
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=True returns the rollout's routes, but nothing "
        "replays them: set +actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3 (rollout router replay on "
        "the FSDP engine; measure: the mismatch counted, nothing replayed) or leave the setting out."
    )


def fsdp_router_replay_problem(config: Any) -> str | None:
    """Router replay asked of verl's FSDP engine where it cannot act; None where it can, or where none is asked.
    The plugin replays R3 there (verl_dppo.plugin.moe.router_replay): the rollout must return its routes (vLLM's
    `enable_return_routed_experts`, which verl asks for with `enable_rollout_routing_replay`; the plugin's hf rollout
    records its own model's routers the same way) and the engine must pack
    the tokens (use_remove_padding). `measure` (the plugin's: the routes compared with the trainer's routers, not
    replayed) needs the same. R2 (routes recorded in a recompute pass) has no FSDP implementation, in verl or here;
    routes returned without R3 or measure would go unread."""
    actor = config.actor_rollout_ref.actor
    if str(actor.get("strategy", "fsdp")) not in ("fsdp", "fsdp2"):
        return None
    mode = str(((actor.get("fsdp_config", None) or {}).get("router_replay", None) or {}).get("mode", "disabled"))
    rollout = config.actor_rollout_ref.rollout
    returned = bool(rollout.get("enable_rollout_routing_replay", False))
    key = "actor_rollout_ref.actor.fsdp_config.router_replay.mode"
    if mode == "disabled":
        return None
    if mode not in ("R3", "measure"):
        return (
            f"{key}={mode}: the FSDP engine replays R3 only, or measures the routing mismatch without replaying "
            "(measure; R2 records routes in a recompute pass, which verl 0.9.1 implements on its Megatron "
            "engine): set R3 or measure, or model_engine=megatron for R2."
        )
    if not returned:
        return (
            f"{key}={mode} reads the rollout's routes, which the rollout returns only with "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True: set it."
        )
    if not config.actor_rollout_ref.model.get("use_remove_padding", True):
        return (
            f"{key}={mode} lays the routes out as the FSDP engine packs tokens: set "
            "actor_rollout_ref.model.use_remove_padding=True."
        )
    return _r3_model_problem(config, key, mode)


R3_MODEL_TYPES = {"qwen3_moe": "Qwen3MoeTopKRouter", "qwen2_moe": "Qwen2MoeTopKRouter", "mixtral": "MixtralTopKRouter"}
"""The Hugging Face model types whose routers R3 on the FSDP engine replays (router_replay.ROUTER_CLASSES)."""


def _r3_model_problem(config: Any, key: str, mode: str) -> str | None:
    """R3 on FSDP on a model whose config.json (readable here) shows no router R3 replays: said before the launch,
    not at the first micro-batch after the model load and the first rollout. Nothing where it is not readable here."""
    from verl_dppo.plugin.moe.router_replay import config_experts, model_config

    path = str(config.actor_rollout_ref.model.get("path", ""))
    model = model_config(path)
    if model is None:  # a hub id not cached, an unresolved interpolation, a folder not built yet: the worker checks
        return None
    kind = str(model.get("model_type", "?"))
    if not config_experts(model):
        return (
            f"{key}={mode}, but {path}/config.json ({kind}) names no routed experts: a dense model routes nothing "
            "(drop the R3 settings)."
        )
    if kind not in R3_MODEL_TYPES:
        return (
            f"{key}={mode}, but {path}/config.json is an MoE of type {kind}, whose router R3 on the FSDP engine "
            f"does not replay (it replays {', '.join(R3_MODEL_TYPES)}): model_engine=megatron, whose R3 covers "
            "it, or no R3."
        )
    return None


def router_replay_model_problem(config: Any) -> str | None:
    """A router replay on verl's Megatron or VeOmni engine (verl's R2/R3) on a model whose config.json (readable
    here) names no routed experts: it would stop on the cluster, after the model load. On FSDP
    `fsdp_router_replay_problem` says it (with the router types the plugin's replay knows). None otherwise."""
    from verl_dppo.plugin.moe.arm import replay_mode
    from verl_dppo.plugin.moe.router_replay import model_experts

    mode, section = replay_mode(config)
    if mode == "disabled" or section in (None, "fsdp_config"):
        return None
    path = str(config.actor_rollout_ref.model.get("path", ""))
    if model_experts(path) != 0:
        return None
    return (
        f"actor_rollout_ref.actor.{section}.router_replay.mode={mode}, but the model's config.json ({path}) names "
        "no routed experts: a dense model routes nothing (drop the router replay settings)"
    )


def _check_ulysses_attention(config: Any) -> None:
    """Ulysses SP > 1 with an attention other than flash-attention (any loss mode): each rank would attend within its
    own slice of the packed sequences only, and score the tokens after a slice boundary without their context. Seen
    on cpu_tiny (sdpa, SP=2 over two ranks): now and then one token at |pi - mu| = 0.33 on the policy that sampled,
    as the order of the samples put a sequence across the boundary."""
    arr = config.actor_rollout_ref
    model = arr.get("model", None) or {}
    attention = (model.get("override_config", None) or {}).get("attn_implementation", None) or "flash_attention_2"
    if str(attention) in FLASH_ATTENTIONS:
        return
    for role in ("actor", "ref"):
        node = arr.get(role, None) or {}
        if (
            str(node.get("strategy", "fsdp")).startswith("fsdp")
            and int(node.get("ulysses_sequence_parallel_size", 1) or 1) > 1
        ):
            raise RunConfigError(
                f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size={node.ulysses_sequence_parallel_size} with "
                f"actor_rollout_ref.model.override_config.attn_implementation={attention}: verl 0.9.1's Ulysses "
                "sequence parallelism exchanges the sequence slices around flash-attention's forward only, so with "
                f"{attention} each rank would attend within its own slice and score the tokens after a slice boundary "
                "without their context. Use flash_attention_2 (a GPU with flash-attn) or "
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1."
            )


def _log_once(warnings: list[str]) -> None:
    for warning in warnings:
        warn_once(warning, "%s", warning)


def _check_lora_section(config: Any) -> None:
    """verl's `model.lora` section (rank, alpha, merge) is its Megatron engine's LoRA; the FSDP engine reads
    `model.lora_rank` only, so on FSDP the section alone trains every weight, at LoRA's learning rate."""
    arr = config.actor_rollout_ref
    model = arr.get("model", None) or {}
    section = model.get("lora", None) or {}
    if (
        str(arr.actor.get("strategy", "")) in ("fsdp", "fsdp2")
        and int(section.get("rank", 0) or 0) > 0
        and int(model.get("lora_rank", 0) or 0) == 0
    ):
        raise RunConfigError(
            f"actor_rollout_ref.model.lora.rank={section.get('rank')} is verl's Megatron LoRA section, which the FSDP "
            "engine does not read (it would train every weight): on FSDP set actor_rollout_ref.model.lora_rank, "
            "lora_alpha and target_modules instead, or train on model_engine=megatron."
        )


def check_run_config(config: Any) -> list[str]:
    """Raise `RunConfigError` for a setting under which a DPPO mode would train on the wrong policy, or under which
    verl's asynchronous trainer would stop at its start (any loss mode); return the warnings (each also logged, once
    per process) for settings that run but are probably not what the user meant."""
    async_mode = async_trainer_mode(config)
    warnings = _check_separate_async(config) if async_mode == "separate_async" else []
    arr = config.actor_rollout_ref
    rollout = arr.rollout
    correction = config.get("algorithm", {}).get("rollout_correction", None) or {}
    bypass = bool(correction.get("bypass_mode", False))
    if async_mode is not None and bypass and not rollout.get("calculate_log_probs", False):
        # verl's _compute_old_log_prob reads rollout_log_probs from the batch in bypass mode (any loss mode).
        raise RunConfigError(
            f"trainer.v1.trainer_mode={async_mode} with algorithm.rollout_correction.bypass_mode=True takes "
            "old_log_probs from the rollout's log-probs, which it does not compute: set "
            "actor_rollout_ref.rollout.calculate_log_probs=True."
        )
    _check_ulysses_attention(config)
    _check_lora_section(config)
    # a router replay acts whatever the loss mode: the plugin's on FSDP, verl's on Megatron and VeOmni
    problem = fsdp_router_replay_problem(config) or router_replay_model_problem(config)
    if problem is not None:
        raise RunConfigError(f"{arr.actor.policy_loss.get('loss_mode', 'vanilla')}: {problem}")
    warnings += [warning for warning in [fsdp_router_replay_warning(config)] if warning]
    mode = _dppo_mode(config)
    if mode is None:
        _log_once(warnings)
        return warnings
    anchor = arr.actor.policy_loss.get("anchor", "rollout")
    if anchor == "recompute" and bypass:
        raise RunConfigError(
            f"{mode}: policy_loss.anchor=recompute needs the recomputed old_log_probs, which bypass mode skips "
            "(old_log_probs are then the rollout's): set algorithm.rollout_correction.bypass_mode=False (or "
            "policy_loss.anchor=rollout)."
        )
    temperature = float(rollout.get("temperature", 1.0))
    if (
        rollout.get("name", None) == "vllm"
        and str(rollout.get("logprobs_mode", "")).startswith("raw_")
        and temperature != 1.0
    ):
        raise RunConfigError(
            f"{mode}: rollout.logprobs_mode={rollout.logprobs_mode} makes vLLM report log-probs before temperature, "
            f"while the actor divides its logits by rollout.temperature={temperature:g}: pi and mu would differ by "
            "the temperature alone. Set actor_rollout_ref.rollout.logprobs_mode=processed_logprobs (or temperature=1)."
        )
    if async_mode is not None:
        switch = f"trainer.v1.trainer_mode={async_mode}"
        if not rollout.get("calculate_log_probs", False):
            # mu of a resumed response comes only from the rollout: each token's log-prob as the version that
            # sampled it reported it. Nothing can recompute it once the weights moved on (bypass mode would even
            # fail on the missing rollout_log_probs).
            raise RunConfigError(
                f"{mode} under {switch} needs the rollout's per-token log-probs (mu, the policy version that sampled "
                "each token): set actor_rollout_ref.rollout.calculate_log_probs=True."
            )
        sampler = (config.trainer.get("v1", None) or {}).get("sampler", None) or {}
        kept = sampler.get("max_off_policy_threshold", 8)
        counted = arr.actor.policy_loss.get("max_off_policy_threshold", None)
        if kept != counted:
            warnings.append(
                f"{mode}: actor_rollout_ref.actor.policy_loss.max_off_policy_threshold={counted} under {switch}, but "
                f"verl keeps samples up to trainer.v1.sampler.max_off_policy_threshold={kept}: set "
                f"actor_rollout_ref.actor.policy_loss.max_off_policy_threshold={kept} (the recipes copy it) so that "
                "actor/dppo/lag_over_threshold_frac counts the samples verl would not keep."
            )
        if anchor == "recompute":
            warnings.append(
                f"{mode}: policy_loss.anchor=recompute under {switch} anchors the trust region on the recomputed "
                "policy, not on the versions that sampled the response (up to "
                "trainer.v1.sampler.max_off_policy_threshold versions older): the decoupled objective the paper "
                "shows collapsing (Sec. 5.2). Set actor_rollout_ref.actor.policy_loss.anchor=rollout."
            )
    if not bypass and not rollout.get("calculate_log_probs", False):
        warnings.append(
            f"{mode}: rollout.calculate_log_probs=False with bypass_mode=False: the batch has no rollout log-probs, "
            "so the ratio and the trust region are anchored on the recomputed policy (the paper's unstable decoupled "
            "variant, Sec. 5.2): set actor_rollout_ref.rollout.calculate_log_probs=True."
        )
    _log_once(warnings)
    return warnings


def recompute_pass_warning(config: Any) -> str | None:
    """One line when verl would recompute the old log-probs every step for nothing: a plugin mode anchored on the
    rollout's log-probs, which it reads from the batch, with bypass mode off and none of verl's rollout corrections
    (the only readers of the recomputed values left). The recompute is a forward pass over the whole batch, about a
    quarter of a step (docs/anchor.md). None otherwise (`verl-dppo check` names it; a run is not refused for it)."""
    mode = _dppo_mode(config)
    if mode is None:
        return None
    correction = config.get("algorithm", {}).get("rollout_correction", None) or {}
    if correction.get("bypass_mode", False) or correction.get("rollout_is") or correction.get("rollout_rs"):
        return None
    arr = config.actor_rollout_ref
    if arr.actor.policy_loss.get("anchor", "rollout") != "rollout" or not arr.rollout.get("calculate_log_probs", False):
        return None
    return (
        f"{mode}: algorithm.rollout_correction.bypass_mode=False: verl recomputes the old log-probs every step, a "
        f"forward pass over the whole batch (about a quarter of a step, docs/anchor.md) whose result {mode}, "
        "anchored on the rollout's log-probs, does not use: set algorithm.rollout_correction.bypass_mode=True"
    )
