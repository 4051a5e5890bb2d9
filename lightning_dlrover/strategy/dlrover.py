"""``DLRoverStrategy``: Lightning training of TorchRec-sharded models.

The LightningModule is wrapped in TorchRec's ``DistributedModelParallel``: embedding tables are sharded by
TorchRec's planner and updated by fused in-backward optimizers, every other parameter is replicated and
synchronised by DDP. Checkpoints are sharded (every rank writes its own shards) and load into any world
size. Fault tolerance (the per-step commit, spills, restore, fallback) is the
:class:`~lightning_dlrover.fault.FaultManager`'s; the hooks here call it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.keyed import KeyedOptimizer
from typing_extensions import override

from lightning_dlrover import control_plane
from lightning_dlrover import lightning_glue as glue
from lightning_dlrover.checkpoint import directory, get_backend, job
from lightning_dlrover.checkpoint.plain import export_directory, load_plain_into
from lightning_dlrover.fault import FaultInjector, FaultManager, ParityConfig
from lightning_dlrover.log import get_logger, quiet_known_warnings
from lightning_dlrover.monitor import StateDigest, StepTimer, emit, state_digest
from lightning_dlrover.monitor import events as job_events
from lightning_dlrover.monitor.events import DIGEST_EVERY_ENV
from lightning_dlrover.strategy import auto_parity, in_process, process_exit, shard_model
from lightning_dlrover.strategy.checkpointing import Checkpointing
from lightning_dlrover.strategy.elastic_range import check_elastic_range
from lightning_dlrover.strategy.launcher import validate_trainer_addons
from lightning_dlrover.strategy.shard_model import POOLED_KEYS, shard
from lightning_dlrover.strategy.sharding import (
    CPU_DEFAULT_SHARDING_TYPES,
    SHARDING_TYPES,
    TableConstraint,
    build_constraints,
    check_module,
    check_options,
)
from lightning_dlrover.strategy.support import (check_device, check_no_accumulation, check_parity_optimizers,
                                                warn_unresumable_data)

log = get_logger(__name__)


class DLRoverStrategy(DDPStrategy):
    """Trains a LightningModule whose embedding tables are sharded by TorchRec.

    Args:
        sharding_types: sharding types the planner may use for every table. Default: on CPU (gloo)
            ``table_wise``, ``column_wise`` and ``table_column_wise``; on GPU (untested: docs/gpu.md) every type.
        compute_kernel: TorchRec compute kernel of sharded tables (``fused`` applies the tables'
            in-backward optimizer inside the kernel).
        constraints: per-table planner constraints, keyed by table name.
        checkpoint_backend: ``"dcp"`` (``torch.distributed.checkpoint``) or ``"torchsnapshot"``.
        parity: erasure-code the embedding shards and their optimizer state across ranks (``None``: off; ``"auto"``:
            the fault-tolerance planner picks ``k``, ``r`` and the commit interval at set-up, see :mod:`.auto_parity`).
        print_digest: at the end of ``fit``, print ``state digest: <sha256>`` of the whole training state
            on rank 0 (a collective over all shards; costs one pass over the state).
        init_from: an export directory (``lightning-dlrover export --out DIR``: its ``model.pt``, the unsharded
            state dict) the first ``fit`` starts from: the model is sharded, then every rank copies in its own shards'
            rows; optimizer and trainer state start fresh (step 0). A checkpoint to resume from (``ckpt_path``) wins.
        async_checkpoint: a save blocks training only while the state is copied; the write and the commit run in
            the background (see :mod:`.checkpointing`); ``"precopy"``: the tables are copied in the background too.
        incremental_checkpoint_every: a full checkpoint every ``N`` saves, the saves between them only the embedding
            rows changed since the previous one (and the rest of the state in full); see :mod:`.incremental`.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as in :class:`~lightning.pytorch.strategies.DDPStrategy`.
            ``timeout`` also bounds how long a survivor waits on a dead peer before it gives up and spills.
    """

    strategy_name = "dlrover"

    def __init__(
        self,
        sharding_types: list[str] | None = None,
        compute_kernel: str = "fused",
        constraints: dict[str, TableConstraint] | None = None,
        checkpoint_backend: Literal["dcp", "torchsnapshot"] = "dcp",
        parity: ParityConfig | Literal["auto"] | None = None,
        print_digest: bool = True,
        init_from: str | Path | None = None,
        async_checkpoint: bool | Literal["precopy"] = False,
        incremental_checkpoint_every: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        quiet_known_warnings()  # third-party noise the job cannot avoid (lightning_dlrover/log.py lists it)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=FaultManager.process_group_backend(process_group_backend), timeout=timeout,
            start_method=start_method,
        )  # fmt: skip
        self._forward_redirection = glue.InnerDDPRedirection()
        self.sharding_types = sharding_types
        self.compute_kernel = compute_kernel
        self.constraints = {
            table: TableConstraint(**c) if isinstance(c, dict) else c for table, c in (constraints or {}).items()
        }
        check_options(sharding_types, compute_kernel, self.constraints, parity=parity is not None)
        self.checkpoint_backend = get_backend(checkpoint_backend)
        self.checkpointing = Checkpointing(async_checkpoint, timeout, incremental_checkpoint_every)
        self.print_digest = print_digest
        self.init_from = export_directory(init_from) if init_from is not None else None
        self.parity = ParityConfig.from_option(parity)  # "auto": the planner picks at set-up (auto_parity.resolve)
        self.step_timer = StepTimer()
        self.fault = FaultManager(self.parity, self.step_timer)
        self._dmp: DistributedModelParallel | None = None
        self._resume: dict[str, Any] | None = None  # restored by set-up, for Lightning to resume from
        self._started = self._snapshotting = False

    @property
    def fault_points(self) -> list:
        """Fault points of :class:`~lightning_dlrover.fault.FaultManager` (see :class:`~lightning_dlrover.fault.FaultInjector`)."""
        return self.fault.fault_points

    @property
    def recovered(self) -> bool:
        """Whether set-up restored a failed job's state (from survivors' spills or the fallback checkpoint)."""
        return self.fault.recovered

    @property
    def committed_step(self) -> int:
        """The last step every rank's state is committed at (see :class:`~lightning_dlrover.fault.FaultManager`; with
        ``ParityConfig(overlap=True)`` a step's commit is decided just before the next forward)."""
        return self.fault.committed_step

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The in-backward optimizer of every sharded table (state as ``ShardedTensor`` views of live buffers)."""
        if self._dmp is None:
            raise RuntimeError("The model is not sharded yet: the fused optimizer exists after `Trainer.fit` set-up.")
        return self._dmp.fused_optimizer

    @override
    def setup_environment(self) -> None:
        """Refuses what the device cannot run yet (see :mod:`.support`), then initialises the process group (a hot
        spare first waits to be handed a lost rank), and destroys it at interpreter exit."""
        device = self.root_device.type
        check_device(device, FaultManager.transport(self._get_process_group_backend()), self.parity is not None,
                     FaultManager.under_launch())
        if self.fault.before_process_group(device) is not None:  # a spare took a rank: a grow's may pass the devices
            in_process.fit_devices(self)
        super().setup_environment()
        before = self.node_rank
        if self.fault.after_process_group(before, self.local_rank, self.num_processes, self._timeout) is not None:
            self.set_world_ranks()
            if self.local_rank == 0:
                log.info(f"lightning_dlrover: node {before} takes back node rank {self.node_rank}, the one its "
                         "spills were written under")
        control_plane.init()  # the gloo group of our CPU collectives (see lightning_dlrover.control_plane)
        process_exit.install()

    @property
    @override
    def launcher(self) -> Any:
        """Lightning's launcher, which first runs the add-ons' up-front checks
        (:func:`~lightning_dlrover.strategy.launcher.validate_addons`): a config no rank could run is refused with one
        ``ValueError`` in the launching process, before other ranks start (under ``torchrun``: in every rank, before
        any collective)."""
        return glue.check_before_launch(super().launcher, validate_trainer_addons)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded model, so they are restored after :meth:`setup`."""
        return True

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Shards the model, sets up the dense optimizers and, on the first fit, the fault manager (which restores
        a failed job's state under ``torchrun``: see :class:`~lightning_dlrover.fault.FaultManager`)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        check_no_accumulation(trainer)
        if not self._started:
            self.parity = self.fault.parity = auto_parity.resolve(self, trainer)
            check_elastic_range(self, trainer)
        self.precision_plugin.convert_module(self.model)
        self.model = self._dmp if self._dmp is not None else self._shard(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING and not self._started and self.init_from is not None:
            load_plain_into(self.lightning_module, self.init_from)  # before parity encodes the tables
            rank_zero_info(f"DLRoverStrategy: initialised the model from {self.init_from} (fresh optimizer state)")
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for injector in FaultInjector.all_from_env():  # LIGHTNING_DLROVER_FAULT=rank=R,step=S,phase=P[;...]
                injector.attach(self)
            if not self._started:  # the first fit of this process
                self._started = True
                self._start_fault_tolerance(trainer)
        self.setup_precision_plugin()

    def _start_fault_tolerance(self, trainer: pl.Trainer) -> None:
        job_events.configure(Path(trainer.default_root_dir) / "dlrover_events.jsonl")
        self._resume = self.fault.start(self, joining=self.fault.joining())
        if (recovery := self.fault.in_process_recovery()) is not None:
            in_process.install(trainer, self, recovery)
        if self._resume is not None:
            shard_model.say_if_reordered(self, self._resume.get(POOLED_KEYS), self._resume.get("global_step"), "restored")
            glue.resume_from(trainer, self._resume)
        state = lambda: self._trainer_state(trainer)  # noqa: E731
        glue.call_after_every_step(trainer, lambda: self.fault.end_step(trainer.global_step, state))
        if (every := os.environ.get(DIGEST_EVERY_ENV)) and not any(isinstance(c, StateDigest) for c in trainer.callbacks):
            trainer.callbacks.append(StateDigest(at_start=True, every_n_steps=int(every)))

    def _trainer_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The trainer's checkpoint dict without the model's tensors (those are coded or snapshotted)."""
        self._snapshotting = True
        try:
            return {**glue.dump_trainer_state(trainer), POOLED_KEYS: shard_model.pooled_keys(self)}
        finally:
            self._snapshotting = False

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast; on a replacement still joining the job (nobody else is listening), its own value."""
        return obj if self.fault.joining() else super().broadcast(obj, src)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's training step, after the ``before_forward`` fault point."""
        self.fault.begin_step(self.lightning_module.trainer.global_step)
        return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Under manual optimisation, prepares the dense part's DDP with the loss given to ``manual_backward``."""
        if not self.lightning_module.automatic_optimization:
            glue.prepare_inner_ddp_for_backward(self.model, closure_loss)

    @override
    def on_train_start(self) -> None:
        """Forgets the restored state once Lightning has resumed from it; says if the data cannot resume exactly."""
        super().on_train_start()
        self._resume = None
        warn_unresumable_data(self.lightning_module.trainer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict (empty while the fault manager snapshots the trainer: the tables are coded)."""
        return {} if self._snapshotting else super().lightning_module_state_dict()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Spills this rank's committed state for the restarted job (see :class:`~lightning_dlrover.fault.FaultManager`)."""
        self.checkpointing.abandon()
        self.fault.on_exception(exception)

    def recover(self, lost_ranks: list[int]) -> None:
        """Rebuilds the embedding shards, optimizer state and parity of ``lost_ranks`` in place, at the last
        committed step, from the survivors' shards and parity (a collective on every rank)."""
        self.fault.recover(lost_ranks)

    def check_model(self, module: pl.LightningModule, backend: str | None = None,
                    device_type: str | None = None) -> dict[str, Any]:
        """The planner constraints of ``module``'s tables; raises ``ValueError`` naming the field when the model or
        the strategy's options cannot run (``backend``: the process group's, by default the one set-up will use;
        ``device_type``: the ranks' device type, by default the root device's), also on the device (see
        :mod:`.support`). ``lightning-dlrover fit`` calls it before the ranks start, so a bad config fails once, at
        once."""
        device_type = device_type or self.root_device.type
        tables = check_module(module, self.compute_kernel, device_type)
        check_parity_optimizers(module, self.parity is not None)
        auto_parity.check(self.parity, self.world_size, module)
        backend = backend or self._get_process_group_backend()
        backend = FaultManager.transport(backend)
        check_device(device_type, backend, self.parity is not None, FaultManager.under_launch())
        default_types = CPU_DEFAULT_SHARDING_TYPES if backend == "gloo" else None
        return build_constraints(
            tables, self.sharding_types or default_types or SHARDING_TYPES, self.compute_kernel, self.constraints, backend
        )

    def _shard(self, module: pl.LightningModule) -> DistributedModelParallel:
        """Plans the sharding of ``module``'s embedding tables and wraps it in ``DistributedModelParallel``."""
        self._dmp = shard(self, module)
        return self._dmp

    def replan_in_process(self, pooling_factors: Mapping[str, float], keep_feature_order: bool = False) -> bool:
        """Plans the tables' sharding anew with measured ``pooling_factors`` (ids per sample, by table) and re-shards
        them in process at the next commit boundary, nothing lost; call it on every rank at the same step
        (``ResourceAdvisor(apply=True)`` does, with ``keep_feature_order``: a new plan that would reorder the pooled
        embeddings is undone). ``False``, and nothing changes, unless the job recovers in process (``launch``)."""
        return in_process.request_replan(self, pooling_factors, keep_feature_order)

    def resize_in_process(self, world_size: int) -> str | None:
        """Shrinks or grows the job to ``world_size`` ranks at a commit boundary without a restart (``launch``, one
        machine; a grow up to ``--max-nproc-per-node``): the highest ranks retire, or new processes join, and the state
        is re-sharded; call it on every rank at the same step (``ResourceAdvisor(apply=True)`` does). Why it cannot
        (nothing changes then), or ``None`` once asked."""
        return in_process.request_resize(self, world_size)

    def training_state(self) -> dict[str, Any]:
        """The full training state: model (sharded tables as ``ShardedTensor``), fused and dense optimizer state."""
        return {
            "model": self.lightning_module.state_dict(),
            "fused_optimizer": self.fused_optimizer.state_dict()["state"],
            "optimizers": [optimizer.state_dict()["state"] for optimizer in self.optimizers],
        }

    @override
    def on_train_end(self) -> None:
        """Prints the state digest on rank 0 when ``print_digest`` is set; nothing of the job is left to resume."""
        self.checkpointing.wait()  # the last save counts before fit returns
        self.fault.finish()
        if self.print_digest and self._dmp is not None:
            digest = state_digest(self.training_state())
            if self.is_global_zero:
                print(f"state digest: {digest}", flush=True)
                emit("digest", step=self.lightning_module.trainer.global_step, digest=digest, final=True)
        process_exit.fit_finished(self.world_size > 1)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Writes a sharded checkpoint directory at ``filepath`` from every rank (collective; see
        :func:`lightning_dlrover.checkpoint.job.save`: a crash never leaves a partial checkpoint at ``filepath``),
        in the background with ``async_checkpoint`` (:mod:`.checkpointing`). Every rank's random generators go in."""
        if storage_options is not None:
            raise TypeError("DLRoverStrategy.save_checkpoint does not take storage_options.")
        self.fault.settle()  # the checkpoint and the committed step agree
        self.checkpointing.save(self, checkpoint, Path(self.broadcast(str(filepath))))

    def checkpoint_staging_bytes(self) -> int:
        """Memory this rank will allocate at its next checkpoint save and does not hold yet (the advisor's OOM
        forecast counts it; see :meth:`.Checkpointing.unstaged_bytes`)."""
        return self.checkpointing.unstaged_bytes(self)

    def checkpoint_extra_meta(self) -> dict[str, Any]:
        """What a checkpoint's ``meta.pt`` holds besides Lightning's dict (a collective)."""
        return {"dlrover_rank_states": self.fault.gather_rank_states(),
                "dlrover_module_class": _class_path(self.lightning_module), POOLED_KEYS: shard_model.pooled_keys(self)}

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a checkpoint of :meth:`save_checkpoint` into the current sharding, on any world size.

        While a failed job's state restored by set-up is pending (see :meth:`setup`), that is returned instead.
        ``meta.pt`` is read without unpickling arbitrary objects unless ``weights_only=False``.
        """
        if self._resume is not None:
            rank_zero_info(f"DLRoverStrategy: not loading {checkpoint_path}: the job resumes from its restored state.")
            return self._resume
        meta = self.checkpointing.load(self, Path(self.broadcast(str(checkpoint_path))),
                                       self.lightning_module.strict_loading, weights_only)
        self.fault.after_checkpoint_load(meta)
        shard_model.say_if_reordered(self, meta.get(POOLED_KEYS), meta.get("global_step"), f"loaded {checkpoint_path}")
        return meta

    def latest_checkpoint(self, at_most: int | None) -> Path | None:
        """The newest complete checkpoint (step ``<= at_most``) under the trainer's ``ModelCheckpoint`` directory,
        at the start of a restarted job; half-written ones (``*.partial``) a failed save left are removed."""
        callback = self.lightning_module.trainer.checkpoint_callback
        found = None
        if self.is_global_zero and callback is not None and getattr(callback, "dirpath", None):
            job.remove_partial(Path(callback.dirpath))
            found = directory.latest_checkpoint(Path(callback.dirpath), at_most)
        found = self.broadcast(str(found) if found is not None else None)
        return Path(found) if found is not None else None

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """No-op: :meth:`load_checkpoint` already loaded the sharded model."""

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Loads the dense optimizers' state, which becomes the committed replicated state."""
        super().load_optimizer_state_dict(checkpoint)
        self.fault.after_optimizer_state_load()

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Removes a checkpoint directory (rank 0; after the commit of an asynchronous save in flight)."""
        self.checkpointing.remove(Path(filepath), self.is_global_zero)

    @override
    def teardown(self) -> None:
        """Ends a ``fit`` whose training loop did not run (it resumed at its last step) as :meth:`on_train_end` does;
        releases the accelerator; the model stays sharded for later ``validate``/``test`` calls."""
        process_exit.end_skipped_fit(self.lightning_module, self.on_train_end)
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _class_path(module: pl.LightningModule) -> str:
    """``package.module.Class`` of ``module`` (``meta.pt`` keeps it: ``lightning-dlrover export`` builds the module)."""
    return f"{type(module).__module__}.{type(module).__qualname__}"
