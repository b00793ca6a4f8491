"""Deprecated: the Top-K divergences live in `verl_dppo.math.topk`."""

from verl_dppo._deprecated import moved

moved("verl_dppo.topk", "verl_dppo.math.topk")

from verl_dppo.math.topk import *  # noqa: E402,F401,F403
from verl_dppo.math.topk import DEFAULT_CHUNK_BYTES, MASS_TOLERANCE, TopKInputError, divergence_at_slots  # noqa: E402,F401
