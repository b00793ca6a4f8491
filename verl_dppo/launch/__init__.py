"""Launching and checking a run: what a cluster user touches through `verl-dppo recipes | run | data | check | doctor`.

- `commands`: the `recipes`, `run` and `data` commands, and the launch on Ray.
- `compose` (with `recipe_files`, `user_recipes`, `findings.overrides`): a setup and a method composed on verl's
  `ppo_trainer.yaml` with the user's overrides, checked as verl and the plugin would.
- `preflight`: what must hold before a launch (paths, data, the Ray cluster, a CPU run's checks).
- `check`: `verl-dppo check`, every problem of a command in one run, and its rehearsal on the CPU.
- `doctor` (with `install_probe` and `ray_probe`): what `import verl` gives this process and a Ray worker.
- `console`, `run_record`, `run_logs`: what a launch prints, which run a checkpoint folder belongs to, where a run
  logs and how its log is read back.
- `ray_reaper`: a local Ray's processes and shared memory, gone when a launch ends.

Above the plugin and the CPU rehearsal (a CPU run is set up by `verl_dppo.rehearsal.setups`), below the studies,
which launch runs through it, and the command line, which only parses.
"""
