"""A world process group whose gloo communicator can be replaced while the job runs.

TorchRec's ``DistributedModelParallel`` keeps the world group in many places (``ShardingEnv``, the
all-to-all modules, the sharding objects, DDP), so a lost rank cannot be replaced by handing them a new
group. :class:`ReconfigurableGroup` is that world group for the job's whole life: every collective goes to
an inner ``ProcessGroupGloo``, and :meth:`ReconfigurableGroup.reconfigure` swaps the inner group for one on
a fresh store prefix: with the same rank and world size when a replacement process takes the lost rank's number,
with a new rank and a smaller world size when the survivors go on without the lost ranks (a shrink), or with new
processes up to its :attr:`~ReconfigurableGroup.capacity` (a grow: the launch's world size, or ``launch
--max-nproc-per-node``'s ranks, :data:`MAX_WORLD_ENV`).

A shrink or grow changes what the group reports from Python (``rank()``, ``size()``, and so ``dist.get_rank()``,
``dist.get_world_size()``, TorchRec's ``ShardingEnv.from_process_group``) and torch's record of the world's ranks.
The C++ ``ProcessGroup`` keeps the rank and size it was constructed with (``const`` members): C++ readers of them
see those values. The C++ size is therefore the capacity, the largest world the job may grow to, from the start. C++
callers of the collectives reach the Python methods here, and an all-gather sized by the capacity is cut to the live
world (DDP's parameter check); DDP's reducer divides summed gradients by ``getSize()``, and :func:`use_live_size`
gives a DDP module the communication hook that divides by the live size instead (:func:`divide_by_live_size`).

While a replacement process builds its trainer and model it is *joining*: its collectives are answered
locally as if every rank held its own values (Lightning's set-up barriers and broadcasts, DDP's parameter
check), because the survivors, who are in the middle of training, do not run them. The join protocol of
:mod:`lightning_dlrover.fault.inplace.protocol` ends that state on both sides at the same point.

Why not ``torchft.process_group.ProcessGroupGloo``: its wrapper reports the rank it was constructed with
(0) after reconfiguration, has no ``gather``/``scatter``/``allgather_coalesced``, which TorchRec and
Lightning use, and needs OpenTelemetry at import.

Example::

    register()  # once per process, before init_process_group
    dist.init_process_group(BACKEND, init_method="env://")
    group = dist.group.WORLD                 # a ReconfigurableGroup
    group.reconfigure(generation=1)          # after a loss: every rank, with the replacement
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.store import has_key, set_key
from lightning_dlrover.worker_env import restart_count

BACKEND = "dlrover_gloo"
"""Name of the reconfigurable backend for ``init_process_group`` (``DLRoverStrategy(process_group_backend=...)``)."""
#: The most ranks the job may grow to in process (``launch --max-nproc-per-node``, one machine; default: its size).
MAX_WORLD_ENV = "LIGHTNING_DLROVER_MAX_WORLD_SIZE"

_create_work = torch._C._distributed_c10d._create_work_from_future


class ReconfigurableGroup(dist.ProcessGroup):
    """The job's world group: a gloo group on ``<generation>/`` of ``store`` that can be replaced in place.

    Args:
        store: the job's store (hosted by the launcher, so it outlives any worker).
        rank: this process's rank.
        world_size: number of ranks.
        timeout: collective timeout of the inner gloo groups.
        joining: start in the joining state (a replacement building its model).
        capacity: the largest world size it may grow to (default, and at least: ``world_size``).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                 joining: bool = False, generation: int = 0, capacity: int = 0) -> None:
        capacity = max(capacity, world_size)
        super().__init__(rank, capacity)
        self._rank, self._size = rank, world_size  # what Python sees (the C++ members are fixed at construction)
        self.launch_size = world_size  # the size it started with (``launch --regrow`` grows back to it)
        self.capacity = capacity  # the largest world it can grow to (the C++ size)
        self._store, self._timeout = store, timeout
        #: Full launches of the job before this one (the launcher's restarts): each has its own store keys.
        self.launch = restart_count()
        self.generation = generation
        self.joining = joining
        self._inner: dist.ProcessGroup | None = None
        self._name: str | None = None
        self._connect(generation)

    def _connect(self, generation: int) -> None:
        store = dist.PrefixStore(f"dlrover_pg/{self.launch}/{generation}/", self._store)
        if generation > 0:  # (generation 0: the ranks of a launch waited for each other in ``register``)
            await_members(self._store, self.launch, generation, self.rank(), self.size())
        inner = dist.ProcessGroupGloo(store, self.rank(), self.size(), self._timeout)
        self._inner, self.generation = inner, generation
        # The group's name lives in its backends (DeviceMesh looks the world group up by name); C++ callers that
        # dispatch by device (DDP's reducer) reach the current gloo group through this registration too.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, inner)
        if self._name is not None:
            self._set_group_name(self._name)

    def reconfigure(self, generation: int, rank: int | None = None, world_size: int | None = None) -> float:
        """Replaces the inner gloo group by a new one for ``generation`` (collective over the new members:
        blocks until every rank, the replacements included, has called it). Returns the seconds it took.

        ``rank`` and ``world_size`` (default: unchanged) renumber this process in a smaller world (a shrink, where
        the survivors go on without the lost ranks) or a larger one up to :attr:`capacity` (a grow, where new
        processes join). Every member must pass the same ``world_size`` and a distinct ``rank`` below it."""
        if generation <= self.generation:
            raise ValueError(f"generation {generation} is not newer than the current {self.generation}.")
        rank = self._rank if rank is None else rank
        world_size = self._size if world_size is None else world_size
        if not 0 <= rank < world_size or world_size > self.capacity:
            raise ValueError(f"rank {rank} of world size {world_size}: a reconfigured group's world size is at most "
                             f"its capacity of {self.capacity} ranks (C++ readers keep that size; launch "
                             "--max-nproc-per-node sets it), and each rank is below the new world size.")
        started = time.perf_counter()
        self._inner = None  # a failed peer's group is never used again
        self._rank, self._size = rank, world_size
        _record_world(self)
        self._connect(generation)
        return time.perf_counter() - started

    def rank(self) -> int:
        """This process's rank in the current generation."""
        return self._rank

    def size(self) -> int:
        """The world size of the current generation."""
        return self._size

    def getBackendName(self) -> str:
        return "gloo"  # what runs the collectives; torch and TorchRec pick CPU code paths by this name

    @property
    def inner(self) -> dist.ProcessGroup:
        """The current gloo group."""
        if self._inner is None:
            raise RuntimeError("The process group is being reconfigured after a lost rank; no collective can run.")
        return self._inner

    # ---------------------------------------------------------------------------------- collectives
    def _call(self, name: str, local: Callable[[], Any], *args: Any) -> dist.Work:
        if self.joining:
            result = local()
            future: Future = Future()
            future.set_result(result)
            return _create_work(future)
        return getattr(self.inner, name)(*args)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._call("allreduce", lambda: _local_reduce(tensors, opts.reduceOp, self.size()), tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._call("allreduce_coalesced", lambda: _local_reduce(tensors, opts.reduceOp, self.size()),
                          tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._call("reduce", lambda: _local_reduce(tensors, opts.reduceOp, self.size()), tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._call("broadcast", lambda: tensors, tensors, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._call("barrier", lambda: None, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        outputs = self._live_slots(outputs, inputs)
        return self._call("allgather", lambda: _fill_all(outputs, inputs), outputs, inputs, opts)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        outputs = self._live_slots(outputs, inputs)
        return self._call("allgather_coalesced", lambda: _fill_all(outputs, inputs), outputs, inputs, opts)

    def _live_slots(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``outputs`` cut to the live world size. C++ callers (DDP's parameter check) size them by the capacity the
        group was constructed with; the slots past the live ranks get this rank's own values."""
        if not outputs or len(outputs[0]) <= self._size:
            return outputs
        for slots, value in zip(outputs, inputs):
            for extra in slots[self._size:]:
                extra.copy_(value)
        return [slots[: self._size] for slots in outputs]

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._call("_allgather_base", lambda: output.copy_(input.repeat(self.size())), output, input, opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._call("gather", lambda: _fill_all(outputs, inputs) if outputs else None, outputs, inputs, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        def local() -> None:
            if inputs:
                outputs[0].copy_(inputs[0][self.rank()])
        return self._call("scatter", local, outputs, inputs, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._call("alltoall_base", lambda: _refuse("all_to_all"), output, input, output_splits,
                          input_splits, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._call("alltoall", lambda: _refuse("all_to_all"), outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        return self._call("reduce_scatter", lambda: _refuse("reduce_scatter"), outputs, inputs, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._call("send", lambda: _refuse("send"), tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._call("recv", lambda: _refuse("recv"), tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        return self._call("recv_anysource", lambda: _refuse("recv"), tensors, tag)


def _record_world(group: ReconfigurableGroup) -> None:
    """Tells torch's record of the groups (global rank -> group rank) the world's new members, when ``group`` is
    the default group: ``dist.get_process_group_ranks`` and DeviceMesh read it."""
    c10d = dist.distributed_c10d
    if c10d.GroupMember.WORLD is group:
        c10d._world.pg_group_ranks[group] = {r: r for r in range(group.size())}


def use_live_size(module: torch.nn.Module) -> None:
    """Gives ``module``, when it is a DDP module on the world group of a job whose live size is not the group's C++
    size (a shrink, or room to grow), the gradient averaging over the live ranks (:func:`divide_by_live_size`)."""
    group = dist.group.WORLD if dist.is_initialized() else None
    if isinstance(module, torch.nn.parallel.DistributedDataParallel) and isinstance(group, ReconfigurableGroup) \
            and group.size() != group.capacity:
        module.register_comm_hook(group, divide_by_live_size)


def divide_by_live_size(group: ReconfigurableGroup, bucket: dist.GradBucket) -> Future:
    """DDP's default gradient averaging (sum over the ranks, divided by their number) with the number of ranks
    read from ``group`` now: DDP's C++ reducer would divide by the group's C++ size, its capacity
    (:func:`use_live_size` registers it: ``ddp.register_comm_hook(group, divide_by_live_size)``).
    It scales by ``1 / size`` before the sum, as the reducer does, so the gradients are bitwise the same."""
    tensor = bucket.buffer()
    tensor.mul_(1.0 / group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks a hook's annotations as objects; this module's are strings (``from __future__ import annotations``).
divide_by_live_size.__annotations__.update(bucket=dist.GradBucket, group=ReconfigurableGroup,
                                           **{"return": Future[torch.Tensor]})


def await_members(store: dist.Store, launch: int, generation: int, rank: int, world_size: int,
                  timeout: float | None = None) -> None:
    """Says ``rank`` connects ``generation`` of the world group and waits until every rank does, up to ``timeout``
    seconds (default ``$LIGHTNING_DLROVER_START_TIMEOUT``, 600). gloo's own wait for its peers is the job's collective
    timeout (20 s in the chaos job), too short for a peer that is still on its way: a replacement still setting up, a
    survivor that has not yet seen its collective fail (a slow step, a save) on a loaded machine. Raises
    ``RuntimeError`` naming the missing ranks."""
    membership.meet(store, f"dlrover_connecting/{launch}/{generation}", rank, world_size, timeout,
                    f"connect generation {generation} of the world group")


def mark_started(store: dist.Store, launch: int, rank: int) -> None:
    """Tells the launcher (``store``: its store) that ``rank`` of launch ``launch`` reached its process group (see
    :func:`started`)."""
    set_key(store, f"{launch}/group_started/{rank}", str(os.getpid()))


def started(store: dist.Store, launch: int, rank: int) -> bool:
    """Whether ``rank`` of launch ``launch`` reached its process group. A rank lost before then is started again as
    that rank (the others wait for it in their own start), not replaced by a joining process (they would never
    connect the generation it joins)."""
    return has_key(store, f"{launch}/group_started/{rank}")


def _local_reduce(tensors: list[torch.Tensor], op: dist.ReduceOp, world_size: int) -> list[torch.Tensor]:
    """A reduction over ``world_size`` ranks that all hold these values."""
    if op == dist.ReduceOp.SUM:
        for t in tensors:
            t.mul_(world_size)
    return tensors


def _fill_all(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    for slots, value in zip(outputs, inputs):
        for slot in slots:
            slot.copy_(value)
    return outputs


def _refuse(what: str) -> None:
    raise RuntimeError(
        f"{what} while this rank is joining the job: only set-up collectives (barriers, broadcasts, gathers) can "
        "run before the join protocol; data exchanges must wait for it."
    )


def register() -> None:
    """Registers :data:`BACKEND` with ``torch.distributed`` (idempotent)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return

    def create(options: Any, _backend_options: Any) -> ReconfigurableGroup:
        joining = membership.is_joining()
        generation = int(os.environ.get(membership.GENERATION_ENV, "0")) if joining else 0
        # the gloo mesh below waits for its peers only the collective timeout: wait for them to start first
        if joining:
            membership.wait_for_fellow_replacements(restart_count(), generation)
        else:
            mark_started(membership.connect(), restart_count(), options.group_rank)
            membership.wait_for_ranks(options.store, restart_count(), options.group_rank, options.group_size)
        group = ReconfigurableGroup(options.store, options.group_rank, options.group_size, options.timeout,
                                    joining=joining, generation=generation,
                                    capacity=int(os.environ.get(MAX_WORLD_ENV, "0") or 0))
        group._name = options.group_id
        group._set_group_name(options.group_id)  # DeviceMesh (used by TorchRec) looks groups up by name
        return group

    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
