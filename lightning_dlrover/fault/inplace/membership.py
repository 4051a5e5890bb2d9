"""Who is in the job: workers, hot spares and the recovery plans that replace lost ranks, kept in the
launcher's store so that no worker's death takes them with it.

Keys (all under ``lightning_dlrover/<launch>/``, ``<launch>`` counting the launcher's full restarts):

- ``spares``: count of spares that ever registered (their indices); ``spare/<i>``: the host of spare ``i``;
  ``waiting/<i>``: spare ``i`` waits for a rank (set up: hot).
  A launcher hands lost ranks to its own machine's spares.
- ``assign/<i>``: the :class:`Assignment` of spare ``i`` (JSON), written when it takes a lost rank;
  ``ready/<g>/<rank>``: the replacement is connecting generation ``g``; ``rank/<r>``: ``host:pid`` holding ``r``.
- ``generation``: the newest communicator generation; ``plan/<g>``: the :class:`Plan` that starts
  generation ``g`` (JSON), written by the launcher that saw the loss (or that resizes the job: then also
  ``resize/<g>``, which rank 0 of generation ``g - 1`` looks for at each commit). ``resize_asked/<g>``: the world size
  the ranks of generation ``g`` asked the launcher to shrink or grow to.
- ``device``: the device type of the job's ranks when it is not the CPU (``"cuda"``), written by the ranks; a
  launcher then hands a lost rank to a spare only where the rank's device slot is free (:mod:`.supervisor`).
- ``committed/<g>``: the first step the ranks committed in generation ``g`` (written once per generation by each
  rank): a launcher starts its hot spares only then, so that ranks start (and recover) without competing with them.
- ``node/<n>/beats``: machine ``n``'s launcher's heartbeat counter; ``node/<n>/ranks``: the ranks it holds
  (JSON); ``node/<n>/done``: its ranks finished. The launcher on machine 0 (the store's host) declares a
  machine lost when its counter stops and replaces its ranks with its own spares.

Survivors that see a collective fail wait for ``plan/<g + 1>``; a spare waits for its ``assign/<i>``; both
then build generation ``g + 1`` of the world group (:mod:`lightning_dlrover.fault.inplace.process_group`).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

from torch.distributed import Store, TCPStore

from lightning_dlrover import worker_env
from lightning_dlrover.fault.inplace.store import PREFIX, get_key, has_key, set_key

#: ``host:port`` of the launcher's store; set by ``lightning-dlrover launch`` (in-process recovery on).
STORE_ENV = "LIGHTNING_DLROVER_STORE"
#: Set on hot-spare processes (their index in the launcher's spare pool is assigned on registration).
SPARE_ENV = "LIGHTNING_DLROVER_SPARE"
#: Set by :func:`become` on a spare that took a rank: it is joining generation ``$LIGHTNING_DLROVER_GENERATION``.
JOINING_ENV = "LIGHTNING_DLROVER_JOINING"
GENERATION_ENV = "LIGHTNING_DLROVER_GENERATION"
#: Seconds a survivor waits for the launcher's recovery plan after a collective failed (default 10).
PLAN_TIMEOUT_ENV = "LIGHTNING_DLROVER_PLAN_TIMEOUT"
#: Seconds survivors wait for the replacements to start their process group (a cold start imports everything;
#: default 600).
REPLACEMENT_TIMEOUT_ENV = "LIGHTNING_DLROVER_REPLACEMENT_TIMEOUT"
#: Seconds the ranks of a launch wait for each other to start their process group (default 600): every rank
#: imports torch, Lightning and TorchRec first, which on a loaded machine can take minutes.
START_TIMEOUT_ENV = "LIGHTNING_DLROVER_START_TIMEOUT"


@dataclass(frozen=True)
class Plan:
    """The recovery that starts communicator ``generation``: ranks ``lost`` and the spare taking each one
    (``replacements[rank] = spare index``); ``reported_at`` is the launcher's clock when it saw the loss.
    ``world_size``: the world size of the new generation when it shrinks (no replacement: the survivors go on
    without ``lost``, renumbered by :func:`~lightning_dlrover.fault.restart.renumber.survivor_ranks`), else ``None``."""

    generation: int
    lost: list[int]
    replacements: dict[int, int]
    reported_at: float
    world_size: int | None = None
    refused: str | None = None  # why the launcher refused this shrink (a ``shrink_refused`` ``why``): no one goes on
    grow: bool = False  # the live ranks keep their numbers and ``replacements`` join them at ``world_size`` ranks
    asked: bool = False  # a shrink the job asked for (:func:`ask_to_resize`): the ``lost`` ranks are alive and leave

    @property
    def covered(self) -> bool:
        """Whether every lost rank has a replacement."""
        return all(rank in self.replacements for rank in self.lost)

    @property
    def shrinks(self) -> bool:
        """Whether the survivors go on at a smaller world size without replacements."""
        return self.world_size is not None and not self.grow


@dataclass(frozen=True)
class Assignment:
    """What a spare becomes: ``rank`` of ``world_size`` in communicator ``generation``, on device slot ``local_rank``
    of its machine (``LOCAL_RANK``; ``None``: ``rank % LOCAL_WORLD_SIZE``)."""

    rank: int
    world_size: int
    generation: int
    assigned_at: float
    local_rank: int | None = None
    local_world_size: int | None = None  # the ranks on its machine (a machine that joins: its own count)


def enabled() -> bool:
    """Whether this process runs under ``lightning-dlrover launch`` with in-process recovery."""
    return bool(os.environ.get(STORE_ENV))


def is_joining() -> bool:
    """Whether this process is a spare that was handed a lost rank and has not joined yet."""
    return os.environ.get(JOINING_ENV) == "1"


def become(assignment: Assignment) -> None:
    """Makes this spare process the worker ``assignment`` names (the environment Lightning and
    ``init_process_group`` read), joining at generation ``assignment.generation``."""
    local = assignment.local_world_size or worker_env.local_world_size()
    if local == int(os.environ.get("WORLD_SIZE", "0")) and not assignment.local_world_size:  # one machine: its ranks
        local = assignment.world_size  # are the world's (a grow may pass it)
    local_rank = assignment.rank % local if assignment.local_rank is None else assignment.local_rank
    os.environ.update(RANK=str(assignment.rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(assignment.world_size),
                      LOCAL_WORLD_SIZE=str(local), **{JOINING_ENV: "1", GENERATION_ENV: str(assignment.generation)})


def joined() -> None:
    """The join protocol finished: this process is an ordinary worker from now on."""
    os.environ.pop(JOINING_ENV, None)


def connect(address: str | None = None, timeout: float = 60.0) -> TCPStore:
    """A client of the launcher's store at ``address`` (``host:port``; default ``$LIGHTNING_DLROVER_STORE``)."""
    address = address or os.environ.get(STORE_ENV)
    if not address:
        raise RuntimeError(f"${STORE_ENV} is not set: in-process recovery needs `lightning-dlrover launch`.")
    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def wait_for_ranks(store: Store, launch: int, rank: int, world_size: int, timeout: float | None = None) -> None:
    """Marks ``rank`` of launch ``launch`` started in ``store`` (a process group's own) and waits until every one
    of the ``world_size`` ranks is (:func:`meet`)."""
    meet(store, f"dlrover_started/{launch}", rank, world_size, timeout, "start their process group",
         "(each imports torch, Lightning and TorchRec first, which a loaded machine slows down)")


def meet(store: Store, prefix: str, rank: int, world_size: int, timeout: float | None, what: str,
         why_slow: str = "") -> None:
    """Marks ``rank`` at ``prefix`` in ``store`` and waits until all ``world_size`` ranks are, up to ``timeout`` seconds
    (default ``$LIGHTNING_DLROVER_START_TIMEOUT``, 600); raises ``RuntimeError`` naming the ranks that did not
    ``what`` in time."""
    timeout = timeout if timeout is not None else float(os.environ.get(START_TIMEOUT_ENV, "600"))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.set(keys[rank], str(os.getpid()))
    started = time.monotonic()
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as err:  # noqa: BLE001 - the store raises on timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(
            f"rank {rank}: ranks {missing} of {world_size} did not {what} within {time.monotonic() - started:.0f} s"
            f"{' ' + why_slow if why_slow else ''}. Look at those ranks' output; if they were only slow, raise "
            f"${START_TIMEOUT_ENV} (now {timeout:.0f} s)."
        ) from err


# ------------------------------------------------------------------------------------------ spares
def register_spare(store: Store, launch: int) -> int:
    """Adds a spare to launch ``launch``'s pool (called by the launcher that starts it); returns its index."""
    index = int(store.add(PREFIX + f"{launch}/spares", 1)) - 1
    set_key(store, f"{launch}/spare/{index}", socket.gethostname())
    return index


def wait_for_assignment(store: Store, launch: int, index: int, *, wait_s: float = 600.0,
                        give_up_s: float = 300.0) -> Assignment:
    """Blocks until spare ``index`` of launch ``launch`` is handed a rank (as long as the job runs).

    Raises ``ConnectionError`` once the store has failed (not timed out) for ``give_up_s`` seconds: the
    launcher that holds it is gone, and so is the job this spare was waiting for."""
    key = PREFIX + f"{launch}/assign/{index}"
    store.add(PREFIX + f"{launch}/waiting/{index}", 1)
    store.add(PREFIX + f"{launch}/spares_waiting", 1)
    failing_since: float | None = None
    while True:  # blocked in the store's socket: a waiting spare uses no CPU (each timeout logs one line in C++)
        started = time.monotonic()
        try:
            store.wait([key], timedelta(seconds=wait_s))
            break
        except Exception as error:  # noqa: BLE001 - a timeout (keep waiting: the job may run for days) or a dead store
            now = time.monotonic()
            if now - started >= 0.9 * wait_s:  # the store's own timeout
                failing_since = None
                continue
            # The store answered with an error at once (its host is gone): retry slowly, not in a busy loop.
            failing_since = now if failing_since is None else failing_since
            if now - failing_since >= give_up_s:
                raise ConnectionError(f"spare {index}: the launcher's store has failed for {now - failing_since:.0f} s "
                                      f"({error}); the job it waited for is gone") from error
            time.sleep(min(5.0, 0.5 + (now - failing_since) / 10))
    return Assignment(**json.loads(store.get(key)))


def spares_waiting(store: Store, launch: int) -> int:
    """How many spares of launch ``launch`` ever reached their wait for a rank (imported, set up: hot)."""
    return int(store.add(PREFIX + f"{launch}/spares_waiting", 0))


def is_waiting(store: Store, launch: int, index: int) -> bool:
    """Whether spare ``index`` of launch ``launch`` reached its wait for a rank (its program set up: hot)."""
    return has_key(store, f"{launch}/waiting/{index}")


def publish_committed(store: Store, launch: int, generation: int, step: int) -> None:
    """A rank committed ``step``, its first in ``generation`` of launch ``launch`` (each rank says it once)."""
    set_key(store, f"{launch}/committed/{generation}", str(step))


def committed(store: Store, launch: int, generation: int) -> int | None:
    """The first step committed in ``generation`` of launch ``launch``, ``None`` while none is."""
    key = f"{launch}/committed/{generation}"
    return int(get_key(store, key)) if has_key(store, key) else None


# ----------------------------------------------------------------------------------- recovery plans
def publish_plan(store: Store, launch: int, lost: list[int], world_size: int, spares: dict[int, int],
                 local_ranks: dict[int, int] | None = None) -> Plan:
    """Starts a new generation of launch ``launch`` that replaces ``lost`` by ``spares`` (``rank -> spare
    index``; ``local_ranks``: the device slot each takes, default ``rank % LOCAL_WORLD_SIZE``), assigns the spares
    and publishes the plan for the survivors."""
    generation = int(store.add(PREFIX + f"{launch}/generation", 1))
    now = time.time()
    for rank, spare in spares.items():
        slot = (local_ranks or {}).get(rank)
        set_key(store, f"{launch}/assign/{spare}", asdict(Assignment(rank, world_size, generation, now, slot)))
    plan = Plan(generation, sorted(lost), dict(spares), now)
    set_key(store, f"{launch}/plan/{generation}", {**asdict(plan), "replacements": {str(k): v for k, v in spares.items()}})
    return plan


def publish_shrink_plan(store: Store, launch: int, lost: list[int], world_size: int, refused: str | None = None,
                        asked: bool = False) -> Plan:
    """Starts a new generation of launch ``launch`` in which the survivors of a world of ``world_size`` go on without
    ``lost`` (no spare takes them) and publishes the plan for the survivors; ``refused``: the launcher refused the
    shrink for that reason, and the survivors leave for the restart path instead. ``asked``: the job asked for it
    (:func:`ask_to_resize`): the ``lost`` ranks retire, and the ranks run the plan at their next commit
    (:func:`resize_requested`)."""
    generation = int(store.add(PREFIX + f"{launch}/generation", 1))
    plan = Plan(generation, sorted(lost), {}, time.time(), world_size - len(set(lost)), refused, asked=asked)
    set_key(store, f"{launch}/plan/{generation}", {**asdict(plan), "replacements": {}})
    if asked:
        set_key(store, f"{launch}/resize/{generation}", str(plan.world_size))
    return plan


def ask_to_resize(store: Store, launch: int, generation: int, world_size: int) -> None:
    """Rank 0 of ``generation`` asks the launcher to shrink or grow the job to ``world_size`` ranks (:mod:`.retire`)."""
    set_key(store, f"{launch}/resize_asked/{generation}", str(world_size))


def resize_asked(store: Store, launch: int) -> tuple[int, int] | None:
    """On the launcher: ``(generation, world size)`` when the ranks of the current generation asked to shrink or grow
    (:func:`ask_to_resize`), else ``None`` (two look-ups)."""
    generation = int(store.add(PREFIX + f"{launch}/generation", 0))
    key = f"{launch}/resize_asked/{generation}"
    return (generation, int(get_key(store, key))) if has_key(store, key) else None


def publish_grow_plan(store: Store, launch: int, world_size: int, spares: dict[int, int],
                      local_ranks: dict[int, int] | None = None, local_world_size: int | None = None) -> Plan:
    """Starts a new generation of launch ``launch`` in which ``spares`` (``new rank -> spare index``) join the ranks
    of a world of ``world_size`` (who keep their numbers; a new rank's device slot: ``local_ranks[rank]`` on a machine
    of ``local_world_size`` ranks that joins, else its number), assigns the spares, publishes the plan and asks the
    ranks to grow at their next commit (:func:`resize_requested`)."""
    generation = int(store.add(PREFIX + f"{launch}/generation", 1))
    now, grown = time.time(), world_size + len(spares)
    for rank, spare in spares.items():
        slot = (local_ranks or {}).get(rank, rank)
        set_key(store, f"{launch}/assign/{spare}", asdict(Assignment(rank, grown, generation, now, slot, local_world_size)))
    plan = Plan(generation, [], dict(spares), now, grown, grow=True)
    set_key(store, f"{launch}/plan/{generation}", {**asdict(plan), "replacements": {str(k): v for k, v in spares.items()}})
    set_key(store, f"{launch}/resize/{generation}", str(grown))
    return plan


def resize_requested(store: Store, launch: int, generation: int) -> bool:
    """Whether the launcher published a plan that resizes the ranks of ``generation`` (a grow, or a shrink they asked
    for) for them to run at their next commit (one look-up, made by rank 0 at each commit)."""
    return has_key(store, f"{launch}/resize/{generation + 1}")


def wait_for_plan(store: Store, launch: int, generation: int, timeout: float | None = None) -> Plan | None:
    """The plan that starts ``generation`` of launch ``launch``, or ``None`` if the launcher published none
    within ``timeout`` seconds."""
    timeout = timeout if timeout is not None else float(os.environ.get(PLAN_TIMEOUT_ENV, "10"))
    key = PREFIX + f"{launch}/plan/{generation}"
    try:
        store.wait([key], timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - the store raises on timeout
        return None
    raw = json.loads(store.get(key))
    raw["replacements"] = {int(k): v for k, v in raw["replacements"].items()}
    return Plan(**raw)


# ------------------------------------------------------------------------------------------ devices
def publish_device(store: Store, launch: int, device_type: str) -> None:
    """The job's ranks run on ``device_type`` (written by the ranks when it is not the CPU)."""
    set_key(store, f"{launch}/device", device_type)


def job_device(store: Store, launch: int) -> str:
    """The device type the job's ranks said they run on; ``"cpu"`` when none said (CPU ranks say nothing)."""
    return get_key(store, f"{launch}/device") if has_key(store, f"{launch}/device") else "cpu"


# ------------------------------------------------------------------------------------- sharding plan
def publish_sharding_plan(store: Store, launch: int, plan: object) -> None:
    """Keeps the job's sharding plan for replacements (which must not run the planner's collective)."""
    store.set(PREFIX + f"{launch}/sharding_plan", pickle.dumps(plan))


def read_sharding_plan(store: Store, launch: int) -> object:
    """The sharding plan rank 0 published for this launch (the job's own store: trusted like its rendezvous)."""
    return pickle.loads(store.get(PREFIX + f"{launch}/sharding_plan"))  # noqa: S301


# ------------------------------------------------------------------------------------ replacements
def announce_ready(store: Store, launch: int, assignment: Assignment) -> None:
    """A replacement is about to connect generation ``assignment.generation`` of the world group."""
    set_key(store, f"{launch}/ready/{assignment.generation}/{assignment.rank}", str(os.getpid()))


def wait_for_replacements(store: Store, launch: int, plan: Plan, timeout: float | None = None) -> bool:
    """Whether every replacement of ``plan`` announced itself within ``timeout`` seconds."""
    timeout = timeout if timeout is not None else float(os.environ.get(REPLACEMENT_TIMEOUT_ENV, "600"))
    joining = sorted(plan.replacements) if plan.grow else plan.lost
    keys = [PREFIX + f"{launch}/ready/{plan.generation}/{rank}" for rank in joining]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - the store raises on timeout
        return False
    return True


def wait_for_fellow_replacements(launch: int, generation: int) -> None:
    """On a replacement about to connect ``generation``: waits until every replacement of that generation's plan
    announced itself (a hot spare would otherwise wait for a cold one, still importing, only the collective
    timeout). Raises ``RuntimeError`` after ``$LIGHTNING_DLROVER_REPLACEMENT_TIMEOUT`` seconds."""
    store = connect()
    timeout = float(os.environ.get(REPLACEMENT_TIMEOUT_ENV, "600"))
    plan = wait_for_plan(store, launch, generation, timeout=timeout)
    if plan is None or not wait_for_replacements(store, launch, plan, timeout=timeout):
        raise RuntimeError(f"generation {generation}: the other replacements did not start within {timeout:.0f} s "
                           f"(${REPLACEMENT_TIMEOUT_ENV}); look at the launcher's output for why.")


# ------------------------------------------------------------------------------------------ workers
def publish_worker(store: Store, launch: int, rank: int, host: str, pid: int) -> None:
    """Records which process holds ``rank`` (drills and operators read it)."""
    set_key(store, f"{launch}/rank/{rank}", f"{host}:{pid}")


def worker(store: Store, launch: int, rank: int) -> tuple[str, int]:
    """``(host, pid)`` of the process holding ``rank`` in launch ``launch``."""
    host, _, pid = get_key(store, f"{launch}/rank/{rank}").rpartition(":")
    return host, int(pid)


def report_restored(store: Store, launch: int, generation: int) -> None:
    """This rank finished the recovery that started ``generation``."""
    store.add(PREFIX + f"{launch}/restored/{generation}", 1)


def restored_ranks(store: Store, launch: int, generation: int) -> int:
    """How many ranks finished the recovery that started ``generation``."""
    return int(store.add(PREFIX + f"{launch}/restored/{generation}", 0))


# ------------------------------------------------------------------------------------------ machines
def heartbeat(store: Store, launch: int, node: int) -> int:
    """Machine ``node``'s launcher is alive; returns its beat count (counters need no synchronised clocks)."""
    return int(store.add(PREFIX + f"{launch}/node/{node}/beats", 1))


def beats(store: Store, launch: int, node: int) -> int:
    """How often machine ``node``'s launcher has beaten (0: not started yet)."""
    return int(store.add(PREFIX + f"{launch}/node/{node}/beats", 0))


def publish_node_ranks(store: Store, launch: int, node: int, ranks: list[int]) -> None:
    """The ranks machine ``node``'s launcher holds now."""
    set_key(store, f"{launch}/node/{node}/ranks", sorted(ranks))


def node_ranks(store: Store, launch: int, node: int) -> list[int]:
    """The ranks machine ``node`` held when it last said (``[]`` if it never did)."""
    key = f"{launch}/node/{node}/ranks"
    return json.loads(get_key(store, key)) if has_key(store, key) else []


def mark_done(store: Store, launch: int, node: int) -> None:
    """Machine ``node``'s ranks all finished: its silence from now on is not a loss."""
    set_key(store, f"{launch}/node/{node}/done", "1")


def is_done(store: Store, launch: int, node: int) -> bool:
    return has_key(store, f"{launch}/node/{node}/done")
