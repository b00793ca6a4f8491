"""Deprecated: the mask lives in `verl_dppo.math.trust_region`."""

from verl_dppo._deprecated import moved

moved("verl_dppo.trust_region", "verl_dppo.math.trust_region")

from verl_dppo.math.trust_region import *  # noqa: E402,F401,F403
