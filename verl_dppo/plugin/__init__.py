"""The verl layer: what plugs into verl 0.9.1's public extension points only.

- `entry`: the `verl.plugins` entry point (`import verl` loads it in every process): version check, registration,
  the patches' installation.
- `config`: `DPPOLossConfig`, a subclass of verl's `PolicyLossConfig` (selected with `policy_loss._target_`).
- `losses`: the loss modes, registered in verl's `POLICY_LOSS_REGISTRY`; `topk_mode`: the Top-K modes' loss side.
- `extras`, `metrics`: what the loss reads beyond verl's arguments, and diagnostics that aggregate exactly.
- `run_config`: checks of a whole run's config; `compat`: the supported verl versions.
"""
