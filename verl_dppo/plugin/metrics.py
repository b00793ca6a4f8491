"""Diagnostics that stay exact through verl's metric aggregation.

verl 0.9.1 wraps every policy-loss metric as a MEAN `Metric` per micro-batch; the worker then takes, per mini-batch,
the mean over data-parallel ranks and micro-batches (`Metric.aggregate_dp` in `TrainingWorker.train_mini_batch`).
For a mean over a condition (the masked fraction among A > 0 tokens, mu(a_t) of the masked tokens, ...) that
equal-weight mean of per-micro-batch ratios is biased: with dynamic batch sizes a micro-batch may hold two
sequences, all with A > 0, and a micro-batch with no such token reports 0.

`RatioMetric` is a MEAN `Metric` (so verl's code handles it unchanged) that also carries each micro-batch's
(numerator, denominator). `exact_ratio_metrics` replaces, after verl has gathered a mini-batch's metrics from
every rank, each ratio metric's values by sum(numerators) / sum(denominators): the value over the whole
mini-batch and all ranks, whatever the micro-batching. verl's later mean over mini-batches is left as it is.
"""

from __future__ import annotations

from typing import Any

from verl.utils.metric import AggregationType, Metric

__all__ = ["RatioMetric", "ratio_of", "ratios", "finalize_metrics", "exact_ratio_metrics", "MAX_METRICS"]

MAX_METRICS = ("actor/dppo/mismatch_tv_max",)
"""Maxima over tokens: verl would average them over micro-batches unless given MAX aggregation."""


def ratio_of(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0 when nothing was counted (no token of the kind)."""
    return numerator / denominator if denominator > 0 else 0.0


def ratios(parts: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each (numerator, denominator) of `parts` as its `ratio_of`: a micro-batch's metric values."""
    return {name: ratio_of(numerator, denominator) for name, (numerator, denominator) in parts.items()}


class RatioMetric(Metric):
    """A MEAN metric whose exact value over many micro-batches is sum(numerators) / sum(denominators)."""

    def __init__(self, numerator: float | None = None, denominator: float | None = None) -> None:
        super().__init__(aggregation=AggregationType.MEAN)
        self.parts: list[tuple[float, float]] = []
        if numerator is not None:
            self.add(numerator, denominator)

    def add(self, numerator: float, denominator: float) -> None:
        self.parts.append((float(numerator), float(denominator)))
        self.values.append(ratio_of(numerator, denominator))

    def extend(self, values: Any) -> None:
        if isinstance(values, RatioMetric):
            for part in values.parts:
                self.add(*part)
            return
        raise TypeError("a RatioMetric only merges with another RatioMetric (its parts would be lost)")

    def init_list(self) -> "RatioMetric":
        return RatioMetric()

    def exact(self) -> float:
        return ratio_of(sum(n for n, _ in self.parts), sum(d for _, d in self.parts))

    def aggregate(self) -> float:
        return self.exact()


def finalize_metrics(metrics: dict, ratio_parts: dict[str, tuple[float, float]] | None) -> dict:
    """The metrics verl's `ppo_loss` returns for one micro-batch, with our mean-type diagnostics as `RatioMetric`s
    and max-type ones with MAX aggregation (ppo_loss wraps every loss metric as a MEAN)."""
    for name, part in (ratio_parts or {}).items():
        if name in metrics:
            metrics[name] = RatioMetric(*part)
    for name in MAX_METRICS:
        metric = metrics.get(name)
        if isinstance(metric, Metric) and metric.aggregation is not AggregationType.MAX:
            maximum = Metric(aggregation=AggregationType.MAX)
            maximum.extend(list(metric.values))
            metrics[name] = maximum
    return metrics


def exact_ratio_metrics(metrics: dict) -> dict:
    """Make every ratio metric of one mini-batch exact before verl aggregates it.

    `metrics` is what `TrainingWorker.train_batch` returns: name -> a `Metric` of the micro-batches (one rank) or a
    list of them (one per data-parallel rank, after verl's all-gather). Each ratio metric's values all become the
    exact value, so verl's mean over ranks and micro-batches returns it unchanged.
    """
    for value in metrics.values():
        group = value if isinstance(value, list) else [value]
        if not group or not all(isinstance(metric, RatioMetric) for metric in group):
            continue
        exact = ratio_of(sum(n for m in group for n, _ in m.parts), sum(d for m in group for _, d in m.parts))
        for metric in group:
            metric.values = [exact] * len(metric.values)
    return metrics
