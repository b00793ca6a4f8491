"""What the hf rollout's model takes from a weight push: the names vLLM takes, mapped onto a transformers model.

verl's actor exports Hugging Face checkpoint names, in the forms vLLM's loaders accept, and the hf rollout (the CPU
stand-in for vLLM) takes the same pushes:

- **LoRA, base sync** (`model.lora_rank > 0`, verl's first push with `base_sync_done=False`): the frozen base weights,
  the LoRA-targeted ones named as vLLM's LoRA layers hold them (`...q_proj.base_layer.weight`, verl's
  `replace_lora_wrapper`). They load under the plain name, and a copy of each is kept as the adapter's base.
- **LoRA, adapter sync** (every later push, `peft_config` given and `base_sync_done=True`): PEFT's adapter tensors
  (`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`; vLLM builds a `TensorLoRARequest` of them). Once
  the push is complete, each targeted weight becomes base + scaling x B @ A (scaling = lora_alpha / r, or
  lora_alpha / sqrt(r) with rsLoRA): what vLLM's LoRA layer computes, merged.
- **MoE experts** (transformers 5 keeps Qwen-style experts fused: `mlp.experts.gate_up_proj` [E, 2I, H] and
  `mlp.experts.down_proj` [E, H, I]; verl's `unfuse_moe_params` exports them per expert for vLLM:
  `mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj`, `down_proj`): each lands in its slice of the fused tensor.

A name none of these forms places, or a shape that does not fit, is an error naming it. LoRA options that change
the adapter's arithmetic beyond the scaling (DoRA, per-module rank or alpha patterns, fan-in-fan-out layers) are
refused with the setting to change.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch

__all__ = ["WeightTargets", "lora_settings"]

_EXPERT = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_ADAPTER = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


def lora_settings(peft_config: Any) -> Optional[dict]:
    """The adapter's arithmetic from verl's `peft_config` (a PEFT `LoraConfig` or its dict): {"scaling": s}; None
    for no adapter. Raises ValueError for what the merge cannot reproduce."""
    if peft_config is None:
        return None
    config = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)
    refused = [key for key in ("use_dora", "fan_in_fan_out") if config.get(key)]
    refused += [key for key in ("rank_pattern", "alpha_pattern") if config.get(key)]
    if refused:
        raise ValueError(
            f"the hf rollout merges a plain LoRA adapter (base + alpha/r x B @ A); this one sets "
            f"{', '.join(refused)}: use actor_rollout_ref.rollout.name=vllm, or leave them unset"
        )
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    return {"scaling": alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)}


class WeightTargets:
    """Places pushed (name, tensor) pairs into a model's state, and merges LoRA adapters into it."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.lora_base: dict[str, torch.Tensor] = {}  # targeted weight name -> the frozen base (a copy)
        self._adapter: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A": ..., "B": ...} of this push

    def load(self, named_tensors, lora: Optional[dict] = None) -> int:
        """Load one bucket; `lora` (lora_settings) marks an adapter sync, whose tensors wait for `finish`.
        Returns how many tensors were taken."""
        state = self.model.state_dict()
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                adapter = _ADAPTER.match(name) if lora is not None else None
                if adapter is not None:
                    self._adapter.setdefault(adapter["module"], {})[adapter["part"]] = tensor.detach().to("cpu")
                    count += 1
                    continue
                plain = name.replace(".base_layer.", ".")
                target = self._target(plain, name, state)
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {name}: pushed shape {tuple(tensor.shape)}, the hf rollout's model "
                        f"has {tuple(target.shape)} there"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                if plain != name:  # a LoRA-targeted base weight: the adapter is merged onto it
                    self.lora_base[plain] = target.detach().clone()
                count += 1
        return count

    def finish(self, lora: Optional[dict]) -> int:
        """After the last bucket of an adapter sync: every targeted weight = base + scaling x B @ A. Returns the
        number of weights merged."""
        if lora is None or not self._adapter:
            self._adapter = {}
            return 0
        state = self.model.state_dict()
        merged = 0
        with torch.no_grad():
            for module, parts in sorted(self._adapter.items()):
                name = f"{module}.weight"
                if set(parts) != {"A", "B"}:
                    raise ValueError(
                        f"the LoRA adapter push carried lora_{'A' if 'A' not in parts else 'B'} of "
                        f"{module} without the other"
                    )
                if name not in self.lora_base or name not in state:
                    raise KeyError(
                        f"the LoRA adapter targets {module!r}, whose base weight the hf rollout never "
                        "received (verl pushes the base first, with base_sync_done=False)"
                    )
                base = self.lora_base[name]
                delta = (parts["B"].float() @ parts["A"].float()) * lora["scaling"]
                if tuple(delta.shape) != tuple(base.shape):
                    raise ValueError(f"LoRA of {module}: B @ A is {tuple(delta.shape)}, the weight {tuple(base.shape)}")
                state[name].copy_((base.float() + delta).to(state[name].dtype))
                merged += 1
        self._adapter = {}
        return merged

    def _target(self, name: str, pushed: str, state: dict) -> torch.Tensor:
        if name in state:
            return state[name]
        expert = _EXPERT.match(name)
        if expert is not None:
            fused = state.get(
                f"{expert['base']}.gate_up_proj" if expert["proj"] != "down_proj" else f"{expert['base']}.down_proj"
            )
            if fused is not None and fused.dim() == 3:
                index = int(expert["expert"])
                if index >= fused.shape[0]:
                    raise KeyError(f"the actor pushed {pushed!r}: the hf rollout's model has {fused.shape[0]} experts")
                if expert["proj"] == "down_proj":
                    return fused[index]
                half = fused.shape[1] // 2
                return fused[index, :half] if expert["proj"] == "gate_proj" else fused[index, half:]
        raise KeyError(f"the actor pushed weight {pushed!r}, which the hf rollout's model does not have")
