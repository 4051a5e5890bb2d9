"""A resize the job asks for: a shrink (the highest ranks retire and the others go on at the smaller world size) or a
grow (new processes join), in process.

The resource advisor may find that fewer or more ranks train faster or cheaper (``ResourceAdvisor(apply=True)``). Under
``lightning-dlrover launch`` on one machine, the job then resizes without a restart:

1. every rank asks at the same step (:meth:`~.protocol.InProcessRecovery.ask_to_resize`; the strategy's
   ``resize_in_process``); rank 0 writes the request into the launcher's store (:func:`~.membership.ask_to_resize`).
   What the ranks can know is checked first, on every rank alike (:func:`ask`): nothing is asked then. A grow
   goes up to the world group's capacity (``launch --max-nproc-per-node``), and the launcher runs it as ``--regrow``
   does (:mod:`.grow`: a process started and set up beside training, then one grow plan per new rank); a shrink:
2. the launcher answers (:func:`answer`) once no recovery runs: it checks this machine's memory as for a shrink after
   a loss, then publishes a shrink plan that retires ranks ``world_size ..`` (``asked``), or refuses
   (``shrink_refused``; the job trains on as it is);
3. rank 0 sees the plan at its next commit and says so in the commit's vote, so every rank stops at the same step
   boundary (``ResizeRequested``); the retiring ranks leave their processes (``retired``, exit status 0), and the
   others run the shrink after a loss (:mod:`.shrink`): the retired ranks' shards are decoded from parity, exactly
   the committed state, and re-sharded onto the survivors.

The retired ranks' state is taken from parity rather than sent by them: it is the shrink's tested path, and a
retiring rank holds nothing the parity lacks at a commit boundary.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_dlrover.fault.host import Host
from lightning_dlrover.fault.inplace import membership, shrink
from lightning_dlrover.monitor import emit
from lightning_dlrover.worker_env import restart_count

if TYPE_CHECKING:
    from lightning_dlrover.fault.inplace.supervisor import Supervisor

SEVERAL_MACHINES = "several_machines"  # ``why`` of a ``shrink_refused``: the launcher shrinks one-machine jobs only


def ask(store: Any, group: Any, world_size: int, parity: tuple[int, int] | None, can_reshard: bool) -> str | None:
    """Asks the launcher (rank 0 of ``group``) to shrink or grow the job to ``world_size`` ranks: ``None`` once asked,
    else why the ranks cannot (the same answer on every rank; nothing is asked)."""
    if store is None or group is None:
        return "the job does not run under lightning-dlrover launch with in-process recovery"
    if not can_reshard:
        return "this strategy cannot re-shard its model in process"
    size = group.size()
    if world_size < 1 or world_size == size:
        return f"{world_size} ranks is not another world size than the job's {size}"
    if int(os.environ.get("LOCAL_WORLD_SIZE", size)) != size:
        return "the job runs on several machines (the launcher resizes one-machine jobs only)"
    if world_size > group.capacity:
        return (f"the job may grow to {group.capacity} ranks at most (launch --max-nproc-per-node sets how many ranks "
                "this machine may run)")
    refused = shrink.refusal(size, list(range(world_size, size)), parity, asked=True) if world_size < size else None
    if refused is not None:
        return refused[1]
    if group.rank() == 0:
        membership.ask_to_resize(store, restart_count(), group.generation, world_size)
    return None


def retire(host: Host, plan: membership.Plan, step: int, leave: Callable[[], None] | None) -> None:
    """On a rank the plan retires, at the commit boundary every rank agreed on: says so and ends the process (the
    others decode its shards from parity)."""
    emit("retired", step=step, generation=plan.generation, world_size=plan.world_size,
         message=f"rank {host.global_rank} retired at step {step}: the job goes on at {plan.world_size} ranks")
    if leave is None:
        raise RuntimeError("a retiring rank needs the strategy's leave() (set with the resharder)")
    leave()


def answer(sup: Supervisor, recovering: int | None) -> int | None:
    """The launcher's side, from its loop: answers a resize the ranks asked for once no recovery runs: a shrink with a
    plan that retires the highest ranks, or a refusal with the reason (returns the plan's generation: a recovery in
    progress); a grow by handing it to :class:`~.grow.Regrow` (``None``)."""
    if recovering is not None:
        return None
    asked = membership.resize_asked(sup.store, sup.restarts)
    # (a later request of the same generation for another size is answered too: e.g. after a refusal)
    if asked is None or asked[0] < sup.asked_answered[0] or asked == sup.asked_answered:
        return None
    sup.asked_answered, world_size = asked, asked[1]
    if world_size > sup.live_world:
        sup.regrow.ask(sup, world_size)
        return None
    retiring = list(range(world_size, sup.live_world))
    if sup.args.nnodes != 1 or sup.joined:
        shrink.refuse(sup.live_world, retiring, SEVERAL_MACHINES, "the launcher shrinks one-machine jobs only",
                      asked=True)
        return None
    generation = shrink.shrink_in_process(sup, retiring, asked=True)
    if generation is not None:
        sup.regrow.ask(sup, world_size)  # the job's size from now on (``--regrow`` does not undo it)
    return generation


def reap(sup: Supervisor, grace_s: float = 60.0) -> None:
    """Forgets retired ranks that ended; one still running ``grace_s`` seconds after its plan is stopped."""
    now = time.monotonic()
    for worker, since in sup.retiring:
        if worker.process.poll() is None and now - since > grace_s:
            worker.process.kill()
            worker.process.wait()
    sup.retiring = [(w, since) for w, since in sup.retiring if w.process.poll() is None]
