"""What `verl-dppo check` and `verl-dppo run` find in a command before anything launches, beside verl's own checks.

- `overrides`: each override against the config it changes (a key verl's config lacks, with the line that works: the
  nearest keys, a plugin key's `+`, a top-level group; a value of the wrong type; a sweep; a `+key` Hydra refuses),
  and the hints beside a config class's complaint; `value_types`: the type an override's value must have.
- `command`: the settings around the policy loss (distillation, rejection sampling under bypass, unread DPPO
  options, R3's returned routes), the paths verl opens at launch left empty, the models verl's checks would read and
  cannot here, and the hints beside verl's complaints.

The plugin's rules that the workers also enforce live in `verl_dppo.plugin.run_config` (one definition, read here
and at run time: the async trainers, the anchor, R3 and router replay on a model that routes nothing) and
`verl_dppo.plugin.options` (each loss option's rule, which DPPOLossConfig and the loss apply);
`verl_dppo.plugin.moe.arm` names the MoE arm the summary says.
"""
