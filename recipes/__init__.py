"""verl-dppo's reproduction recipes (Hydra config groups), shipped inside the package as `verl_dppo.recipes`."""
