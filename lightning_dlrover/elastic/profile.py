"""The per-job curves the simulator uses, measured from our DLRM on this machine, and the measurements behind them.

``python -m lightning_dlrover.cli.profile --out lightning_dlrover/elastic/dlrm_profile.json`` (its command line
is :mod:`lightning_dlrover.cli.profile`) measures:

* ``step_s[b]``: median seconds of one training step (forward, backward, in-backward RowWiseAdagrad on the
  tables, Adagrad on the MLPs) of the DLRM at per-rank batch ``b``, one thread;
* ``allreduce_s``: median seconds of a gloo all-reduce of the dense gradients between two processes;
* ``samples_to_target[B]``: training samples until the validation loss (8192 held-out samples of the same
  synthetic distribution, checked every
  ``eval_every`` samples) first reaches the target, at global batch ``B`` with the learning rates scaled by the
  square-root rule from ``base_batch`` (reached linearly over the first ``--warmup-steps`` steps, from the base
  batch's rates, as :class:`~lightning_dlrover.elastic.scaler.ElasticBatchScaler` ``(warmup_steps=...)`` does).
  The target is 90% of the loss drop the smallest batch achieves in ``budget`` samples. Several seeds; the median is kept, and each seed's value. A batch that did not reach the
  target in ``3 x budget`` samples is *censored*: it needs more than that, how much more is unknown.

:class:`Profile` turns these into the simulator's throughput and convergence curves.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_PROFILE = "dlrm_profile.json"
SIZES = [300 + 37 * i for i in range(26)]


@dataclass(frozen=True)
class Profile:
    """Measured curves of one job kind (see the module docs)."""

    step_s: dict[int, float]
    allreduce_s: float
    samples_to_target: dict[int, float]
    base_batch: int
    meta: dict[str, Any]
    censored_at: float | None = None  # censored batches needed more than this many samples
    censored: tuple[int, ...] = ()  # batches that did not reach the target (not in samples_to_target)

    @classmethod
    def load(cls, path: str | Path | None = None, seed: int | None = None) -> Profile:
        """The profile at ``path``, or the one shipped with the package; with ``seed``, the convergence curve of
        that seed alone (from ``samples_to_target_seeds``) instead of the median over seeds."""
        text = Path(path).read_text() if path else resources.files("lightning_dlrover.elastic").joinpath(
            DEFAULT_PROFILE).read_text()
        raw = json.loads(text)
        needed = raw["samples_to_target"]
        if seed is not None:
            seeds = raw.get("meta", {}).get("seeds")
            if "samples_to_target_seeds" not in raw or seed not in (seeds or []):
                raise ValueError(f"the profile has no convergence curve of seed {seed} (its seeds: {seeds}); "
                                 "measure it with python -m lightning_dlrover.cli.profile --seeds ...")
            needed = {k: v[seeds.index(seed)] for k, v in raw["samples_to_target_seeds"].items()}
        return cls({int(k): v for k, v in raw["step_s"].items()}, raw["allreduce_s"],
                   {int(k): v for k, v in needed.items() if v is not None}, raw["base_batch"], raw.get("meta", {}),
                   raw.get("censored_at"), tuple(sorted(int(k) for k, v in needed.items() if v is None)))

    @property
    def largest_known(self) -> int:
        """The largest batch whose samples to the target are measured, below every censored batch: beyond it
        :meth:`samples_needed` is only a lower bound."""
        known = [b for b in self.samples_to_target if not any(c < b for c in self.censored)]
        if not known:
            raise ValueError("the profile has no batch that reached the target; measure with a larger --budget.")
        return max(known)

    def known(self, global_batch: float) -> bool:
        """Whether :meth:`samples_needed` at ``global_batch`` is measured (interpolated), not a lower bound."""
        return global_batch <= self.largest_known

    def step_time(self, per_rank_batch: float, ranks: int) -> float:
        """Seconds per step: measured compute at the per-rank batch (linear between measurements) plus a ring
        all-reduce, ``allreduce_s * 2 (n - 1) / n`` scaled from the 2-rank measurement (``n = ranks``)."""
        xs = sorted(self.step_s)
        compute = float(np.interp(per_rank_batch, xs, [self.step_s[x] for x in xs]))
        if per_rank_batch > xs[-1]:  # extrapolate linearly beyond the largest measured batch
            compute = self.step_s[xs[-1]] * per_rank_batch / xs[-1]
        return compute + (self.allreduce_s * (ranks - 1) / ranks * 2 if ranks > 1 else 0.0)

    def throughput(self, ranks: int, global_batch: int) -> float:
        """Samples per second at ``ranks`` ranks and ``global_batch``."""
        return global_batch / self.step_time(global_batch / ranks, ranks)

    def samples_needed(self, global_batch: int) -> float:
        """Samples to the target loss at ``global_batch``: log-log interpolation between measured batches up to
        :attr:`largest_known`. Beyond it a lower bound (see :meth:`known`): ``censored_at`` from the first censored
        batch on, else the largest known batch's samples (larger batches have never needed fewer here)."""
        known = {b: v for b, v in self.samples_to_target.items() if b <= self.largest_known}
        xs = sorted(known)
        if global_batch > xs[-1]:
            hit = any(c <= global_batch for c in self.censored) and self.censored_at is not None
            return float(max(known[xs[-1]], self.censored_at if hit else 0.0))
        ys = [math.log(known[x]) for x in xs]
        return float(math.exp(np.interp(math.log(global_batch), [math.log(x) for x in xs], ys)))

    def efficiency(self, global_batch: int) -> float:
        """Statistical efficiency relative to ``base_batch``: samples needed there over samples needed here (an
        upper bound where :meth:`known` is false)."""
        return self.samples_needed(self.base_batch) / self.samples_needed(global_batch)


BASE_LR = 0.05


def _model_and_optimizer(lr_scale: float, seed: int) -> tuple[Any, Any]:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from lightning_dlrover.data.sources import NUM_DENSE, SPARSE_NAMES

    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=16, num_embeddings=n, feature_names=[f])
              for f, n in zip(SPARSE_NAMES, SIZES)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=NUM_DENSE,
                 dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 32, 1])
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": BASE_LR * lr_scale})
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch")]
    return model, torch.optim.Adagrad(dense, lr=BASE_LR * lr_scale)


def _batches(batch: int, count: int, seed: int, first: int = 0) -> Any:
    """Batches ``first..first+count`` of the synthetic stream of ``seed`` (one labelling function per seed)."""
    from lightning_dlrover.data.sources import SyntheticCriteo, make_batch

    source = SyntheticCriteo(SIZES, (first + count) * batch, seed=seed)
    for index in range(first, first + count):
        yield make_batch(*source.rows(index * batch, (index + 1) * batch))


def _step(model: Any, optimizer: Any, batch: Any) -> float:
    import torch

    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        model(batch.dense_features, batch.sparse_features).squeeze(-1), batch.labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def measure_step_times(batches: list[int], steps: int = 12) -> dict[int, float]:
    out = {}
    for b in batches:
        model, optimizer = _model_and_optimizer(1.0, 0)
        times = []
        for i, batch in enumerate(_batches(b, steps + 3, seed=3)):
            start = time.perf_counter()
            _step(model, optimizer, batch)
            if i >= 3:
                times.append(time.perf_counter() - start)
        out[b] = statistics.median(times)
    return out


def _allreduce_worker(rank: int, path: str, numel: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    tensor, times = torch.randn(numel), []
    for i in range(33):
        start = time.perf_counter()
        dist.all_reduce(tensor, group=dist.group.WORLD)  # the data plane's all-reduce is what is measured
        if i >= 3:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def measure_allreduce() -> float:
    import torch.multiprocessing as mp

    model, _ = _model_and_optimizer(1.0, 0)
    numel = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("sparse_arch"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_allreduce_worker, args=(r, os.path.join(tmp, "store"), numel, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        seconds = out.get(timeout=300)
        for p in procs:
            p.join()
    return seconds


def _val_loss(model: Any, val: list[Any]) -> float:
    import torch

    with torch.no_grad():
        losses = [torch.nn.functional.binary_cross_entropy_with_logits(
            model(b.dense_features, b.sparse_features).squeeze(-1), b.labels, reduction="sum") for b in val]
    return float(sum(losses)) / sum(b.labels.numel() for b in val)


def _set_rate(model: Any, optimizer: Any, lr: float) -> None:
    """Sets the rate of the dense optimizer and of the tables' in-backward optimizers."""
    from lightning_dlrover.torchrec_glue import in_backward_optimizers

    for group in optimizer.param_groups:
        group["lr"] = lr
    for param in model.sparse_arch.parameters():
        for sparse in in_backward_optimizers(param):
            for group in sparse.param_groups:
                group["lr"] = lr


def loss_curve(batch: int, base_batch: int, samples: int, eval_every: int, seed: int,
               warmup_steps: int = 0) -> list[tuple[int, float]]:
    """``(samples seen, validation loss)`` at batch ``batch`` with the square-root LR rule from ``base_batch``; with
    ``warmup_steps``, the rates start at the base batch's and reach the rule's linearly over that many steps (as
    :class:`~lightning_dlrover.elastic.scaler.ElasticBatchScaler` ``(warmup_steps=...)`` does after a change)."""
    from lightning_dlrover.elastic.batch import warmup_rate

    target = BASE_LR * math.sqrt(batch / base_batch)
    model, optimizer = _model_and_optimizer(math.sqrt(batch / base_batch), seed)
    val = list(_batches(1024, 8, seed=seed, first=1_000_000))  # held out: same labels, unseen samples
    curve, seen, next_eval = [(0, _val_loss(model, val))], 0, eval_every
    for step, b in enumerate(_batches(batch, -(-samples // batch), seed=seed), 1):
        if warmup_steps and batch != base_batch:
            _set_rate(model, optimizer, warmup_rate(BASE_LR, target, step, warmup_steps))
        _step(model, optimizer, b)
        seen += batch
        if seen >= next_eval:
            curve.append((seen, _val_loss(model, val)))
            next_eval += eval_every
    return curve


def _curve_job(job: tuple[tuple[int, int, int, int, int, int], str | None]) -> list[tuple[int, float]]:
    """One curve; with a folder, read from it if measured before, else measured and written there."""
    import torch

    args, folder = job
    path = Path(folder) / ("curve_" + "_".join(map(str, args)) + ".json") if folder else None
    if path is not None and path.exists():
        return [tuple(p) for p in json.loads(path.read_text())]
    torch.set_num_threads(1)
    curve = loss_curve(*args)
    if path is not None:
        path.write_text(json.dumps(curve))
    return curve


def _median_censored(values: list[float | None]) -> float | None:
    """Median of right-censored values (``None``: more than any value): known while fewer than half are censored."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    if len(ordered) % 2:
        return ordered[len(ordered) // 2]
    low, high = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
    return None if low is None or high is None else (low + high) / 2


def measure_convergence(batches: list[int], base_batch: int, budget: int, eval_every: int, seeds: list[int],
                        warmup_steps: int = 0, workers: int = 1, curves_dir: str | None = None
                        ) -> tuple[dict[int, float | None], dict[int, list[float | None]], dict[str, Any]]:
    """Samples to the target per batch: the median over ``seeds`` (``None``: censored, more than ``3 x budget``
    for half the seeds or more), each seed's (``None`` where censored), and the curves. ``workers`` processes;
    ``curves_dir`` keeps each curve as it is measured, so a measurement stopped half-way goes on from there."""
    import torch.multiprocessing as mp

    jobs = [(b, s) for s in seeds for b in batches]
    args = [(b, base_batch, budget * (1 if b == batches[0] else 3), eval_every, s, warmup_steps) for b, s in jobs]
    if workers > 1:
        with mp.get_context("spawn").Pool(workers) as pool:
            done = pool.map(_curve_job, [(a, curves_dir) for a in args], chunksize=1)
    else:
        done = [_curve_job((a, curves_dir)) for a in args]
    curves = dict(zip(jobs, done))
    targets = {}
    for s in seeds:
        first = curves[(batches[0], s)]
        start, best = first[0][1], min(loss for _, loss in first)
        targets[s] = best + 0.1 * (start - best)
    per_seed: dict[int, list[float | None]] = {}
    for b in batches:
        per_seed[b] = [next((float(seen) for seen, loss in curves[(b, s)] if seen > 0 and loss <= targets[s]), None)
                       for s in seeds]
    result = {b: _median_censored(v) for b, v in per_seed.items()}
    meta = {"targets": targets, "seeds": seeds, "curves": {f"{b}/{s}": c for (b, s), c in curves.items()}}
    return result, per_seed, meta
