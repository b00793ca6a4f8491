"""`model_engine=megatron` on the CPU platform: the settings verl's Megatron engine needs there, and what stops it.

With megatron-core 0.16.1 and mbridge 0.15.1 installed (the README's set-up installs them, without dependencies) and
the plugin's shim (`verl_dppo.rehearsal.megatron_shim`), verl 0.9.1's Megatron engine trains a CPU run. What the run's
config must say there, each for a reason met on this CPU (docs/megatron-cpu.md):

| key | value | why |
|---|---|---|
| `actor.strategy`, `ref.strategy` | megatron | a CPU setup (cpu_tiny) names FSDP2 |
| `actor.fsdp_config`, `actor.optim.lr_scheduler_type` | removed | FSDP's keys: Megatron's config classes reject them |
| `*.megatron.vanilla_mbridge` | True | verl's default, Megatron-Bridge, needs Python 3.12 or TransformerEngine |
| `*.megatron.dtype` | float32 | a CPU has no fast bf16, and the rollout side is fp32 (the shim lets verl's check accept it) |
| `model.use_remove_padding`, `*.megatron.use_remove_padding` | False | packed (THD) sequences need TransformerEngine's attention; verl copies the model's key over the engine's |
| `*.megatron.override_transformer_config.attention_backend` | local | verl's default is flash |
| `*.megatron.sequence_parallel` (and in `override_transformer_config`) | False | torch's norms refuse sequence parallelism; mbridge sets it from TP>1 unless overridden |
| `*.megatron.use_distributed_optimizer` | True | verl's weight export reads the distributed optimizer's parameter buffer (without it: "'NoneType' object has no attribute 'storage'" at the first sync) |
| MoE models (cpu_tiny's `dppo.tiny_model.num_experts` > 0): `moe_grouped_gemm`, `persist_layer_norm`, `bias_activation_fusion`, `bias_dropout_fusion` | False | TransformerEngine's or Apex's kernels |
| MoE models: `moe_token_dispatcher_type` | alltoall | the dispatcher that runs over gloo |

Values a user set on the command line for other keys (TP, EP, the optimizer's lr) are kept.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf, open_dict

__all__ = ["MEGATRON_CPU_TRANSFORMER", "megatron_cpu_problems", "megatron_cpu_settings", "megatron_support"]

ENGINE = {
    "vanilla_mbridge": True,
    "dtype": "float32",
    "use_remove_padding": False,
    "sequence_parallel": False,
    "use_distributed_optimizer": True,
}
MEGATRON_CPU_TRANSFORMER = {"attention_backend": "local", "sequence_parallel": False}
MOE_TRANSFORMER = {
    "moe_grouped_gemm": False,
    "persist_layer_norm": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "moe_token_dispatcher_type": "alltoall",
}


def uses_megatron(config: Any) -> bool:
    return str(config.get("model_engine", "dp")) == "megatron"


def megatron_support() -> dict[str, str]:
    """What the environment has for Megatron on CPU: each package's version, or why it cannot serve."""
    from importlib.metadata import PackageNotFoundError, version

    from verl_dppo.rehearsal.megatron_shim import KNOWN_VERSIONS

    found = {}
    for distribution in KNOWN_VERSIONS:
        try:
            found[distribution] = version(distribution)
        except PackageNotFoundError:
            found[distribution] = "not installed"
    return found


def megatron_cpu_problems(config: Any) -> list[str]:
    """What stops `model_engine=megatron` on CPU here: megatron-core or mbridge missing, or not the versions the
    shim was read against."""
    from verl_dppo.rehearsal.megatron_shim import KNOWN_VERSIONS

    found = megatron_support()
    wrong = [f"{name} {found[name]} (needs {known})" for name, known in KNOWN_VERSIONS.items() if found[name] != known]
    if not wrong:
        return []
    pins = " ".join(f"{name}=={known}" for name, known in KNOWN_VERSIONS.items())
    return [
        f"model_engine=megatron on CPU (trainer.device=cpu) needs megatron-core and mbridge at the versions the "
        f"plugin's CPU shim was read against, and this environment has {', '.join(wrong)}: run `make venv` in the "
        f"verl-dppo checkout, or `pip install --no-deps {pins}`; or drop model_engine=megatron"
    ]


def _is_moe(config: Any) -> bool:
    tiny = config.get("dppo", {}).get("tiny_model", {}) or {}
    return int(tiny.get("num_experts", 0) or 0) > 0


def megatron_cpu_settings(config: Any) -> None:
    """The settings above, on a `trainer.device=cpu` run with model_engine=megatron (the run's name says megatron:
    `cpu_engines.run_suffix`)."""
    role_config = config.actor_rollout_ref
    transformer = dict(MEGATRON_CPU_TRANSFORMER, **(MOE_TRANSFORMER if _is_moe(config) else {}))
    with open_dict(role_config):
        with open_dict(role_config.model):
            role_config.model.use_remove_padding = False
        for role in ("actor", "ref"):
            node = role_config.get(role)
            if node is None:
                continue
            with open_dict(node):
                node.strategy = "megatron"
                node.pop("fsdp_config", None)
                if node.get("optim") is not None:
                    with open_dict(node.optim):
                        node.optim.pop("lr_scheduler_type", None)
                if node.get("megatron") is None:
                    continue
                with open_dict(node.megatron):
                    for key, value in ENGINE.items():
                        node.megatron[key] = value
                    if OmegaConf.is_interpolation(node.megatron, "override_transformer_config"):
                        continue  # the reference model's follows the actor's (verl's megatron_ref.yaml)
                    if node.megatron.get("override_transformer_config") is None:
                        node.megatron.override_transformer_config = {}
                    with open_dict(node.megatron.override_transformer_config):
                        for key, value in transformer.items():
                            node.megatron.override_transformer_config[key] = value
