"""Deprecated: `DPPOLossConfig` is `verl_dppo.DPPOLossConfig` (defined in `verl_dppo.plugin.config`)."""

from verl_dppo.plugin.config import ANCHORS, DPPOLossConfig, ResolvedOptions, resolve_options  # noqa: F401
