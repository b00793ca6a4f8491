"""The methods the demo compares: one row each, a verl loss mode and its settings.

To add a method, add one `Method` row: the demo runs every row whose loss mode is registered in verl's
POLICY_LOSS_REGISTRY after `import verl`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# verl's clip_ratio_c default (3.0) would truncate the ratio pi/mu; the paper's runs use 10000 (off). Sec. 5.4.
NO_TRUNCATION = 10000.0
TOPK = 4
"""K of the demo's Top-K methods: mu's top-K comes from the rollout copy, as vLLM reports it with logprobs=K."""
TROLL_TOPK = 16
"""K of the demo's TROLL: the support takes mu's and pi's top tokens up to mass 1 - 1e-5, at most K (TROLL: 64 of
151,936); 16 of the 64-token vocabulary covers the 14 tokens that carry meaning."""


@dataclass(frozen=True)
class Method:
    name: str
    """Run name: the JSONL file stem and the legend label; the recipe's name (recipes/method/<name>.yaml) where the
    row runs a recipe's settings."""
    loss_mode: str
    """actor_rollout_ref.actor.policy_loss.loss_mode."""
    description: str
    policy_loss: dict[str, Any] = field(default_factory=dict)
    """Extra DPPOLossConfig fields (+actor_rollout_ref.actor.policy_loss.<key>=...)."""
    actor: dict[str, Any] = field(default_factory=dict)
    """Extra ActorConfig fields (actor_rollout_ref.actor.<key>=...)."""
    needs_rollout_topk: bool = False
    """True for the Top-K modes and troll: the rollout reports mu's top-K per token and the loss gets Eq. (15)/(16)
    (TROLL: its projection's terms, with gradient)."""


METHODS = (
    Method("pg_is", "pg_is", "PG-IS: no trust region, no truncation", {"ratio_cap": float("inf")}),
    Method(
        "grpo_clip_higher",
        "grpo_clip",
        "GRPO Clip-Higher, ratio in [0.8, 1.28]",
        actor={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
    ),
    Method("dppo_binary_tv", "dppo_binary_tv", "DPPO-Binary-TV, delta 0.15", {"delta_low": 0.15, "delta_high": 0.15}),
    Method("dppo_binary_kl", "dppo_binary_kl", "DPPO-Binary-KL, delta 0.05", {"delta_low": 0.05, "delta_high": 0.05}),
    # K = 4 of a 64-token vocabulary (the paper: K = 20 of 151,936): Top-K stays a coarse view of mu, as it is there.
    Method(
        "dppo_topk_tv",
        "dppo_topk_tv",
        "DPPO-TopK-TV, K 4, delta 0.15",
        {"delta_low": 0.15, "delta_high": 0.15, "topk": TOPK},
        needs_rollout_topk=True,
    ),
    Method(
        "dppo_topk_kl",
        "dppo_topk_kl",
        "DPPO-TopK-KL, K 4, delta 0.05",
        {"delta_low": 0.05, "delta_high": 0.05, "topk": TOPK},
        needs_rollout_topk=True,
    ),
    # TROLL's reported values (eps 0.05, alpha 1, support mass 1 - 1e-5); no mask: pg_clipfrac stays 0.
    Method(
        "troll",
        "troll",
        "TROLL, eps 0.05, alpha 1, K 16",
        {"troll_eps": 0.05, "troll_alpha": 1.0, "topk": TROLL_TOPK},
        needs_rollout_topk=True,
    ),
)

STUDY_METHODS = (
    # The decoupled variant (Sec. 5.2): the trust region anchored on the learner's recompute, the ratio still pi/mu.
    Method(
        "dppo_binary_tv_recompute",
        "dppo_binary_tv",
        "DPPO-Binary-TV, delta 0.15, anchored on the recompute",
        {"delta_low": 0.15, "delta_high": 0.15, "anchor": "recompute"},
    ),
)
"""Rows of `verl-dppo staleness` only (not in the demo's list): the anchoring question needs them."""


def mode_rows() -> tuple[Method, ...]:
    """A row for each registered loss mode that has no row above but demo settings on its registry entry
    (`LossMode.demo`): a new mode is in --methods with no edit here. Not run by default."""
    from verl_dppo.plugin.modes import loss_modes

    named = {m.loss_mode for m in (*METHODS, *STUDY_METHODS)}
    return tuple(
        Method(mode.name, mode.name, mode.demo[0], dict(mode.demo[1]), needs_rollout_topk=mode.reads_topk)
        for mode in loss_modes()
        if mode.demo is not None and mode.name not in named
    )


ALIASES = {"grpo_clip": "grpo_clip_higher"}
"""Other names --methods accepts: `grpo_clip` is the row's loss mode and was its demo name before the rows took the
recipes' names; the run is logged under the row's name."""


def accepted_names(rows: tuple[Method, ...]) -> str:
    """Every name --methods accepts among `rows`, aliases beside their row (for --help and errors)."""
    aliases = {row: alias for alias, row in ALIASES.items()}
    return ", ".join(m.name + (f" (or {aliases[m.name]})" if m.name in aliases else "") for m in rows)


def runnable_methods(
    names: list[str] | None = None, default: tuple[Method, ...] = METHODS, accepted: tuple[Method, ...] | None = None
) -> list[Method]:
    """The methods to run: `names` in order, each a row of `accepted` (every row, the registry's `mode_rows`
    included, when None) or an alias of one, a row named twice run once (every registered row of `default` when
    empty). Unknown names raise ValueError."""
    import verl  # noqa: F401  (loads the plugin: registers the loss modes)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if accepted is None:
        accepted = (*METHODS, *STUDY_METHODS, *mode_rows())
    by_name = {method.name: method for method in accepted}
    by_name.update({alias: by_name[name] for alias, name in ALIASES.items() if name in by_name})
    if names:
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise ValueError(f"unknown demo method(s) {unknown}; choose from {accepted_names(accepted)}")
        chosen = list({by_name[name].name: by_name[name] for name in names}.values())
    else:
        chosen = list(default)
    missing = [m.loss_mode for m in chosen if m.loss_mode not in POLICY_LOSS_REGISTRY]
    if missing and names:
        raise ValueError(f"loss mode(s) {missing} are not registered in verl: run `verl-dppo doctor`")
    return [m for m in chosen if m.loss_mode in POLICY_LOSS_REGISTRY]


def actor_config(
    method: Method,
    prompts_per_step: int,
    samples_per_prompt: int,
    mini_batches: int,
    micro_batch_size: int,
    lr: float,
    grad_clip: float,
):
    """The verl `FSDPActorConfig` a Hydra run would build for this method (via verl's omega_conf_to_dataclass)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    if prompts_per_step % mini_batches:
        raise ValueError(
            f"the {prompts_per_step} prompts per step must split into --mini-batches ({mini_batches}) equal updates"
        )
    mini_batch_prompts = prompts_per_step // mini_batches
    if (mini_batch_prompts * samples_per_prompt) % micro_batch_size:
        raise ValueError(
            f"a mini-batch holds {mini_batch_prompts * samples_per_prompt} sequences, not a multiple of "
            f"the micro-batch size ({micro_batch_size}): choose another --mini-batches"
        )
    config = {
        "_target_": "verl.workers.config.FSDPActorConfig",
        "strategy": "fsdp",
        "rollout_n": samples_per_prompt,
        "ppo_mini_batch_size": mini_batch_prompts,
        "ppo_micro_batch_size_per_gpu": micro_batch_size,
        "ppo_epochs": 1,
        "clip_ratio_c": NO_TRUNCATION,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "grad_clip": grad_clip,
        "optim": {"_target_": "verl.workers.config.FSDPOptimizerConfig", "lr": lr, "weight_decay": 0.01},
        "policy_loss": {"_target_": "verl_dppo.DPPOLossConfig", "loss_mode": method.loss_mode, **method.policy_loss},
        **method.actor,
    }
    return omega_conf_to_dataclass(OmegaConf.create(config))
