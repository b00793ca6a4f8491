"""Deprecated: the verl layer moved to `verl_dppo.plugin` (registration, `DPPOLossConfig`, the entry point) and
`verl_dppo.patches` (the runtime patches of verl)."""

from verl_dppo._deprecated import moved

moved("verl_dppo.adapter", "verl_dppo.plugin and verl_dppo.patches")
