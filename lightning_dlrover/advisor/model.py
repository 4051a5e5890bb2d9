"""The resource-performance model: step time of a DLRM job as a function of the resources it is given.

A step of synchronous training lasts as long as its slowest rank. Its time is modelled in three parts, each
a sum of terms ``coefficient x feature`` whose coefficients are non-negative and fitted by non-negative least
squares (``scipy.optimize.nnls``) on measured steps, rows weighted by ``1 / measured`` so that the fit
minimises relative error. Notation: ``n`` nodes, ``g`` ranks per node, ``W = n g`` ranks, ``t`` threads per
rank, ``d`` data workers per rank, ``b`` samples per rank per step, ``C`` cores per node, ``D`` embedding
floats pooled per sample (sum over tables of pooling factor x dimension), ``s_W`` the busiest rank's share
of the embedding work under the sharding plan at ``W`` ranks, ``P`` dense (replicated) parameters.

CPU sharing: every busy thread on a node gets ``q = min(1, C / (g (t + u)))`` of a core, where ``u`` is the
cores a rank's data workers keep busy; a rank computes on ``p = t q`` cores.

1. Training time (forward, backward, optimizer), seconds per step::

       T_train = th0                         fixed: hooks, Python, kernel launches per step     [1]
               + th1 b / p                   dense MLP work, split over the rank's cores        [sample/core]
               + th2 W b s_W D / p           lookups and fused updates of the busiest rank's    [float/core]
                                             tables (they serve the global batch)
               + th3 b / q                   single-threaded per-sample work (sparse features,  [sample]
                                             Python), slowed when a thread has < 1 core
               + th4 b o                     oversubscription, o = max(0, g (t + u) - C) / C:   [sample]
                                             context switches and spinning thread pools
               + th5 2 b D (W - 1) / W       all-to-all of pooled embeddings, fwd + bwd         [float]
               + th6 (W - 1)                 per-peer latency of the step's collectives         [peer]
               + th7 2 P (W - 1) / W         ring all-reduce of the dense gradients             [float]
               + th8 o [t > 1]               intra-op thread pools on fewer free cores than     [1]
                                             threads: every parallel region waits at its barrier
                                             for a descheduled sibling (per step, not per sample;
                                             measured here: 10-40x slower steps with 2 threads
                                             per rank while other programs hold the cores)

2. Making a batch (measured as the data wait of jobs whose batches are made in the training process,
   ``d = 0``), seconds per step::

       T_make = (ph0 + ph1 b + ph2 W b) / q       per step, per rank sample, per global-batch sample
                                                  (a source that generates the whole global batch and
                                                  slices it costs W b)

3. Data wait. With ``d = 0`` it is ``T_make``. With ``d > 0`` workers make batches ahead in parallel (each
   taking ``T_make`` with ``q`` evaluated for its own core share); the rank waits only if they fall behind,
   plus the hand-over of each batch::

       T_wait = max(0, T_make / d - T_train) + ps0 b                                              [sample]

   and the workers keep ``u = min(d, T_make(q = 1) / T_step)`` cores busy, which slows training; ``u`` is
   solved by fixed-point iteration.

Step time ``T_step = T_train + T_wait``; throughput ``W b / T_step`` samples/s. Memory per rank (peak RSS)
is ``mu0 + mu1 E s_W + mu2 b`` bytes, ``E`` the embedding bytes of the model (weights and optimizer state).

Every term is non-negative, zero or concave-saturating in the resource it describes (more threads or
ranks stop helping once cores run out), so the model cannot predict free speed-ups. World sizes, nodes and
data-worker counts not seen in the fitted measurements are extrapolations: :meth:`PerformanceModel.supports`
says which configurations are inside the measured range.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_dlrover.advisor.resources import ResourceConfig

TRAIN_TERMS = ("fixed", "dense", "embedding", "serial", "oversubscription", "all_to_all", "peers", "all_reduce",
               "thread_spin")
TRAIN_UNITS = ("s", "s/(sample/core)", "s/(float/core)", "s/sample", "s/sample", "s/float", "s/peer", "s/float", "s")
MAKE_TERMS = ("fixed", "per_rank_sample", "global_sample")
WAIT_TERMS = ("hand_over",)
MEMORY_TERMS = ("base", "embedding", "per_sample")


@dataclass(frozen=True)
class JobShape:
    """What the model needs to know of the job besides its resources.

    Attributes:
        table_loads: per embedding table, floats pooled per sample (pooling factor x dimension).
        dense_params: replicated (dense) parameters.
        embedding_bytes: bytes of all embedding tables with their optimizer state.
        planned_shares: ``(world_size, share)`` pairs: the busiest rank's share of the embedding work under the
            actual sharding plan; other world sizes use a greedy (largest-first) balance of ``table_loads``.
    """

    table_loads: tuple[float, ...]
    dense_params: int
    embedding_bytes: int = 0
    planned_shares: tuple[tuple[int, float], ...] = ()

    @property
    def pooled_floats(self) -> float:
        return float(sum(self.table_loads))

    def share(self, world_size: int) -> float:
        """The busiest rank's share of the embedding work at ``world_size`` ranks."""
        for size, share in self.planned_shares:
            if size == world_size:
                return share
        return greedy_share(self.table_loads, world_size)


def greedy_share(loads: Sequence[float], bins: int) -> float:
    """Largest bin's share when ``loads`` go, largest first, to the least loaded of ``bins`` bins."""
    total = float(sum(loads))
    if bins <= 1 or total <= 0:
        return 1.0
    heap = [0.0] * bins
    for load in sorted(loads, reverse=True):
        heapq.heapreplace(heap, heap[0] + load)
    return max(heap) / total


@dataclass(frozen=True)
class Observation:
    """One measured configuration: mean seconds per step over some steps of a job.

    Attributes:
        config: the resources.
        shape: the job.
        cores: cores per node the job could use while measured (fewer than the machine's when other programs ran).
        step_s: wall seconds per step.
        data_wait_s: seconds per step the ranks waited for data (mean over ranks).
        rss_bytes: peak resident memory per rank, if measured.
        weight: relative weight in the fit (e.g. similarity of a past job).
    """

    config: ResourceConfig
    shape: JobShape
    cores: float
    step_s: float
    data_wait_s: float = 0.0
    rss_bytes: float | None = None
    weight: float = 1.0

    @property
    def samples_per_sec(self) -> float:
        return self.config.global_batch / self.step_s


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per step (and its parts), throughput and memory of one configuration."""

    config: ResourceConfig
    step_s: float
    train_s: float
    data_wait_s: float
    samples_per_sec: float
    rss_bytes: float | None


def _speeds(c: ResourceConfig, cores: float, u: float) -> tuple[float, float, float]:
    """(q, p, o): a thread's core share, a rank's cores, oversubscription (see the module docstring)."""
    busy = c.ranks_per_node * (c.threads_per_rank + u)
    q = min(1.0, cores / busy)
    return q, c.threads_per_rank * q, max(0.0, busy - cores) / cores


def train_features(c: ResourceConfig, shape: JobShape, cores: float, u: float = 0.0) -> np.ndarray:
    """Features of :data:`TRAIN_TERMS` (see the module docstring)."""
    q, p, o = _speeds(c, cores, u)
    w, b, d = c.world_size, c.batch_per_rank, shape.pooled_floats
    remote = (w - 1) / w
    spin = o if c.threads_per_rank > 1 else 0.0
    return np.array([1.0, b / p, w * b * shape.share(w) * d / p, b / q, b * o, 2 * b * d * remote, w - 1.0,
                     2 * shape.dense_params * remote, spin])


def make_features(c: ResourceConfig, q: float) -> np.ndarray:
    """Features of :data:`MAKE_TERMS` at core share ``q``."""
    return np.array([1.0, c.batch_per_rank, c.global_batch]) / q


def memory_features(c: ResourceConfig, shape: JobShape) -> np.ndarray:
    return np.array([1.0, shape.embedding_bytes * shape.share(c.world_size), c.batch_per_rank])


def fit_nnls(x: np.ndarray, y: np.ndarray, weights: np.ndarray, prior: np.ndarray | None = None,
             ridge: float = 1e-4) -> np.ndarray:
    """Non-negative ``theta`` minimising ``sum w_i (x_i theta - y_i)^2 + ridge n ||theta - prior||^2``, in units
    where columns of ``x``, ``y`` and the weights are scaled to O(1) (so ``ridge`` is relative)."""
    col = np.abs(x).max(axis=0)
    col[col == 0] = 1.0
    y_scale = float(np.mean(np.abs(y))) or 1.0
    w = weights / float(np.mean(weights))
    a = x / col * np.sqrt(w)[:, None]
    target = y / y_scale * np.sqrt(w)
    base = np.zeros(x.shape[1]) if prior is None else np.asarray(prior) * col / y_scale
    lam = math.sqrt(ridge * len(y))
    a = np.vstack([a, lam * np.eye(x.shape[1])])
    target = np.concatenate([target, lam * base])
    from scipy.optimize import nnls  # scipy is imported when a model is fitted, not with the package

    theta, _ = nnls(a, target, maxiter=50 * x.shape[1])
    return theta * y_scale / col


@dataclass
class PerformanceModel:
    """Fits and evaluates the model of the module docstring.

    Args:
        ridge: pull of each coefficient towards ``prior`` (relative to the data's weight); keeps terms the
            measurements cannot tell apart (e.g. collective latency at a single world size) at the prior.
        prior: a model fitted earlier (e.g. on similar past jobs) whose coefficients are the starting point.
    """

    ridge: float = 1e-4
    prior: PerformanceModel | None = None
    train: np.ndarray = field(default_factory=lambda: np.zeros(len(TRAIN_TERMS)))
    make: np.ndarray | None = None
    wait: np.ndarray = field(default_factory=lambda: np.zeros(len(WAIT_TERMS)))
    memory: np.ndarray | None = None
    world_sizes: tuple[int, int] | None = None
    workers: tuple[int, int] | None = None
    fitted_on: int = 0
    #: The observations of the last :meth:`fit` (for held-out errors: refit without one, predict it).
    observations: tuple[Observation, ...] = field(default=(), repr=False)

    def fit(self, observations: Iterable[Observation]) -> PerformanceModel:
        """Fits every part on ``observations`` (at least one); returns ``self``."""
        obs = [o for o in observations if o.step_s > 0 and math.isfinite(o.step_s)]
        if not obs:
            raise ValueError("PerformanceModel.fit needs at least one measured configuration (none given).")
        prior = self.prior
        inline = [o for o in obs if o.config.data_workers == 0]
        if inline:
            x = np.stack([make_features(o.config, _speeds(o.config, o.cores, 0.0)[0]) for o in inline])
            y = np.array([max(o.data_wait_s, 0.0) for o in inline])
            w = np.array([o.weight for o in inline]) / np.maximum(y, 1e-4) ** 2
            self.make = fit_nnls(x, y, w, None if prior is None else prior.make, self.ridge)
        elif prior is not None:
            self.make = prior.make
        xs, ys, ws = [], [], []
        for o in obs:
            u = self._worker_cores(o.config, o.step_s)
            xs.append(train_features(o.config, o.shape, o.cores, u))
            ys.append(max(o.step_s - o.data_wait_s, 1e-6))
            ws.append(o.weight)
        y = np.array(ys)
        self.train = fit_nnls(np.stack(xs), y, np.array(ws) / y**2, None if prior is None else prior.train, self.ridge)
        pooled = [o for o in obs if o.config.data_workers > 0]
        if pooled:
            behind = [max(0.0, self._make_s(o.config, o.cores, self._worker_cores(o.config, o.step_s)) /
                          o.config.data_workers - (o.step_s - o.data_wait_s)) for o in pooled]
            y = np.array([max(o.data_wait_s - late, 0.0) for o, late in zip(pooled, behind)])
            x = np.array([[o.config.batch_per_rank] for o in pooled], dtype=float)
            w = np.array([o.weight for o in pooled]) / np.maximum(np.array([o.step_s for o in pooled]), 1e-4) ** 2
            self.wait = fit_nnls(x, y, w, None if prior is None else prior.wait, self.ridge)
        elif prior is not None:
            self.wait = prior.wait
        with_memory = [o for o in obs if o.rss_bytes]
        if with_memory:
            x = np.stack([memory_features(o.config, o.shape) for o in with_memory])
            y = np.array([o.rss_bytes for o in with_memory], dtype=float)
            self.memory = fit_nnls(x, y, 1 / y**2, None if prior is None else prior.memory, self.ridge)
        elif prior is not None:
            self.memory = prior.memory
        sizes = [o.config.world_size for o in obs] + (list(prior.world_sizes) if prior and prior.world_sizes else [])
        workers = [o.config.data_workers for o in obs] + (list(prior.workers) if prior and prior.workers else [])
        self.world_sizes, self.workers = (min(sizes), max(sizes)), (min(workers), max(workers))
        self.fitted_on = len(obs)
        self.observations = tuple(obs)
        return self

    def _make_s(self, c: ResourceConfig, cores: float, u: float) -> float:
        """Seconds to make one batch (``T_make``), 0 if the data part is not fitted."""
        if self.make is None:
            return 0.0
        return float(make_features(c, _speeds(c, cores, u)[0]) @ self.make)

    def _worker_cores(self, c: ResourceConfig, step_s: float) -> float:
        if c.data_workers == 0 or self.make is None or step_s <= 0:
            return 0.0
        return min(float(c.data_workers), float(make_features(c, 1.0) @ self.make) / step_s)

    def predict(self, config: ResourceConfig, shape: JobShape, cores: float) -> Prediction:
        """Step time, its parts, throughput and memory of ``config`` (see the module docstring)."""
        u, step, train, wait = 0.0, 0.0, 0.0, 0.0
        for _ in range(20):
            train = float(train_features(config, shape, cores, u) @ self.train)
            if config.data_workers == 0:
                wait = self._make_s(config, cores, 0.0)
            else:
                late = self._make_s(config, cores, u) / config.data_workers - train
                wait = max(0.0, late) + float(self.wait[0]) * config.batch_per_rank
            new_step = train + wait
            new_u = self._worker_cores(config, new_step)
            if abs(new_step - step) <= 1e-9 * max(new_step, 1e-9) and abs(new_u - u) < 1e-6:
                break
            step, u = new_step, 0.5 * (u + new_u)  # damped: u and the step time feed each other
        step = max(train + wait, 1e-9)
        rss = float(memory_features(config, shape) @ self.memory) if self.memory is not None else None
        return Prediction(config, step, train, wait, config.global_batch / step, rss)

    def supports(self, config: ResourceConfig) -> bool:
        """Whether ``config``'s world size and data workers lie within those the model was fitted on."""
        if self.world_sizes is None or self.workers is None:
            return False
        w_ok = self.world_sizes[0] <= config.world_size <= self.world_sizes[1]
        return w_ok and self.workers[0] <= config.data_workers <= self.workers[1]

    def mape(self, observations: Iterable[Observation]) -> float:
        """Mean absolute percentage error of the predicted throughput on ``observations``."""
        errors = [abs(self.predict(o.config, o.shape, o.cores).samples_per_sec - o.samples_per_sec) / o.samples_per_sec
                  for o in observations]
        if not errors:
            raise ValueError("mape of no observations")
        return 100.0 * float(np.mean(errors))

    def coefficients(self) -> dict[str, dict[str, float]]:
        """Fitted coefficients by part and term."""
        out = {"train": dict(zip(TRAIN_TERMS, map(float, self.train))),
               "wait": dict(zip(WAIT_TERMS, map(float, self.wait)))}
        if self.make is not None:
            out["make"] = dict(zip(MAKE_TERMS, map(float, self.make)))
        if self.memory is not None:
            out["memory"] = dict(zip(MEMORY_TERMS, map(float, self.memory)))
        return out

    def to_dict(self) -> dict:
        """JSON-able form (for the job history)."""
        return {"coefficients": self.coefficients(), "world_sizes": self.world_sizes, "workers": self.workers,
                "fitted_on": self.fitted_on}

    @classmethod
    def from_dict(cls, data: dict) -> PerformanceModel:
        coef = data["coefficients"]
        # terms added since a record was written count as 0
        model = cls(train=np.array([coef["train"].get(t, 0.0) for t in TRAIN_TERMS]),
                    wait=np.array([coef["wait"][t] for t in WAIT_TERMS]))
        model.make = np.array([coef["make"][t] for t in MAKE_TERMS]) if "make" in coef else None
        model.memory = np.array([coef["memory"][t] for t in MEMORY_TERMS]) if "memory" in coef else None
        model.world_sizes = tuple(data["world_sizes"]) if data.get("world_sizes") else None
        model.workers = tuple(data["workers"]) if data.get("workers") else None
        model.fitted_on = int(data.get("fitted_on", 0))
        return model
