"""The cluster-shapes tier's observation of verl's rank aggregation (loaded through PYTHONPATH in a run's Ray
processes; it changes no value).

Where `DPPO_TEST_PARTS` names a folder, every call of `verl_dppo.plugin.metrics.exact_ratio_metrics` (one per
mini-batch, on the worker that returns the mini-batch's metrics gathered over the data-parallel ranks) appends a
JSON line to `<folder>/<pid>.jsonl`: for each ratio metric, the per-rank list of its micro-batches' (numerator,
denominator) parts and the value the plugin writes back. The test then checks that value against the parts, and
the JSONL log against the values.
"""

import json
import os

if os.environ.get("DPPO_TEST_PARTS"):
    from verl_dppo.patches._import_hook import when_imported

    def _observe(module):
        original = module.exact_ratio_metrics

        def exact_ratio_metrics(metrics):
            ratio = {
                name: value if isinstance(value, list) else [value]
                for name, value in metrics.items()
                if all(isinstance(m, module.RatioMetric) for m in (value if isinstance(value, list) else [value]))
            }
            parts = {name: [list(m.parts) for m in group] for name, group in ratio.items()}
            result = original(metrics)
            record = {
                name: {"parts": parts[name], "written": group[0].values[0] if group[0].values else None}
                for name, group in ratio.items()
            }
            path = os.path.join(os.environ["DPPO_TEST_PARTS"], f"{os.getpid()}.jsonl")
            with open(path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            return result

        module.exact_ratio_metrics = exact_ratio_metrics

    when_imported("verl_dppo.plugin.metrics", _observe)
