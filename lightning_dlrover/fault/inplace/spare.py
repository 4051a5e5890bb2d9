"""A hot spare's wait for a lost rank: where it blocks, and what it does once it is handed one.

**A spare forked from the zygote waits right after the fork** (:func:`wait_before_program`, called by
:mod:`.zygote` before it runs the program): it connects to the launcher's store, says it waits (``spare_ready``) and
blocks in the store's socket. It has run none of the user's program, so it costs nothing while it waits: no CPU, no
memory of its own beyond the zygote's pages it shares. Before, a forked spare ran the program up to the strategy's
``setup_environment`` first (LightningCLI's parsing, the model, data module and trainer built, ``check_model``) at idle
priority beside the training ranks: seconds of wall time on a loaded machine (~6 s on 2 cores beside two ranks),
during which a kill found a spare still setting up (``readiness`` ``forked``) and its set-up took CPU from training.

**What must stay after the wait** (it runs once the spare holds a rank, at the ranks' priority): the user's program
itself, from its first line to ``Trainer.fit``'s process group. It is a black box to the launcher: it may read its
rank at any point (:func:`wait_before_program` sets the assigned rank's environment first, so the program starts as
that rank, as a worker ``torchrun`` restarted would), and the objects it builds (model, data, trainer) cannot be built
for a rank nobody knows yet. Then the process group, the sharded model and the join, as for any replacement.

**Where the set-up runs is chosen per machine** (:func:`sets_up_late`): the wait before the program (above) where the
machine's ranks take every core, so a set-up beside them would take steps from training (measured on 2 cores beside
two ranks: ~1-1.3 s of training lost per spare set up, 4 set-ups in a 3-kill drill); the set-up first, then the wait
(in the strategy's set-up, as a fresh interpreter does) where a core is free of ranks: there the set-up costs training
nothing and a recovery is only the join (~0.4-0.6 s from kill to training again, against the program's set-up on top
when it runs late). ``$LIGHTNING_DLROVER_SPARE_SETUP`` (``early`` / ``late``) overrides the choice.

A spare started as a fresh interpreter (``launch --no-zygote``, or a program the zygote cannot run) waits where it
always did, in the strategy's set-up before its process group (:func:`take_rank`, from
:func:`~lightning_dlrover.fault.inplace.protocol.take_rank_if_spare`).
"""

from __future__ import annotations

import os

from torch.distributed import Store

from lightning_dlrover.fault.coding import reserve
from lightning_dlrover.fault.inplace import membership, priority
from lightning_dlrover.log import get_logger
from lightning_dlrover.machine import available_cores
from lightning_dlrover.monitor import emit
from lightning_dlrover.worker_env import restart_count

log = get_logger(__name__)

#: ``early`` (a spare sets up its program, then waits) or ``late`` (it waits, then sets up as the rank it takes); unset
#: or ``auto``: :func:`sets_up_late` decides by the machine's cores.
SETUP_ENV = "LIGHTNING_DLROVER_SPARE_SETUP"

_taken: membership.Assignment | None = None  # the rank this process took before its program ran


def wait_for_rank(store: Store, index: int) -> membership.Assignment:
    """Says spare ``index`` waits (``spare_ready``), blocks until the launcher hands it a lost rank, and puts this
    process back at the ranks' CPU priority; returns the assignment."""
    reserve.prepare(store, restart_count())  # faults in the memory a replacement's state will take (off the recovery)
    emit("spare_ready", spare=index, message=f"hot spare {index} started and waits for a rank")
    assignment = membership.wait_for_assignment(store, restart_count(), index)
    if (refused := priority.restore()) is not None:  # the launcher started it at the lowest CPU priority
        log.warning(f"the spare taking rank {assignment.rank} keeps the lowest CPU priority: {refused}")
    return assignment


def sets_up_late() -> bool:
    """Whether a forked spare waits before its program runs: yes where this machine's ranks (``LOCAL_WORLD_SIZE``)
    take every core this process may run on, or where ``$LIGHTNING_DLROVER_SPARE_SETUP`` says ``late``."""
    choice = os.environ.get(SETUP_ENV, "auto").strip().lower()
    if choice in ("early", "late"):
        return choice == "late"
    if choice != "auto":
        log.warning(f"${SETUP_ENV}={choice!r} is not one of early, late, auto: choosing by the machine's cores")
    return available_cores() <= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def wait_before_program() -> membership.Assignment | None:
    """In a worker forked from the zygote, before its program runs: on a spare that sets up late (:func:`sets_up_late`),
    waits for a rank
    (:func:`wait_for_rank`) and gives this process that rank's environment (:func:`membership.become`); ``None``
    (at once) on a rank."""
    global _taken
    index = os.environ.get(membership.SPARE_ENV)
    if not index or not sets_up_late():
        return None
    _taken = wait_for_rank(membership.connect(), int(index))
    membership.become(_taken)
    return _taken


def take_rank(store: Store, index: int) -> membership.Assignment:
    """The rank spare ``index`` takes: the one it took before its program ran, else (a spare started as a fresh
    interpreter) one it waits for now."""
    return _taken if _taken is not None else wait_for_rank(store, index)
