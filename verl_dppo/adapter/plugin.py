"""Deprecated entry point (installs made before 0.2 name it): loads `verl_dppo.plugin.entry`."""

from verl_dppo.plugin.entry import REGISTERED_MODES, load  # noqa: F401
