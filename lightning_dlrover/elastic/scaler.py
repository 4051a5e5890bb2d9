"""``ElasticBatchScaler``: global batch, per-rank batch and learning rates that follow the world size.

The callback remembers, in its own checkpointed state, the world size, global batch and learning rates the job
last trained with. At the start of every fit it compares them with the trainer's world size: a resumed job that
shrank, grew or replaced a rank (from a checkpoint or through the fault manager's node-loss restore, whose
trainer state carries the callback's) gets a new batch from its policy and rescaled learning rates. With the
``goodput`` policy it also measures the gradient noise scale and step times while training, and every
``check_every_n_steps`` steps switches to the batch of highest predicted goodput when the gain is above
``min_gain``. :meth:`request` makes the ``goodput`` policy decide again at the next step; :meth:`set_global_batch`
switches to a given batch of the range at once, and the resource advisor's ``apply=True`` sets the batch through
:meth:`set_batch_per_rank` (the scaler is its ``BatchSizeControl``).

A change takes effect at the next batch the loader produces: the loader counts its position in samples, so no
sample is lost or repeated (see :class:`~lightning_dlrover.data.ResumableLoader`). Each change is recorded
as a ``batch_rescaled`` event (:mod:`lightning_dlrover.monitor.events`). With ``warmup_steps=N`` the learning
rates go from their old to their new values linearly over the N steps after every change (the change at the start
of a resumed fit included; a warm-up in progress is checkpointed with the callback's state).

A failure inside the scaler never ends the fit (:mod:`~lightning_dlrover.monitor.guard`): a change that failed on
any rank (e.g. the batch changed but the learning rates could not be set) is put back on every rank (batch and
learning rates), reported once (an ``addon_failed`` event and a warning), and the scaler stops changing anything.
A range no batch of the world size fits is refused before ranks start (:meth:`ElasticBatchScaler.validate`).

YAML::

    trainer:
      callbacks:
        - class_path: lightning_dlrover.ElasticBatchScaler
          init_args: {min_batch: 256, max_batch: 2048, policy: keep_per_rank, lr_rule: sqrt, warmup_steps: 10}
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dlrover import control_plane
from lightning_dlrover import lightning_glue as glue
from lightning_dlrover.elastic.batch import (
    LR_RULES,
    POLICIES,
    BatchDecision,
    BatchRange,
    LRRule,
    Policy,
    _nearest,
    decide,
    learning_rates,
    lr_factor,
    scale_learning_rates,
    warmup_rate,
)
from lightning_dlrover.elastic.goodput import GoodputModel, GradientNoiseProbe, NoiseScaleEstimator
from lightning_dlrover.monitor.events import emit
from lightning_dlrover.monitor.guard import failure, guarded, is_addon_error
from lightning_dlrover.torchrec_glue import set_fused_learning_rate


def _optimizers(trainer: pl.Trainer) -> list[Any]:
    out = list(trainer.optimizers)
    fused = getattr(trainer.strategy, "fused_optimizer", None)
    try:
        out.append(fused) if fused is not None else None
    except RuntimeError:  # not sharded yet
        pass
    return out


def _set_learning_rates(optimizers: list[Any], rates: list[float]) -> None:
    from lightning_dlrover.elastic.batch import _leaf_optimizers

    leaves = [leaf for o in optimizers for leaf in _leaf_optimizers(o)]
    groups = [(leaf, g) for leaf in leaves for g in leaf.param_groups]
    if len(groups) != len(rates):
        raise ValueError(f"saved {len(rates)} learning rates but the optimizers have {len(groups)} param groups.")
    for (leaf, group), lr in zip(groups, rates):
        group["lr"] = lr
    for leaf in leaves:
        set_fused_learning_rate(leaf)


def _train_loader(trainer: pl.Trainer) -> Any:
    datamodule = trainer.datamodule
    loader = datamodule.train_dataloader() if datamodule is not None else trainer.train_dataloader
    if not hasattr(loader, "global_batch_size"):
        raise TypeError(f"ElasticBatchScaler needs a loader with a settable global_batch_size (e.g. "
                        f"lightning_dlrover.data.ResumableLoader), got {type(loader).__name__}.")
    return loader


def _recount_epoch(trainer: pl.Trainer, loader: Any) -> None:
    """Makes the epoch end at the loader's last full batch after a batch change: recounts the current epoch
    (batches fetched so far plus the full batches the loader has left, at the new size) and lets later epochs take
    their length from the loader (:func:`lightning_dlrover.lightning_glue.recount_epoch`). A user's
    ``limit_train_batches`` is left alone."""
    source = getattr(loader, "source", None)
    if source is None:
        return

    def batches_left() -> int:
        return (len(source) - int(loader.state_dict()["next_sample"])) // int(loader.global_batch_size)

    glue.recount_epoch(trainer, batches_left)


class ElasticBatchScaler(Callback):
    """Adapts the global batch and learning rates to the world size (see the module docs).

    Args:
        min_batch: smallest global batch the job trains well with.
        max_batch: largest global batch.
        per_rank_max: most samples one rank may hold (memory limit), or None.
        policy: ``keep_global``, ``keep_per_rank`` or ``goodput``.
        lr_rule: ``linear``, ``sqrt``, ``adascale`` or ``none`` (see :mod:`lightning_dlrover.elastic.batch`).
        check_every_n_steps: how often the goodput policy reconsiders the batch.
        min_gain: predicted goodput gain a goodput switch needs.
        warmup_steps: after every batch change (one at the start of a fit included), the learning rates go from
            their old values to the rule's new ones linearly over this many steps instead of at once (0: at once).
    """

    def __init__(self, min_batch: int, max_batch: int, per_rank_max: int | None = None, policy: Policy = "keep_global",
                 lr_rule: LRRule = "sqrt", check_every_n_steps: int = 50, min_gain: float = 0.05,
                 warmup_steps: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"ElasticBatchScaler(policy={policy!r}): choose one of {list(POLICIES)}.")
        if lr_rule not in LR_RULES:
            raise ValueError(f"ElasticBatchScaler(lr_rule={lr_rule!r}): choose one of {list(LR_RULES)}.")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"ElasticBatchScaler(warmup_steps={warmup_steps!r}): give a number of steps >= 0 "
                             "(0 changes the learning rates at once).")
        self.warmup_steps = warmup_steps
        self._ramp: tuple[list[float], int] | None = None  # (rates the warm-up starts from, steps it has taken)
        self.range = BatchRange(min_batch, max_batch, per_rank_max)
        self.policy, self.lr_rule = policy, lr_rule
        self.check_every_n_steps, self.min_gain = check_every_n_steps, min_gain
        self.probe = GradientNoiseProbe(NoiseScaleEstimator())
        self.goodput: GoodputModel | None = None
        self._saved: dict[str, Any] | None = None
        self._world_size = 0
        self._global_batch = 0
        self._requested = False
        self._met, self._together = 0, False  # goodput decisions joined; whether every rank stepped back at once
        self._recount = False
        self._trainer: pl.Trainer | None = None
        self._lrs: list[float] = []
        self._step_start: float | None = None
        self.history: list[dict[str, Any]] = []

    def validate(self, world_size: int) -> None:
        """Raises a ``ValueError`` saying how to fix the range if no global batch of it fits ``world_size`` ranks
        (``lightning-dlrover fit`` calls it in the launching process, before ranks start)."""
        try:
            self.range.check(world_size)
        except ValueError as err:
            raise ValueError(f"ElasticBatchScaler(min_batch={self.range.min}, max_batch={self.range.max}, "
                             f"per_rank_max={self.range.per_rank_max}): {err}") from None

    def step_back(self) -> str:
        """After a failure: the batch and learning rates of the last completed change stay (a change that failed
        was put back by :meth:`_switch`); the scaler changes nothing more. Returns them, for the report."""
        return f"global batch {self._global_batch} on {self._world_size} ranks, learning rates {self._lrs}"

    @override
    def state_dict(self) -> dict[str, Any]:
        est = self.probe.estimator
        return {"world_size": self._world_size, "global_batch": self._global_batch, "lrs": self._lrs,
                "noise": [est.grad_sqr, est.grad_var, est.measurements],
                "base_batch": self.goodput.base_batch if self.goodput else None,
                "warmup": list(self._ramp) if self._ramp else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict)

    @override
    @guarded
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = _train_loader(trainer)
        world = trainer.world_size
        self._trainer = trainer
        optimizers = _optimizers(trainer)
        saved, self._saved = self._saved, None
        if saved and saved.get("world_size"):
            _set_learning_rates(optimizers, saved["lrs"])  # fused rates are not in the optimizer checkpoint
            est = self.probe.estimator
            est.grad_sqr, est.grad_var, est.measurements = saved["noise"]
            self._global_batch, self._world_size = saved["global_batch"], saved["world_size"]
            base = saved.get("base_batch") or saved["global_batch"]
            self._ramp = tuple(saved["warmup"]) if saved.get("warmup") else None
        else:
            self._global_batch, self._world_size = int(loader.global_batch_size), world
            base = self._global_batch
        self._lrs = learning_rates(optimizers)
        self.goodput = GoodputModel(base, noise_scale=self.probe.estimator.noise_scale, min_gain=self.min_gain)
        if self.policy == "goodput" and world > 1 and (ddp := glue.inner_ddp(trainer.strategy.model)) is not None \
                and not self.probe.attached:
            self.probe.attach(ddp)
        if world != self._world_size or self._global_batch not in self.range.feasible(world):
            self._apply(trainer, "world_size_changed" if world != self._world_size else "out_of_range")
        elif int(loader.global_batch_size) != self._global_batch:
            loader.global_batch_size = self._global_batch
            self._recount = True

    # Until a noise scale is measured, ``adascale`` scales by 1 and ``goodput`` values batches by throughput only;
    # step times are not checkpointed, so after a restart ``goodput`` first keeps the nearest batch to the old one.

    def request(self) -> None:
        """Makes the ``goodput`` policy decide the batch again at the next step instead of waiting for its check."""
        self._requested = True

    #: How the resource advisor's ``advice_applied`` events name this control.
    via = "ElasticBatchScaler.set_batch_per_rank"

    def get_batch_per_rank(self) -> int:
        """Samples per rank per step now (the resource advisor's ``BatchSizeControl``)."""
        return self._global_batch // max(self._world_size, 1)

    def set_batch_per_rank(self, batch: int) -> None:
        """Trains with ``batch`` samples per rank from the next batch on, as the resource advisor asks
        (:class:`lightning_dlrover.advisor.control.BatchSizeControl`, which finds this callback by these two methods):
        :meth:`set_global_batch` with ``batch x world size`` and reason ``advisor``. Call it on every rank at the
        same step, from a training-batch hook; the batch applied is the range's nearest (read it back)."""
        if self._trainer is None:
            raise RuntimeError("ElasticBatchScaler.set_batch_per_rank: the scaler is not training yet; call it from a "
                               "training-batch hook (e.g. the resource advisor's on_train_batch_end).")
        if batch < 1:
            raise ValueError(f"set_batch_per_rank({batch}): the batch per rank must be a positive integer.")
        self._set_batch_per_rank(batch)

    @guarded("set_batch_per_rank")  # the scaler's own failure: reported, put back, never the caller's to handle
    def _set_batch_per_rank(self, batch: int) -> None:
        self.set_global_batch(self._trainer, batch * self._trainer.world_size, reason="advisor")

    def choices(self) -> tuple[int, ...]:
        """Per-rank batches of the range among half, the same and twice the current one (the advisor's search)."""
        world, now = max(self._world_size, 1), self.get_batch_per_rank()
        feasible = set(self.range.feasible(world))
        return tuple(sorted(b for b in {now // 2, now, 2 * now} if b >= 1 and b * world in feasible)) or (now,)

    def _recount_now(self, trainer: pl.Trainer) -> None:
        """Lightning counted this epoch's batches at the old batch size: count them again after a change."""
        if self._recount:
            self._recount = False
            _recount_epoch(trainer, _train_loader(trainer))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = None

    @override
    @guarded
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._recount_now(trainer)
        self._warm_up(trainer)
        self._step_start = time.perf_counter()

    def _warm_up(self, trainer: pl.Trainer) -> None:
        """Sets this step's rates of a warm-up in progress: from where they were at the change to the rule's."""
        if self._ramp is None:
            return
        start, done = self._ramp[0], self._ramp[1] + 1
        _set_learning_rates(_optimizers(trainer),
                            [warmup_rate(old, new, done, self.warmup_steps) for old, new in zip(start, self._lrs)])
        self._ramp = None if done >= self.warmup_steps else (start, done)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Failed on this rank alone, the scaler joins the others' next goodput decision as failed (every rank steps
        back there together) instead of leaving them waiting at it until the process-group timeout."""
        step, met = trainer.global_step, self._met
        due = self.policy == "goodput" and self.goodput is not None and (self._requested or (
            self.check_every_n_steps and step % self.check_every_n_steps == 0 and step > 0))
        self._batch_end(trainer, batch_idx)
        if due and self._met == met and failure(self) is not None and not self._together:
            try:
                self._agreed(None, ok=False)
            except _PeerFailed:
                pass

    @guarded("on_train_batch_end")
    def _batch_end(self, trainer: pl.Trainer, batch_idx: int) -> None:
        if self.policy != "goodput" or self.goodput is None:
            return
        per_rank = self._global_batch // trainer.world_size
        if self._step_start is not None and batch_idx > 0:
            self.goodput.step_times.observe(per_rank, time.perf_counter() - self._step_start)
        if self.probe.attached:
            self.goodput.noise_scale = self.probe.end_step(per_rank)
        step = trainer.global_step
        if self._requested or (self.check_every_n_steps and step % self.check_every_n_steps == 0 and step > 0):
            self._requested = False
            self._apply(trainer, "goodput")
            self._recount_now(trainer)

    def _apply(self, trainer: pl.Trainer, reason: str) -> None:
        world, old_world, old_batch = trainer.world_size, self._world_size, self._global_batch
        model = self.goodput
        noise = model.noise_scale if model else None
        decision = decide(self.policy, self.lr_rule, self.range, old_world, world, old_batch,
                          goodput=model.goodput if model and model.step_times.observations else
                          (lambda w, b: -abs(b - old_batch)), noise_scale=noise if noise is not None else 0.0)
        gain = None
        if reason == "goodput":
            switch = False
            if model is not None and model.step_times.observations:
                gain = model.goodput(world, decision.global_batch) / model.goodput(world, old_batch) - 1.0
                switch = model.worth_switching(world, old_batch, decision.global_batch)
            decision, gain, switch = self._agreed((decision, gain, switch))
            if not switch:
                return
        if decision.global_batch == old_batch and world == old_world:
            return
        self._switch(trainer, decision, reason, gain)

    @property
    def global_batch(self) -> int:
        """The global batch the job trains with now (0 before the fit starts)."""
        return self._global_batch

    def set_global_batch(self, trainer: pl.Trainer, global_batch: int,
                         reason: str = "requested") -> BatchDecision | None:
        """Switches to the feasible global batch of the range nearest ``global_batch`` (e.g. the resource advisor's),
        rescaling the learning rates by the LR rule; call on every rank at the same step. Returns the decision,
        ``None`` if the batch stays."""
        if failure(self) is not None:
            return None  # stepped back after a failure: the batch stays
        world, old_batch = trainer.world_size, self._global_batch
        batch = _nearest(self.range.check(world), global_batch)
        if batch == old_batch:
            return None
        noise = self.goodput.noise_scale if self.goodput else None
        factor = lr_factor(self.lr_rule, old_batch, batch, noise if noise is not None else 0.0)  # as _apply's
        decision = BatchDecision(batch, batch // world, factor, self.policy, self.lr_rule)
        self._switch(trainer, decision, reason, None)
        if self._trainer is not None:  # mid-fit: before Lightning decides whether the epoch has another batch
            self._recount_now(trainer)
        return decision

    def _switch(self, trainer: pl.Trainer, decision: BatchDecision, reason: str, gain: float | None) -> None:
        world, old_world, old_batch = trainer.world_size, self._world_size, self._global_batch
        noise = self.goodput.noise_scale if self.goodput else None
        optimizers = _optimizers(trainer)
        loader = _train_loader(trainer)
        before = (int(loader.global_batch_size), learning_rates(optimizers), self._lrs, self._recount, self._ramp)
        try:
            start = learning_rates(optimizers)  # mid warm-up: the rates of its last step
            loader.global_batch_size = decision.global_batch
            self._recount = True  # at the next batch (the epoch loop is not set up yet at train start) or at once
            if self._ramp is None:
                scale_learning_rates(optimizers, decision.lr_factor)
            else:  # mid warm-up: the new rates are the rule's from the ones it was heading to
                _set_learning_rates(optimizers, [lr * decision.lr_factor for lr in self._lrs])
            self._lrs = learning_rates(optimizers)
            self._ramp = (start, 0) if self.warmup_steps else None
            error = None
        except Exception as err:
            if not is_addon_error(err):
                raise
            error = err
        if not control_plane.all_true(error is None):  # a change half made, or made on some ranks only: put it back
            self._together = True  # every rank fails here
            loader.global_batch_size, self._lrs, self._recount, self._ramp = before[0], before[2], before[3], before[4]
            _set_learning_rates(optimizers, before[1])
            raise error or RuntimeError(f"another rank failed to switch the global batch {old_batch} -> "
                                        f"{decision.global_batch}; put back here too")
        self._global_batch, self._world_size = decision.global_batch, world
        record = {"reason": reason, "policy": self.policy, "rule": decision.rule, "old_world_size": old_world,
                  "world_size": world, "old_global_batch": old_batch, "global_batch": decision.global_batch,
                  "per_rank_batch": decision.per_rank, "lr_factor": decision.lr_factor, "noise_scale": noise,
                  "predicted_gain": gain}
        self.history.append(record)
        if trainer.is_global_zero:
            emit("batch_rescaled", step=trainer.global_step, **record,
                 message=f"global batch {old_batch} -> {decision.global_batch} on {world} ranks ({reason}); "
                         f"learning rates x{decision.lr_factor:.3f} ({decision.rule})")

    def _agreed(self, decision: Any, ok: bool = True) -> Any:
        """Rank 0's decision on every rank (step times, hence predictions, differ between ranks); raises on every
        rank when one joined as failed (``ok=False``), which steps the scaler back on all of them together."""
        self._met += 1
        out = [(ok, decision)]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, (ok, decision), group=control_plane.group())
        if not all(fine for fine, _ in out):
            self._together = True
            raise _PeerFailed(f"the scaler failed on rank(s) {[r for r, (f, _) in enumerate(out) if not f]}; "
                               "it steps back on every rank to keep them in step")
        return out[0][1]


class _PeerFailed(RuntimeError):
    """The scaler failed on some rank: it steps back on every rank."""
