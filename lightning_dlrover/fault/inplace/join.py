"""A machine joining a running job: ``launch --node-rank K`` with ``--nnodes <= K < --max-nnodes``, started while the
job trains, grows it by that machine's ranks in process, with no running rank restarted.

The job's world group is built with room for ``--max-nnodes`` machines of ``--nproc-per-node`` ranks (or
``--max-nproc-per-node``) from the start: its C++ size, the capacity (:mod:`.process_group`), which machine 0's
launcher publishes and a joining machine's processes take.

- **Machine K's launcher** connects to machine 0's store, finds the job's current launch (its full restarts), starts
  ``--nproc-per-node`` processes of the program, each setting up before it waits for a rank (as a grow's process
  does, :mod:`.grow`), and offers them: ``join/<K>`` in the store, their spare indices. Once they hold ranks it is a
  machine of the job like any other: it beats, says its ranks, replaces its own lost ranks, and machine 0 replaces
  them with its own spares if it goes silent.
- **Machine 0's launcher** (:func:`admit`), once every offered process waits and no recovery runs, publishes one grow
  plan giving them the next rank numbers (device slot: their index on machine K): rank 0 sees it at its next commit
  and says so in the commit's vote, so every rank stops at the same step boundary; the running ranks plan the tables
  for the larger world, take the new ranks into the world group and re-shard the committed state onto them
  (:meth:`~.protocol.InProcessRecovery.grow`), parity re-encoded for the new group.

The edges: a join past the capacity is refused with the reason (``join_refused``; machine K stops its processes); a
join offered during a recovery waits for it; a loss while the job grows is a loss during a recovery (every worker
restarts from its spills); the job finishing before the join, or restarting every worker (which returns it to its
launch size) at any time, ends machine K's launcher, with its processes stopped and the reason (``join_refused``).

Store keys (under ``lightning_dlrover/<launch>/``, beside :mod:`.membership`'s): ``capacity`` (machine 0's),
``join/<K>`` (the spare indices machine K offers), ``join_refused/<K>`` (``[why, reason]``, machine 0's answer).
"""

from __future__ import annotations

import contextlib
import json
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

from lightning_dlrover import worker_env
from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.spare import SETUP_ENV
from lightning_dlrover.fault.inplace.store import PREFIX, get_key, has_key, set_key
from lightning_dlrover.monitor.events import emit

if TYPE_CHECKING:
    from torch.distributed import Store

    from lightning_dlrover.fault.inplace.supervisor import Supervisor

# ``why`` of a ``join_refused``
CAPACITY = "capacity"  # the job's world group has no room for the machine's ranks
JOB_ENDED = "job_ended"  # the job finished, or restarted every worker, before the machine joined
DIED = "died"  # a process the machine offered ended before it joined


def capacity(sup: Supervisor) -> int:
    """The job's world group's capacity from the launch options: ``--max-nnodes`` machines of
    ``--max-nproc-per-node`` ranks."""
    a = sup.args
    return len(machines(sup)) * max(a.max_nproc_per_node, a.nproc_per_node)


def publish_capacity(store: Store, launch: int, ranks: int) -> None:
    """On machine 0: the job's world group's capacity, for the machines that join."""
    set_key(store, f"{launch}/capacity", str(ranks))


def job_capacity(store: Store, launch: int, wait_s: float = 0.0) -> int | None:
    """The capacity machine 0 published for ``launch`` (waiting up to ``wait_s`` seconds for it), else ``None``."""
    key = f"{launch}/capacity"
    if wait_s:
        with contextlib.suppress(RuntimeError):  # (the store raises on a timeout)
            store.wait([PREFIX + key], timedelta(seconds=wait_s))
    return int(get_key(store, key)) if has_key(store, key) else None


def current_launch(store: Store) -> int:
    """The job's launch now (machine 0's full restarts): the newest one machine 0 beats in."""
    launch = 0
    while membership.beats(store, launch + 1, 0) > 0:
        launch += 1
    return launch


def offer(sup: Supervisor) -> str | None:
    """On machine K (joining): starts this machine's processes and offers them to the job; why it cannot, or
    ``None``."""
    a = sup.args
    sup.restarts = current_launch(sup.store)
    # its processes' world group must have the job's C++ size (machine 0 may still be starting: wait for it)
    sup.capacity = job_capacity(sup.store, sup.restarts, wait_s=60.0) or 0
    if not sup.capacity:
        refuse(sup, CAPACITY, f"no job at {a.master} says how large it may grow (launch machine 0 of the job with "
               f"--max-nnodes {a.node_rank + 1} or more)")
        return CAPACITY
    # until it is handed a rank, a process sets up as the rank it will most likely be: the next after the job's now
    live = sum(len(membership.node_ranks(sup.store, sup.restarts, n)) for n in machines(sup))
    world = live + a.nproc_per_node
    workers = [sup.spawn(None, i, extra_env={SETUP_ENV: "early", "RANK": str(live + i), "LOCAL_RANK": str(i),
                                             "WORLD_SIZE": str(world)}) for i in range(a.nproc_per_node)]
    sup.offered = [w.spare for w in workers]
    set_key(sup.store, f"{sup.restarts}/join/{a.node_rank}", [w.spare for w in workers])
    emit("join_offered", node=a.node_rank, spares=[w.spare for w in workers], pids=[w.process.pid for w in workers],
         message=f"machine {a.node_rank} offers {len(workers)} rank(s) to the running job: they set up, then join it "
                 "at a commit")
    return None


def refuse(sup: Supervisor, why: str, reason: str, node: int | None = None) -> str:
    """Says why machine ``node`` (default: this one, which then leaves the job) does not join, once; returns ``why``.
    Machine 0 also tells machine ``node`` in the store."""
    node = sup.args.node_rank if node is None else node
    emit("join_refused", node=node, why=why, reason=reason, message=f"machine {node} does not join the job: {reason}")
    with contextlib.suppress(RuntimeError):  # (the store may be gone: then nobody waits for the word)
        if node != sup.args.node_rank:
            set_key(sup.store, f"{sup.restarts}/join_refused/{node}", [why, reason])
        else:  # this machine leaves: machine 0 does not wait for it at the end (nor takes its silence for a loss)
            membership.mark_done(sup.store, sup.restarts, node)
    return why


def taken(sup: Supervisor) -> str | None:
    """On machine K, from its loop: its offered processes that were handed ranks become its ranks. Why it leaves
    before they joined (a ``join_refused`` ``why``), or ``None``."""
    pending = [w for w in sup.workers if w.rank is None and w.spare in sup.offered]
    store, launch = sup.store, sup.restarts
    if not pending:  # joined (or not a joining machine): it leaves only when the job restarts every worker
        with contextlib.suppress(RuntimeError):  # (the store gone: machine 0 ended, this machine's ranks end too)
            if joining_machine(sup) and current_launch(store) != launch:
                return refuse(sup, JOB_ENDED, "the job restarted every worker at its launch size: this machine's ranks "
                              "left it; start this launcher again to join the new run")
        return None
    try:
        refused = f"{launch}/join_refused/{sup.args.node_rank}"
        if has_key(store, refused):
            return refuse(sup, *json.loads(get_key(store, refused)))
        if membership.is_done(store, launch, 0) or current_launch(store) != launch:
            return refuse(sup, JOB_ENDED, "the job finished, or restarted every worker at its launch size, before "
                          "this machine's ranks joined it: start this launcher again to join the new run")
        if dead := [w.process.pid for w in pending if w.process.poll() is not None]:
            return refuse(sup, DIED, f"its processes {dead} that were to join ended before they joined")
        for worker in pending:
            key = f"{launch}/assign/{worker.spare}"
            if has_key(store, key):
                assignment = json.loads(get_key(store, key))
                worker.rank, generation = assignment["rank"], assignment["generation"]
                membership.publish_worker(store, launch, worker.rank, socket.gethostname(), worker.process.pid)
    except RuntimeError as err:  # machine 0 and its store are gone
        return refuse(sup, JOB_ENDED, f"the job's store on machine 0 is gone ({err})")
    if all(w.rank is not None for w in pending):
        sup.offered = []
        sup.live_world = max(w.rank for w in sup.workers if w.rank is not None) + 1
        sup._owed, sup._gate = sup.args.spares, generation  # hot spares, once the grown job committed a step
        sup.publish_ranks()
    return None


def admit(sup: Supervisor, recovering: int | None) -> int | None:
    """On machine 0, from its loop: publishes the grow plan of a machine whose offered processes all wait, once no
    recovery runs; returns the plan's generation (a recovery in progress), else ``None``."""
    if recovering is not None or sup._finished:
        return None
    store, launch = sup.store, sup.restarts
    for node in range(sup.args.nnodes, sup.args.max_nnodes):
        key = f"{launch}/join/{node}"
        if node in sup.joined or not has_key(store, key):
            continue
        spares: list[int] = json.loads(get_key(store, key))
        if not all(membership.is_waiting(store, launch, s) for s in spares):
            continue
        sup.joined.add(node)
        room = capacity(sup)  # (what this launcher published: no need to read it back from the store)
        if sup.live_world + len(spares) > room:
            refuse(sup, CAPACITY, f"the job runs {sup.live_world} ranks and its world group has room for {room}: "
                   f"{len(spares)} more do not fit (launch every machine with a larger --max-nnodes)", node)
            continue
        first = sup.live_world
        joining = {first + i: spare for i, spare in enumerate(spares)}
        plan = membership.publish_grow_plan(store, launch, sup.live_world, joining,
                                            {rank: i for i, rank in enumerate(joining)}, len(spares))
        sup.live_world = plan.world_size
        emit("grow_planned", generation=plan.generation, joined_ranks=sorted(joining), world_size=plan.world_size,
             pids={}, node=node, message=f"generation {plan.generation}: machine {node}'s ranks {sorted(joining)} "
             f"join at the next commit (the job grows to {plan.world_size} ranks)")
        return plan.generation
    return None


def from_another_machine(store: Store, launch: int, plan: membership.Plan) -> bool:
    """On a running rank, for a grow ``plan``: whether its ranks join from a machine that joins the job (their
    assignments give their machine's rank count), not from this machine's launcher."""
    spare = next(iter(plan.replacements.values()))
    return json.loads(get_key(store, f"{launch}/assign/{spare}")).get("local_world_size") is not None


def room_env(sup: Supervisor) -> dict[str, str]:
    """What the workers are told when machines may join (:data:`~lightning_dlrover.worker_env.JOIN_ENV`: the resource
    advisor names the command that adds one), else nothing."""
    a = sup.args
    if len(machines(sup)) <= a.nnodes:
        return {}
    room = {"max_nnodes": a.max_nnodes, "nproc_per_node": a.nproc_per_node, "master": a.master}
    return {worker_env.JOIN_ENV: json.dumps(room)}


def joining_machine(sup: Supervisor) -> bool:
    """Whether this launcher's machine joins a running job (``--node-rank`` at or past ``--nnodes``)."""
    return sup.args.node_rank >= sup.args.nnodes


def machines(sup: Supervisor) -> range:
    """Every machine index the job may have: its launch's and those that may join."""
    return range(max(sup.args.max_nnodes, sup.args.nnodes))

