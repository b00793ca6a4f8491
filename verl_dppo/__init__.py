"""verl-dppo: DPPO (Divergence Proximal Policy Optimization, arXiv 2602.04879) as a verl plugin.

Layers, imported downward only (tests/test_layout.py):
  verl_dppo.cli        the `verl-dppo` command line: argument parsing and the list of commands
  verl_dppo.studies    the demo, the staleness study, the real LLM's studies, plots
  verl_dppo.launch     launching and checking a run: recipes, run, data, check, doctor
  verl_dppo.rehearsal  the CPU rehearsal: what exists only so that verl runs on CPUs (its own entry point)
  verl_dppo.plugin     verl's public extension points: entry point, DPPOLossConfig, the registered loss modes
  verl_dppo.patches    runtime patches of verl where it has no extension point (from patches/ in the checkout)
  verl_dppo.math       pure torch (no verl import): divergences, Top-K statistics, the mask, TROLL's projection
and two leaf modules every command layer shares: `errors` (the user's mistake: one line, exit 2) and `datasets` (the
paper's data sets in verl's schema, `verl-dppo data`; cpu_tiny's data takes the same form).
What a cluster process loads is `plugin`, `patches` and `math`; nothing there imports the layers above.

`import verl` loads the plugin (entry point group `verl.plugins`); users never import this package themselves.
"""

__version__ = "0.1.0"

__all__ = ["DPPOLossConfig", "__version__"]


def __getattr__(name):
    # Lazy, so that `import verl_dppo.math` stays free of verl (Hydra's _target_ lookup still finds it).
    if name == "DPPOLossConfig":
        from verl_dppo.plugin.config import DPPOLossConfig

        return DPPOLossConfig
    raise AttributeError(f"module 'verl_dppo' has no attribute {name!r}")
