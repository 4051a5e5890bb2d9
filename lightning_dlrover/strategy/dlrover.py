"""``DLRoverStrategy``: Lightning training of TorchRec-sharded models.

The LightningModule is wrapped in TorchRec's ``DistributedModelParallel``: embedding tables are
sharded by TorchRec's planner and updated by fused in-backward optimizers, every other parameter is
replicated and synchronised by DDP. Checkpoints are sharded (every rank writes its own shards) and
load into any world size. With parity, every training step is committed across ranks, and a job that
``torchrun`` restarts after a node loss resumes at the last committed step from the survivors' memory.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.constants import default_pg_timeout
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import KeyedOptimizer

from lightning_dlrover.checkpoint import complete_sharded_state, get_backend, state_digest
from lightning_dlrover.fault import (
    CodedEmbeddings,
    CodedState,
    FaultInjector,
    ParityConfig,
    ParityPlacement,
    ReplicatedSnapshot,
)
from lightning_dlrover.fault.recovery import Spill, Unrecoverable, read_spills, restore, spill_dir, write_spill
from lightning_dlrover.monitor import StepTimer
from lightning_dlrover.strategy.sharding import (
    COMPUTE_KERNELS,
    CPU_DEFAULT_SHARDING_TYPES,
    SHARDING_TYPES,
    TableConstraint,
    build_constraints,
    check_choices,
    describe_plan,
    embedding_tables,
    plan_sharding,
    unfused_embedding_parameters,
)

log = logging.getLogger(__name__)
META_FILE = "meta.pt"
SHARDED_DIR = "sharded"


def _announce(message: str) -> None:
    """Prints a recovery event with its wall-clock time (stderr, every rank): launchers and tests read these."""
    print(f"lightning_dlrover [{time.time():.3f}]: {message}", file=sys.stderr, flush=True)


def _node_loss_note(placement: ParityPlacement) -> str:
    if placement.nodes == 1:
        return ""
    if placement.tolerates_node_loss:
        return f", and so is any one of the {placement.nodes} nodes"
    return "; a lost node is NOT (it holds too many members of a parity group: raise r or add nodes)"


class _CommitPoint(pl.Callback):
    """Commits each training step at the end of its batch (added by the strategy, after the user's callbacks)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.strategy.commit(trainer)


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_exit_state: dict[str, Any] = {"fit_finished": False, "failed": False, "excepthook": None}


def _record_failure(*args: Any) -> None:
    """``sys.excepthook``: notes that the process is failing, then defers to the hook it replaced."""
    _exit_state["failed"] = True
    _exit_state["excepthook"](*args)


def _exit_after_finished_fit() -> None:
    """Ends a rank of a multi-process job whose training finished, and that raised nothing since, with status 0
    right after the exit handlers registered after the strategy's set-up, skipping C++ static destructors.

    One of them sometimes destroys a still-joinable thread and aborts the finished process ("terminate
    called without an active exception": 3 in 18 ``torchrun`` runs here, and in the test suite's popen
    launches), which fails the job; ``torchrun`` would even restart it. A ``sys.exit(n)`` after a finished
    ``fit`` therefore exits with 0.
    """
    if _exit_state["fit_finished"] and not _exit_state["failed"]:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class DLRoverStrategy(DDPStrategy):
    """Trains a LightningModule whose embedding tables are sharded by TorchRec.

    Args:
        sharding_types: sharding types the planner may use for every table. Default: on CPU (gloo)
            ``table_wise``, ``column_wise`` and ``table_column_wise``; on GPU every type.
        compute_kernel: TorchRec compute kernel of sharded tables (``fused`` applies the tables'
            in-backward optimizer inside the kernel).
        constraints: per-table planner constraints, keyed by table name.
        checkpoint_backend: ``"dcp"`` (``torch.distributed.checkpoint``) or ``"torchsnapshot"``.
        parity: erasure-code the embedding shards and their optimizer state across ranks (``None``: off).
        print_digest: at the end of ``fit``, print ``state digest: <sha256>`` of the whole training state
            on rank 0 (a collective over all shards; costs one pass over the state).
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
        parity: ParityConfig | None = None,
        print_digest: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.sharding_types = sharding_types
        self.compute_kernel = compute_kernel
        self.constraints = {
            table: TableConstraint(**c) if isinstance(c, dict) else c for table, c in (constraints or {}).items()
        }
        check_choices("sharding_types", sharding_types, SHARDING_TYPES)
        check_choices("compute_kernel", [compute_kernel], COMPUTE_KERNELS)
        for table, constraint in self.constraints.items():
            check_choices(f"constraints.{table}.sharding_types", constraint.sharding_types, SHARDING_TYPES)
            check_choices(f"constraints.{table}.compute_kernels", constraint.compute_kernels, COMPUTE_KERNELS)
        self.checkpoint_backend = get_backend(checkpoint_backend)
        self.print_digest = print_digest
        self.parity = ParityConfig(**parity) if isinstance(parity, dict) else parity
        self.step_timer = StepTimer()
        self._dmp: DistributedModelParallel | None = None
        self._coded: CodedEmbeddings | None = None
        self._replicated = ReplicatedSnapshot(self._replicated_tensors)
        self._committed_meta: dict[str, Any] | None = None  # the trainer's state at the last commit
        self._resume_meta: dict[str, Any] | None = None  # restored by set-up, for Lightning to resume from
        self._started = self._ready = self._recovered = self._snapshotting = self._resume_announced = False
        #: Called as ``point(phase, step)`` at ``before_forward``, ``after_optimizer`` and ``during_parity_commit``
        #: of training step ``step`` (see :class:`~lightning_dlrover.fault.FaultInjector`), and at ``after_commit``
        #: with ``step`` the number of committed steps.
        self.fault_points: list[Callable[[str, int], None]] = []

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``"dlrover"`` so that ``Trainer(strategy="dlrover")`` works."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="TorchRec-sharded embeddings with DLRover fault tolerance"
            )

    def setup_environment(self) -> None:
        """Initialises the process group, and destroys it at interpreter exit."""
        super().setup_environment()
        if _exit_state["excepthook"] is None:
            _exit_state["excepthook"], sys.excepthook = sys.excepthook, _record_failure
            atexit.register(_exit_after_finished_fit)  # registered first, so it runs after the destroy below
        atexit.register(_destroy_process_group)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded model, so they are restored after :meth:`setup`."""
        return True

    @property
    def recovered(self) -> bool:
        """Whether set-up restored a failed job's state (from survivors' spills or the fallback checkpoint)."""
        return self._recovered

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The in-backward optimizer of every sharded table (state as ``ShardedTensor`` views of live buffers)."""
        if self._dmp is None:
            raise RuntimeError("The model is not sharded yet: the fused optimizer exists after `Trainer.fit` set-up.")
        return self._dmp.fused_optimizer

    def setup(self, trainer: pl.Trainer) -> None:
        """Shards the model, then sets up the dense optimizers and precision.

        Under ``torchrun`` the first fit restores a failed job's state: decoded from the survivors' spills
        (parity on) or else loaded from the newest checkpoint (see ``lightning_dlrover.fault.recovery``).
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported by "
                "DLRoverStrategy: fused embedding optimizers update the tables in every backward pass. "
                "Increase the data module's batch size instead."
            )
        self.precision_plugin.convert_module(self.model)
        self.model = self._dmp if self._dmp is not None else self._shard(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if not self._started:  # the first fit of this process
                self._started = True
                self._start(trainer)
            if (injector := FaultInjector.from_env()) is not None:  # LIGHTNING_DLROVER_FAULT=rank=R,step=S,phase=P
                injector.attach(self)
        self.setup_precision_plugin()

    def _start(self, trainer: pl.Trainer) -> None:
        """Restores the state of a failed elastic job (survivors' spills, else its last checkpoint), then encodes
        the parity of every rank's embedding state (collective).

        Under ``torchrun`` the restored state is handed to Lightning as the checkpoint to resume from.
        """
        state = CodedState(self.model, self.parity.k) if self.parity is not None else None
        spills, fallback = [], None
        if "TORCHELASTIC_RUN_ID" in os.environ:  # the same on every rank of an elastic job
            spills = read_spills(spill_dir(), self.local_rank, self.num_processes)
            try:
                restored = restore(state, spills)
            except Unrecoverable as err:
                restored, fallback = None, err
            if restored is not None:
                self._resume_meta, report = restored
                self._recovered = True
                self._load_dense_state(self._resume_meta)
                if self.is_global_zero:
                    _announce(f"{report}; resuming")
        if state is not None:
            self._coded = self._encode_parity(state)
            self._replicated.take()
        if not any(isinstance(c, _CommitPoint) for c in trainer.callbacks):
            trainer.callbacks.append(_CommitPoint())  # last: after every checkpoint of the batch
        if fallback is not None:
            self._resume_meta = self._fall_back_to_checkpoint(trainer, fallback)
            self._recovered = True
        if self._resume_meta is not None:
            if self._coded is not None:
                self._coded.committed_step = self._resume_meta["global_step"]
            trainer._checkpoint_connector._loaded_checkpoint = self._resume_meta  # restored like a checkpoint
        for spill in spills:  # the state they held is live again (or superseded by the checkpoint)
            spill.path.unlink(missing_ok=True)
        self._ready = True

    def _encode_parity(self, state: CodedState) -> CodedEmbeddings:
        """Encodes the parity every rank holds of ``state`` (collective) and reports its size."""
        assert self.parity is not None
        k, r = self.parity.k, self.parity.r
        placement = ParityPlacement(self.world_size, k, r, self.num_processes)
        coded = CodedEmbeddings(state, placement)
        state_bytes, parity_bytes = state.num_bytes, coded.parity.numel()
        rank_zero_info(
            f"DLRoverStrategy parity k={k} r={r}: rank 0 codes {state_bytes / 2**20:.2f} MiB of embedding "
            f"state and holds {parity_bytes / 2**20:.2f} MiB of parity ({parity_bytes / max(state_bytes, 1):.0%}); "
            f"any {r} lost ranks are recoverable{_node_loss_note(placement)}."
        )
        return coded

    def _fall_back_to_checkpoint(self, trainer: pl.Trainer, reason: Unrecoverable) -> dict[str, Any]:
        """Loads the newest checkpoint of the trainer's ``ModelCheckpoint`` after an unrecoverable loss."""
        path = self._latest_checkpoint(trainer, reason.step)
        if path is None:
            raise RuntimeError(
                f"{reason} There is no checkpoint to fall back to: add a ModelCheckpoint(every_n_train_steps=N) "
                "callback, or remove the spills in the spill directory to start from scratch."
            ) from None
        started = time.perf_counter()
        meta = self.load_checkpoint(path)
        lost, seconds = reason.step - meta["global_step"], time.perf_counter() - started
        if self.is_global_zero:
            _announce(
                f"{reason} Resuming from checkpoint {path} at step {meta['global_step']} (loaded in {seconds:.3f} s): "
                f"{lost} committed steps lost"
            )
        return meta

    def _latest_checkpoint(self, trainer: pl.Trainer, at_most: int) -> Path | None:
        """The checkpoint directory with the highest global step ``<= at_most`` under the ``ModelCheckpoint``'s
        ``dirpath``."""
        callback = trainer.checkpoint_callback
        directory = Path(callback.dirpath) if callback is not None and getattr(callback, "dirpath", None) else None
        best = None
        if self.is_global_zero and directory is not None and directory.is_dir():
            found = []
            for meta in directory.glob(f"*/{META_FILE}"):
                step = torch.load(meta, map_location="cpu", weights_only=False)["global_step"]
                if step <= at_most:
                    found.append((step, str(meta.parent)))
            best = max(found)[1] if found else None
        best = self.broadcast(best)
        return Path(best) if best is not None else None

    def _load_dense_state(self, meta: dict[str, Any] | None) -> None:
        """Copies the spilled dense parameters and buffers into the model (the tables are already restored)."""
        if meta is None:
            return
        live = self.lightning_module.state_dict()
        for key, value in meta.pop("state_dict").items():
            live[key].copy_(value)
        meta["state_dict"] = {}

    def _replicated_tensors(self) -> list[torch.Tensor]:
        """Dense parameters and dense optimizer state tensors, in a fixed order."""
        tensors = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    tensors.append(param)
                    tensors += [v for _, v in sorted(optimizer.state.get(param, {}).items()) if torch.is_tensor(v)]
        return tensors

    def _reach(self, phase: str, step: int | None = None) -> None:
        step = self.lightning_module.trainer.global_step if step is None else step
        for point in self.fault_points:
            point(phase, step)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's training step, after the ``before_forward`` fault point."""
        self._reach("before_forward")
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Runs the step, then sends the embedding rows it changed to their parity (when parity is on)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._reach("after_optimizer")
        if self._coded is not None:
            with self.step_timer.section("parity"):
                self._coded.send_deltas()
        return output

    def commit(self, trainer: pl.Trainer) -> None:
        """Commits the training step that just ended: the vote, then snapshots of the dense and trainer state.

        Called at the end of every training batch, after every other callback.
        """
        step = trainer.global_step
        if self._coded is not None:
            with self.step_timer.section("parity"):
                self._reach("during_parity_commit", step - 1)
                self._snapshotting = True
                try:
                    meta = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
                finally:
                    self._snapshotting = False
                self._coded.commit(step)
                self._replicated.take()
                self._committed_meta = meta
        if self.recovered and not self._resume_announced:
            self._resume_announced = True
            if self.is_global_zero:
                _announce(f"training resumed: step {step} committed")
        self._reach("after_commit", step)

    def on_train_start(self) -> None:
        """Forgets the restored state once Lightning has resumed from it."""
        super().on_train_start()
        self._resume_meta = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict (empty while :meth:`commit` snapshots the trainer state: the tables are coded)."""
        return {} if self._snapshotting else super().lightning_module_state_dict()

    def on_exception(self, exception: BaseException) -> None:
        """Spills this rank's committed state to shared memory for the restarted job (parity on, under ``torchrun``).

        The in-flight step is rolled back first; a spill needs no other rank.
        """
        directory = spill_dir()
        if directory is None or not self._ready:  # nothing to keep from a set-up that failed
            return
        # The launcher SIGTERMs the other workers of a failed node; Lightning's handler would run a collective.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self._spill(directory, exception)
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _spill(self, directory: Path, exception: BaseException) -> None:
        """Writes this rank's committed state (without parity: only the step it reached) to ``directory``."""
        stopped = time.time()
        if self._coded is None:
            step = self.lightning_module.trainer.global_step
            spill = Spill(self.global_rank, self.world_size, step, k=0, r=0, local_world_size=self.num_processes,
                          chunk_len=0, layouts=[], chunks=None, parity=None, meta=None)
        else:
            spill = self._coded_spill()
        path = write_spill(directory, spill)
        reason = f"{type(exception).__name__}: {str(exception).splitlines()[0][:160] if str(exception) else ''}"
        _announce(
            f"rank {self.global_rank} stopped at {stopped:.3f} ({reason}); spilled the state of step {spill.step} "
            f"to {path} in {time.time() - stopped:.3f} s"
        )

    def _coded_spill(self) -> Spill:
        """This rank's coded state and the trainer's state at the last commit (the in-flight step rolled back)."""
        assert self._coded is not None
        self._coded.rollback()
        self._replicated.restore()
        meta = None
        if self._committed_meta is not None:
            dense = {k: v for k, v in self.lightning_module.state_dict().items() if not isinstance(v, ShardedTensor)}
            meta = {**self._committed_meta, "state_dict": dense}
        state, placement = self._coded.state, self._coded.placement
        return Spill(
            rank=self.global_rank,
            world_size=self.world_size,
            step=max(self._coded.committed_step, 0),
            k=state.k,
            r=placement.r,
            local_world_size=placement.local_world_size,
            chunk_len=state.chunk_len,
            layouts=state.layouts,
            chunks=torch.stack([state.read_chunk(c) for c in range(state.k)]),
            parity=self._coded.parity,
            meta=meta,
        )

    def recover(self, lost_ranks: list[int]) -> None:
        """Rebuilds the embedding shards, optimizer state and parity of ``lost_ranks`` in place, at the last
        committed step, from the survivors' shards and parity (a collective on every rank)."""
        if self._coded is None:
            raise RuntimeError("DLRoverStrategy.recover needs parity: pass DLRoverStrategy(parity=ParityConfig(...)).")
        self._coded.recover(sorted(set(lost_ranks)))
        self._replicated.restore()

    def _shard(self, module: pl.LightningModule) -> DistributedModelParallel:
        """Plans the sharding of ``module``'s embedding tables and wraps it in ``DistributedModelParallel``."""
        tables = embedding_tables(module)
        if not tables:
            raise ValueError(
                f"{type(module).__name__} has no TorchRec EmbeddingBagCollection or EmbeddingCollection; "
                "DLRoverStrategy shards those. Use `strategy='ddp'` for models without embedding tables."
            )
        if self.compute_kernel == "fused" and (unfused := unfused_embedding_parameters(module)):
            raise ValueError(
                f"Embedding parameters {unfused} have no in-backward optimizer, which the fused kernel needs. "
                "Call torchrec.optim.apply_optimizer_in_backward(...) on them in the LightningModule's __init__."
            )
        backend = dist.get_backend()
        default_types = CPU_DEFAULT_SHARDING_TYPES if backend == "gloo" else None
        constraints = build_constraints(
            tables,
            self.sharding_types or default_types or SHARDING_TYPES,
            self.compute_kernel,
            self.constraints,
            backend,
        )
        # Dense parameters move to the device now; meta-device tables are materialised by their shards.
        module._apply(lambda t: t if t.is_meta else t.to(self.root_device))
        plan = plan_sharding(module, constraints, self.root_device, local_world_size=self.num_processes)
        self._dmp = DistributedModelParallel(
            module=module,
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
            device=self.root_device,
            plan=plan,
            data_parallel_wrapper=self._data_parallel_wrapper(),
        )
        rank_zero_info(f"DLRoverStrategy: {describe_plan(plan)}")
        return self._dmp

    @staticmethod
    def _data_parallel_wrapper() -> DefaultDataParallelWrapper:
        """DDP of the dense parameters whose gradient buckets never change.

        DDP normally rebuilds its buckets after the first step, in gradient-ready order. A job resumed
        mid-run would then reduce its first step's gradients in other buckets than an uninterrupted job,
        and with more than two ranks the float sums differ: the resumed job would not be bit-exact.
        Without a static graph and with unused-parameter search, DDP never rebuilds.
        """
        return DefaultDataParallelWrapper(static_graph=False, find_unused_parameters=True)

    def _fused_optimizer_state(self) -> dict[str, Any]:
        """The fused optimizer's state (not its hyper-parameters, which come from the model), keyed alike on every rank."""
        return complete_sharded_state(self.fused_optimizer.state_dict()["state"])

    def training_state(self) -> dict[str, Any]:
        """The full training state: model (sharded tables as ``ShardedTensor``), fused and dense optimizer state."""
        return {
            "model": self.lightning_module.state_dict(),
            "fused_optimizer": self.fused_optimizer.state_dict()["state"],
            "optimizers": [optimizer.state_dict()["state"] for optimizer in self.optimizers],
        }

    def state_digest(self) -> str:
        """SHA-256 of :meth:`training_state`, independent of the sharding plan and world size (collective)."""
        return state_digest(self.training_state())

    def on_train_end(self) -> None:
        """Prints the state digest on rank 0 when ``print_digest`` is set."""
        if self.print_digest and self._dmp is not None:
            digest = self.state_digest()
            if self.is_global_zero:
                print(f"state digest: {digest}", flush=True)
            log.info("state digest: %s", digest)
        _exit_state["fit_finished"] = self.world_size > 1  # one process (a notebook, a test) exits as usual

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Writes a sharded checkpoint directory at ``filepath`` from every rank (collective).

        The directory holds ``sharded/`` (the model and fused optimizer state, written by the backend, each
        rank its own shards) and ``meta.pt`` (everything else, written by rank 0). It is written under a
        temporary name and renamed when complete, so a crash never leaves a partial checkpoint at ``filepath``.
        """
        if storage_options is not None:
            raise TypeError("DLRoverStrategy.save_checkpoint does not take storage_options.")
        path = Path(self.broadcast(str(filepath)))
        staging = path.with_name(path.name + ".partial")
        if self.is_global_zero and staging.exists():
            shutil.rmtree(staging)
        self.barrier("dlrover_checkpoint_staging")
        sharded = {"model": checkpoint.pop("state_dict"), "fused_optimizer": self._fused_optimizer_state()}
        self.checkpoint_backend.save(sharded, staging / SHARDED_DIR)
        if self.is_global_zero:
            extra = {"dlrover_backend": self.checkpoint_backend.name, "dlrover_world_size": self.world_size}
            torch.save({**checkpoint, **extra}, staging / META_FILE)
        self.barrier("dlrover_checkpoint_written")
        if self.is_global_zero:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            staging.rename(path)
        self.barrier("dlrover_checkpoint_committed")

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a checkpoint of :meth:`save_checkpoint` into the current sharding, on any world size.

        While a failed job's state restored by set-up is pending (see :meth:`setup`), that is returned instead.
        """
        if self._resume_meta is not None:
            rank_zero_info(f"DLRoverStrategy: not loading {checkpoint_path}: the job resumes from its restored state.")
            return self._resume_meta
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / META_FILE).is_file():
            raise FileNotFoundError(
                f"{path} is not a DLRoverStrategy checkpoint (no {META_FILE} inside); checkpoints of this strategy "
                "are directories written by Trainer.save_checkpoint or ModelCheckpoint."
            )
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        backend, saved_world_size = get_backend(meta.pop("dlrover_backend")), meta.pop("dlrover_world_size")
        if self.world_size > saved_world_size and not backend.restores_onto_new_ranks:
            raise RuntimeError(
                f"{path} was written by the {backend.name!r} backend at world size {saved_world_size}; it cannot "
                f"restore shards onto the new ranks of world size {self.world_size}. Resume at world size "
                f"<= {saved_world_size} or write checkpoints with DLRoverStrategy(checkpoint_backend='dcp')."
            )
        sharded = {"model": self.lightning_module.state_dict(), "fused_optimizer": self._fused_optimizer_state()}
        backend.load(sharded, path / SHARDED_DIR)
        self.lightning_module.load_state_dict(sharded["model"], strict=self.lightning_module.strict_loading)
        loaded = sharded["fused_optimizer"]
        self.fused_optimizer.load_state_dict({"state": {k: loaded[k] for k in self.fused_optimizer.state_dict()["state"]}})
        if self._coded is not None:
            self._coded.encode()
        return meta

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """No-op: :meth:`load_checkpoint` already loaded the sharded model."""

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Loads the dense optimizers' state, which becomes the committed replicated state."""
        super().load_optimizer_state_dict(checkpoint)
        if self._coded is not None:
            self._replicated.take()

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Removes a checkpoint directory (rank 0)."""
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        """Releases the accelerator; the model stays sharded for later ``validate``/``test`` calls."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
