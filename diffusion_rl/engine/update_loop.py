"""The one update loop: epochs × mini-batches × micro-batches × chunks, gradient sync, optimizer steps, metrics.

Every algorithm runs through it (algorithms/base.py says what an algorithm supplies). It never names one.

Scaling: mini-batch m holds units m, m + M, … of the U units the algorithm made of the batch; each chunk's loss
(a mean over its micro-batch's units) is multiplied by len(micro) / (n · K), with n the units that carry weight in
the mini-batch summed over every worker and K the chunks per micro-batch, so the accumulated gradient of an
optimizer step is the mean over the mini-batch's (unit, chunk) pairs, whatever the micro-batch size and the
number of workers. Only the last backward before an optimizer step reduces gradients across workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffusion_rl.algorithms.base import Algorithm, TrainBatch, UpdatePosition, minibatch_rows, pad_units


def reduce_metrics(reports: Sequence[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from several reports of the same metrics (an update's passes; the Ray engine's workers):
    `*_max` the max, `*_min` the min, the rest the mean, each over the reports that have the key (a worker whose
    units only pad reports no loss). Every pass and worker has as many rows, so the mean of their means is the whole
    mean; the mean of their maxima would not be the whole maximum."""
    out = {}
    for name in dict.fromkeys(key for report in reports for key in report):
        values = [float(report[name]) for report in reports if name in report]
        if name.endswith("_max"):
            out[name] = max(values)
        else:
            out[name] = min(values) if name.endswith("_min") else sum(values) / len(values)
    return out


class _Means:
    """Per-pass metrics reduced by `reduce_metrics`, and per-entry metrics (weighted by rows) as their means."""

    def __init__(self):
        self.reports: list[dict] = []
        self.entry_sums: dict[str, float] = {}
        self.entries = 0

    @property
    def passes(self) -> int:
        return len(self.reports)

    def add(self, metrics: dict, entry_metrics: dict, rows: int) -> None:
        self.reports.append(metrics)
        for name, value in entry_metrics.items():
            self.entry_sums[name] = self.entry_sums.get(name, 0.0) + float(value) * rows
        self.entries += rows

    def result(self) -> dict[str, float]:
        out = reduce_metrics(self.reports)
        out.update({name: value / self.entries for name, value in self.entry_sums.items()})
        return out


def run_update(
    algorithm: Algorithm,
    batch: TrainBatch,
    step: int,
    train,
    parallel,
    optimizer,
    pad_to: int = 0,
    padding_only: bool = False,
) -> dict[str, float]:
    """One training step's update of `batch` (this worker's rows); `optimizer` is an engine.optimizer stepper,
    `parallel` the worker's device layout (engine/parallel.py). Returns the update's metrics.

    `pad_to`: the units every worker trains (with several workers, each must take the same passes): this worker's
    are padded with weight-0 copies up to it; `padding_only`: all of this worker's units are such copies."""
    units, out = algorithm.begin(batch, step)
    if padding_only:
        units.weight = torch.zeros_like(units.weight)
    out["train/units"] = float(parallel.sum(algorithm.count(units)))
    units = pad_units(units, pad_to)
    U, M = units.batch_size[0], train.num_minibatches
    means, grad_norms = _Means(), []
    K = algorithm.chunks(units)
    for epoch in range(train.ppo_epochs):
        for m in range(M):
            rows = minibatch_rows(U, M, m).to(units.device)
            # over all workers: each scales by the global count, so the summed gradients are the global mean
            n = parallel.sum(algorithm.count(units[rows]))
            if n == 0:
                continue
            micros = rows.split(algorithm.micro_size)
            for i, micro in enumerate(micros):
                chunk = units[micro]
                for k in range(K):
                    parallel.sync_gradients(last_before_step=(i, k) == (len(micros) - 1, K - 1))
                    loss = algorithm.loss(chunk, k, UpdatePosition(epoch, m, step))
                    (loss.loss * (len(micro) / (n * K))).backward()
                    if algorithm.count(chunk):  # a pass of padding units only trains nothing and reports nothing
                        means.add({"loss": loss.loss.detach(), **loss.metrics}, loss.entry_metrics, len(micro))
            grad_norms.append(optimizer.step())
    if means.passes:
        out.update(means.result())
    parallel.settle()
    out.update(algorithm.end(step))
    out.update(optimizer.metrics(grad_norms))
    return out
