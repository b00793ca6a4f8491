"""The studies and their figures, each a `verl-dppo` command:

- `demo/`: the paper's comparison on a toy task in seconds (`verl-dppo demo`, `make demo`), and the staleness study
  (`verl-dppo staleness`, `demo/staleness.py`).
- `mismatch`: the paper's Figure 2 on a real LLM's own tokens (`verl-dppo mismatch`).
- `study` (with `study_figure`): four methods x seeds through verl's trainer on the real LLM (`verl-dppo study`).
- `plot` (with `colors`): any run's JSONL log drawn (`verl-dppo plot`).
- `launches`: how `mismatch` and `study` follow their `verl-dppo run` launches and end them when they are ended.

The top of the layers but for the command line: they launch runs through `verl_dppo.launch` and read the plugin's
math; nothing else imports them.
"""
