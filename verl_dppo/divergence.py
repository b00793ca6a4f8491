"""Deprecated: the divergences live in `verl_dppo.math.divergence` and `verl_dppo.math.topk`."""

from verl_dppo._deprecated import moved

moved("verl_dppo.divergence", "verl_dppo.math.divergence (Top-K: verl_dppo.math.topk)")

from verl_dppo.math.divergence import *  # noqa: E402,F401,F403
from verl_dppo.math.divergence import LOG_FLOOR  # noqa: E402,F401
from verl_dppo.math.topk import topk_divergence  # noqa: E402,F401
