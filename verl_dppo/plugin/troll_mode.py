"""The `troll` loss mode's loss side: TROLL's per-token loss from the terms the engine's logits hook computed.

TROLL (Becker, Freymuth, Thilges, Otto, Neumann 2025, arXiv 2510.03817), anchored like DPPO on the rollout policy
mu (its top-K as vLLM/SGLang reported it; no extra forward pass of an old policy):

    loss_t = -(p(a_t) / mu'(a_t)) A_t + alpha KL(pi' || sg(p))          (their Eq. 5, minimised; no clipping)

with the ratio at log r <= 20 like the DPPO modes' (`verl_dppo.math.troll.capped_ratio`).

p is pi projected onto {KL(. || mu') <= eps} over the sparse support (`verl_dppo.math.troll`). The projection
needs the whole vocabulary row, so it runs inside verl's engine (`verl_dppo.patches.fsdp_logits_hook`), WITH
gradient: the hook returns log p(a_t) and KL(pi' || sg(p)) per token still attached to the logits (with
`use_fused_kernels`: to the LM head's input and weight, `verl_dppo.math.fused_troll`), plus detached
diagnostics; the `ppo_loss` wrapper pads them into `BatchExtras.troll`. The loss's gradient flows only through those
two tensors, never through verl's own log_prob (whose flash-attn cross entropy would write its gradient into the
logits in place, under TROLL's saved tensors). Aggregation, the dropped-token rule and the shared diagnostics are
`verl_dppo.plugin.losses.dppo_policy_loss`'s (`FAMILY` says what differs), with nothing masked and no ratio cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_dppo.math.troll import capped_ratio, troll_token_terms
from verl_dppo.plugin.loss_family import LossFamily, LossMode, Tokens
from verl_dppo.plugin.options import DEFAULTS, checked, policy_loss_get
from verl_dppo.plugin.topk_mode import ROLLOUT_SETTINGS, check_anchor, configured_topk

__all__ = [
    "OUTPUT_KEYS",
    "DIFFERENTIABLE",
    "TrollOptions",
    "troll_options",
    "troll_from_extras",
    "troll_loss_matrix",
    "troll_ratio_parts",
    "zero_loss",
    "FAMILY",
    "troll_outputs",
    "troll_dict",
]


OUTPUT_KEYS = {
    "log_p": "troll_log_p",
    "regression_kl": "troll_regression_kl",
    "log_mu": "troll_log_mu",
    "valid": "troll_valid",
    "projected": "troll_projected",
    "eta": "troll_eta",
    "kl_before": "troll_kl_before",
    "kl_after": "troll_kl_after",
    "support_size": "troll_support_size",
}
"""Term -> model_output key the logits hook fills: (nnz,) float32 per token of the packed stream."""

DIFFERENTIABLE = ("log_p", "regression_kl")
"""The terms that keep their autograd graph to the logits; every other one is detached."""


@dataclass(frozen=True)
class TrollOptions:
    eps: float
    alpha: float
    support_mass: float
    topk: int

    def rule_parts(self, shared: list[str]) -> list[str]:
        """The update rule's trust-region words (`verl-dppo check`'s summary): TROLL's projection, in place of the
        shared options' (it masks nothing)."""
        return [
            f"eps {self.eps:g}",
            f"K {self.topk}",
            f"support mass {self.support_mass:.10g}",
            f"alpha {self.alpha:g}",
        ]

    def describe(self) -> str:
        return (
            f"troll_eps={self.eps:g} troll_alpha={self.alpha:g} troll_support_mass={self.support_mass:.10g} "
            f"topk={self.topk}"
        )


def troll_options(config: Any) -> TrollOptions:
    """The values in effect from an actor config (DPPOLossConfig, a plain PolicyLossConfig or a DictConfig):
    TROLL's reported values where unset."""

    def value(name: str) -> float:
        given = checked(name, policy_loss_get(config, name, None))
        return DEFAULTS[name] if given is None else given

    return TrollOptions(
        eps=value("troll_eps"),
        alpha=value("troll_alpha"),
        support_mass=value("troll_support_mass"),
        topk=configured_topk(config),
    )


def troll_from_extras(mode_name: str, extras: Any, anchor: str, response: torch.Tensor) -> dict[str, torch.Tensor]:
    """The hook's terms of this micro-batch, [batch, response_len] each (padded like old_log_probs)."""
    check_anchor(mode_name, anchor)
    terms = getattr(extras, "troll", None) if extras is not None else None
    if not terms or any(key not in terms for key in OUTPUT_KEYS):
        raise ValueError(
            f"{mode_name} needs TROLL's per-token terms, which the actor's logits hook computes, but this micro-batch "
            "has none. Either the batch lacks the rollout's top-K fields (set "
            f"{ROLLOUT_SETTINGS}), or the loss was not called through verl's FSDP engine with the hook on (the "
            "logits hook, or with use_fused_kernels the fused LM-head pass)"
        )
    for key, value in terms.items():
        if tuple(value.shape) != tuple(response.shape):
            raise ValueError(f"{mode_name}: TROLL term {key} {tuple(value.shape)} vs response {tuple(response.shape)}")
    return terms


def troll_loss_matrix(
    terms: dict[str, torch.Tensor], advantages: torch.Tensor, valid: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Eq. 5 per token (the same formula and ratio cap as `verl_dppo.math.troll.troll_token_loss`), 0 outside
    `valid`; gradient only through log p(a_t) and KL(pi' || sg(p))."""
    log_p = torch.where(valid, terms["log_p"].float(), 0.0)
    log_mu = torch.where(valid, terms["log_mu"].detach().float(), 0.0)
    ratio = capped_ratio(log_p, log_mu)  # exp(min(log r, 20)), as the DPPO modes' ratio
    loss = -ratio * advantages + alpha * terms["regression_kl"].float()
    return torch.where(valid, loss, 0.0)


def troll_ratio_parts(
    terms: dict[str, torch.Tensor], valid: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """actor/troll/* as 0-d (numerator, denominator) sums over the valid tokens (read back with the shared
    diagnostics in one host transfer)."""
    v = valid.float()
    projected = terms["projected"].float() * v
    n_valid, n_projected = v.sum(), projected.sum()
    return {
        "actor/troll/projected_frac": (n_projected, n_valid),
        "actor/troll/eta_mean": ((terms["eta"].float() * projected).sum(), n_projected),
        "actor/troll/kl_before_mean": ((terms["kl_before"].float() * v).sum(), n_valid),
        "actor/troll/kl_after_mean": ((terms["kl_after"].float() * v).sum(), n_valid),
        "actor/troll/support_size_mean": ((terms["support_size"].float() * v).sum(), n_valid),
        "actor/troll/regression_kl_mean": ((terms["regression_kl"].detach().float() * v).sum(), n_valid),
    }


def zero_loss(terms: Optional[dict[str, torch.Tensor]], log_prob: torch.Tensor) -> torch.Tensor:
    """A zero loss that still reaches the parameters (empty responses). Through TROLL's terms when they carry a
    graph: a backward through verl's log_prob would run its in-place cross entropy under TROLL's saved logits."""
    for key in DIFFERENTIABLE:
        value = terms.get(key) if terms else None
        if value is not None and value.requires_grad:
            return value.float().sum() * 0.0
    return log_prob.float().sum() * 0.0


class TrollFamily(LossFamily):
    logits_hook = "troll"
    truncates = False  # Eq. 5 has no ratio cap of its own beyond exp(MAX_LOG_RATIO)
    metric_prefix = "actor/troll/"

    def options(self, mode: LossMode, config: Any):
        options, _, _ = super().options(mode, config)
        troll = troll_options(config)
        return options, troll, troll.describe()

    def check(self, mode: LossMode, options: Any) -> None:
        check_anchor(mode.name, options.anchor)

    def hook_terms(self, mode: LossMode, extras: Any, options: Any, response: torch.Tensor):
        # no D; NaN marks the tokens the hook left out (unusable rollout statistics)
        terms = troll_from_extras(mode.name, extras, options.anchor, response)
        return terms, torch.where(terms["valid"].bool() | ~response, 0.0, float("nan"))

    def loss_matrix(self, tokens: Tokens, blocked: torch.Tensor) -> torch.Tensor:
        return troll_loss_matrix(tokens.hook, tokens.adv, tokens.valid, tokens.family_options.alpha)

    def metrics(self, tokens: Tokens) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return troll_ratio_parts(tokens.hook, tokens.valid)

    def zero_loss(self, tokens: Tokens) -> torch.Tensor:
        return zero_loss(tokens.hook, tokens.log_prob)


FAMILY = TrollFamily(
    (
        # K = 64 when policy_loss.topk is unset: TROLL's reported support size.
        LossMode(
            "troll",
            "TROLL (arXiv 2510.03817): Eq. 5 through the KL projection on mu's top-K",
            default_topk=64,
            label="TROLL",
            color="#9467bd",
            panels="troll",
        ),
    )
)


# ------------------------------------------------------------------ the engines' hooks (FSDP's and Megatron's)


def troll_outputs(
    config: Any,
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """TROLL's per-token terms on the packed stream, (1, local_nnz) float32 each, under `troll_mode.OUTPUT_KEYS`.

    Called inside verl's training forward (no `no_grad`), so log p(a_t) and the regression KL stay attached to the
    logits: verl's engine stores them in model_output as it does the distillation losses, which it back-propagates
    through. `troll_token_terms` saves the logits themselves (no copy) and reads them again in backward; verl's
    flash-attn cross entropy for log_probs writes into the logits in place only if a gradient reaches verl's own
    log_prob, which the troll loss never uses (`verl_dppo.patches.engine_workers` disables that kernel for a run
    whose ppo_loss adds a KL loss on log_prob). Rows outside `mask` hold 0 and valid = 0."""
    options = troll_options(config)
    terms = troll_token_terms(
        logits,
        topk_ids,
        topk_logprobs,
        sampled_ids,
        sampled_logprobs,
        mask,
        eps=options.eps,
        support_mass=options.support_mass,
        topk=options.topk,
    )
    return troll_dict(terms)


def troll_dict(terms) -> dict[str, torch.Tensor]:
    values = {
        "log_p": terms.log_p_sampled,
        "regression_kl": terms.regression_kl,
        "log_mu": terms.log_mu_sampled,
        **terms.diagnostics,
    }
    return {key: values[term].float().unsqueeze(0) for term, key in OUTPUT_KEYS.items()}
