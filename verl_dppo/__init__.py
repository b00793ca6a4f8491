"""verl-dppo: DPPO (Divergence Proximal Policy Optimization, arXiv 2602.04879) as a verl plugin.

Layers, imported downward only:
  verl_dppo.divergence, verl_dppo.trust_region   pure torch math (no verl import)
  verl_dppo.adapter                              verl: registration, config, anchoring hook
  verl_dppo.cli                                  the `verl-dppo` command line

`import verl` loads the plugin (entry point group `verl.plugins`); users never import this package themselves.
"""

__version__ = "0.1.0"

__all__ = ["DPPOLossConfig", "__version__"]


def __getattr__(name):
    # Lazy, so that `import verl_dppo.divergence` stays free of verl (Hydra's _target_ lookup still finds it).
    if name == "DPPOLossConfig":
        from verl_dppo.adapter.config import DPPOLossConfig

        return DPPOLossConfig
    raise AttributeError(f"module 'verl_dppo' has no attribute {name!r}")
