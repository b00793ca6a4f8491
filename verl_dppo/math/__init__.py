"""The math layer: pure torch, no verl import anywhere below this package.

Modules are imported by their own names (`from verl_dppo.math.troll import troll_token_terms`); this file imports
nothing, so that `import verl_dppo.math` costs nothing and pulls in no verl.

  troll   TROLL's KL trust-region projection on a sparse support (Becker et al. 2025, arXiv 2510.03817)
"""
