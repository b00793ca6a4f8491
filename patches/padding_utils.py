"""Patch of `verl.trainer.ppo.padding_utils.construct_minimal_padding_template` (v1 batch padding).

Which verl function: it builds a synthetic padding sample (a one-token response) by copying a real sample's fields;
unknown fields keep the real sample's length.
What the wrapper does: resizes `rollout_topk_ids` / `rollout_topk_logprobs` of the padding sample to its one-token
response (zeros; its response_mask is 0, so the logits hook never reads them).
Why no extension point / what would make it unnecessary: verl resizing every per-token field it copies (it knows
`responses`' length), not only the ones it names.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin.topk_mode import TOPK_IDS, TOPK_LOGPROBS

__all__ = ["patch_padding_utils"]


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
