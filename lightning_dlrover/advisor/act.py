"""Acting on advice in one running job: its configuration now and who owns each live knob, the live changes a
recommendation makes (``apply=True``; fewer ranks on one machine too, shrunk in process under ``launch``), and how
the job reaches what needs a restart (the printed command, or a checkpoint and a stop with ``restart="stop"``; see
:mod:`~lightning_dlrover.advisor.restart`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from lightning_dlrover.advisor import control
from lightning_dlrover.advisor.live import LiveApplier, live_controls
from lightning_dlrover.advisor.recommend import Recommendation
from lightning_dlrover.advisor.resources import ResourceConfig, SearchSpace
from lightning_dlrover.advisor.restart import RestartDecision, decide_restart, program_argv
from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor import emit
from lightning_dlrover.monitor.timing import _infer_batch_size

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_dlrover.advisor.config import AdvisorConfig

log = get_logger(__name__)


class Actor:
    """The job's configuration (``current``), the owners of its live knobs, and the advice acted on."""

    def __init__(self, config: AdvisorConfig) -> None:
        self.config = config
        #: The last restart decision (every rank), ``None`` when no change needed a restart.
        self.restart: RestartDecision | None = None
        #: The last restart decision's text for people (rank 0), ``""`` when none.
        self.restart_text = ""

    def reset(self) -> None:
        """Forgets the last fit's restart text."""
        self.restart_text = ""

    def start(self, trainer: Trainer, batch: Any) -> None:
        """First batch: finds the live knobs' owners, reads the configuration now, and the configurations allowed
        (``search``, else this node's ranks and threads, data workers and batches where something owns them)."""
        self.controls = live_controls(trainer)
        self.applier = LiveApplier(self.controls)
        batch_ctl = control.find_control(self.controls, control.BatchSizeControl)
        data_ctl = control.find_control(self.controls, control.DataWorkersControl)
        self.can_set_workers, self.can_set_batch = data_ctl is not None, batch_ctl is not None
        g = trainer.num_devices
        loader = trainer.train_dataloader
        workers = data_ctl.get_data_workers() if data_ctl else int(getattr(loader, "num_workers", 0) or 0)
        batch_size = batch_ctl.get_batch_per_rank() if batch_ctl else (_infer_batch_size(batch) or 1)
        self.current = ResourceConfig(trainer.world_size // g, g, torch.get_num_threads(), workers, batch_size)
        self.space = self.config.search or SearchSpace(
            nodes=(self.current.nodes, self.current.nodes),
            data_workers=tuple(range(getattr(data_ctl, "min_workers", 0), 3)) if data_ctl else (workers,),
            batch_per_rank=batch_ctl.choices() if hasattr(batch_ctl, "choices") else None,
        )

    def act(self, trainer: Trainer, target: ResourceConfig, stage: str, recommendation: Recommendation | None,
            start_time: float) -> None:
        """Applies ``target``'s live knobs (if ``apply``), prints what needs a restart, records an event."""
        if target == self.current:  # the final word: an earlier stage's restart no longer applies
            self.restart, self.restart_text = None, ""
            if trainer.is_global_zero:
                rank_zero_report(log, f"ResourceAdvisor ({stage}): keep {target.short()}")
            return
        live = control.live_changes(self.current, target, self.controls)
        applied = {}
        if self.config.apply and live:
            applied = self.applier.apply(live, trainer.global_step, stage)
            self.current = self.current.with_(**applied)
        if self.config.apply:
            applied.update(self.resize_live(trainer, target, stage))
        restart = self.decide_restart(trainer, target)
        if trainer.is_global_zero:
            gain = recommendation.gain if stage == "profile" and recommendation else None
            rank_zero_report(log, f"ResourceAdvisor ({stage}): recommend {target.short()}"
                             + (f" ({gain:.2f}x predicted)" if gain else "")
                             + (f"; applied live: {applied}" if applied else "; live knobs not applied (apply=False)" if live else ""))
            self.restart_text = restart.text() if restart else ""
            if restart:
                rank_zero_report(log, self.restart_text)
            emit("advice", step=trainer.global_step, stage=stage, current=self.current.to_dict(),
                 recommended=target.to_dict(), predicted_gain=gain, applied=applied, restart=self.restart_text,
                 elapsed_s=time.time() - start_time)
            if restart:
                emit("restart", step=trainer.global_step, **restart.event_fields())
        if restart and restart.how == "checkpoint":
            trainer.should_stop = True

    def resize_live(self, trainer: Trainer, target: ResourceConfig, stage: str) -> dict[str, int]:
        """Fewer or more ranks on the job's one machine (every rank): asked of the strategy's in-process resize (more:
        up to ``launch --max-nproc-per-node``), for a model that reads its pooled embeddings by key (a new plan reorders
        them: one reading ``KeyedTensor.values()`` would see permuted features); ``{"ranks_per_node": n}`` once asked,
        else ``{}`` (the restart advice stays)."""
        now = self.current
        if not (target.nodes == now.nodes == 1 and target.ranks_per_node != now.ranks_per_node):
            return {}
        resize = getattr(trainer.strategy, "resize_in_process", None)
        if resize is None:
            return {}
        why = ("the model reads its pooled embeddings by position (set pooled_embeddings_by_key = True on the "
               "LightningModule if it reads them by key)"
               if not getattr(trainer.lightning_module, "pooled_embeddings_by_key", False)
               else resize(target.ranks_per_node))
        if why is not None:
            if trainer.is_global_zero:
                rank_zero_report(log, f"ResourceAdvisor: {target.ranks_per_node} ranks not applied in process: {why}")
            return {}
        emit("advice_applied", step=trainer.global_step, stage=stage, knob="ranks_per_node", old=now.ranks_per_node,
             new=target.ranks_per_node, via=f"{type(trainer.strategy).__name__}.resize_in_process")
        self.current = now.with_(ranks_per_node=target.ranks_per_node)
        return {"ranks_per_node": target.ranks_per_node}

    def decide_restart(self, trainer: Trainer, target: ResourceConfig) -> RestartDecision | None:
        """Decides how to reach ``target`` (every rank); with ``restart="stop"`` saves the checkpoint (collective)."""
        from lightning_dlrover.advisor.restart import joins
        from lightning_dlrover.worker_env import join_room, node_range

        checkpoint, pending, room = None, control.needs_restart(self.current, target, self.controls), join_room()
        if self.config.restart == "stop" and pending and not joins(self.current, target, pending, room):
            out = self.config.report_path(trainer.default_root_dir)
            checkpoint = str((out / f"restart-step={trainer.global_step}.ckpt").resolve())
            trainer.save_checkpoint(checkpoint)
        self.restart = decide_restart(self.current, target, self.controls, program_argv(), self.config.restart,
                                      checkpoint, node_range(), room)
        return self.restart
