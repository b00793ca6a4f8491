"""The math layer: pure torch, no verl import anywhere below this package.

Modules are imported by their own names (`from verl_dppo.math.troll import troll_token_terms`); this file imports
nothing, so that `import verl_dppo.math` costs nothing and pulls in no verl.

  divergence     binary TV / KL of the sampled token, Eq. (13)/(14), and the ratio's deviation (Eq. 9/10)
  topk           Top-K TV / KL, Eq. (15)/(16), chunked over the rows; a vocabulary-parallel variant (Megatron TP)
  trust_region   the one mask of Eq. (12) that every loss mode uses
  troll          TROLL's KL trust-region projection on a sparse support (Becker et al. 2025, arXiv 2510.03817)
"""
