"""Structured events of a job, as JSON lines: what the fault manager, the fault injector and the digest did.

Tools (``lightning-dlrover chaos``, ``bench/``) and people read these records, never the log prose. Every
rank appends its events to one file (``O_APPEND`` writes of one line are atomic on a local file system):
``$LIGHTNING_DLROVER_EVENTS`` when set, else the file :func:`configure` named (the strategy names
``<default_root_dir>/dlrover_events.jsonl``).

Schema (version 1), one JSON object per line::

    {"schema": 1, "kind": "restored", "time": 1763820000.123, "rank": 0, "pid": 4242, "step": 12, ...}

``kind`` is one of :data:`KINDS`; ``time`` is Unix time in seconds; ``rank`` the global rank (-1 outside a
process group); ``step`` the committed step it concerns (``trainer.global_step``), or null. The other
fields of each kind are listed in :data:`KINDS`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_dlrover.log import get_logger

log = get_logger(__name__)

#: Environment variable naming the events file (it wins over :func:`configure`).
EVENTS_ENV = "LIGHTNING_DLROVER_EVENTS"
#: Environment variable: print and record the state digest every N committed steps (and at the start), for drills
#: (read by :class:`~lightning_dlrover.strategy.DLRoverStrategy`).
DIGEST_EVERY_ENV = "LIGHTNING_DLROVER_DIGEST_EVERY"
SCHEMA = 1
#: Event kinds and their extra fields.
KINDS: dict[str, tuple[str, ...]] = {
    "fault_injected": ("phase", "target", "signal", "committed_step"),  # step: index of the step in flight
    # a rank stopped on a failure; step: the committed step it spilled; tentative_step: the step it also spilled
    # as tentative (its vote on it broke, see fault.spill.Spill.tentative), else None
    "stopped": ("reason", "spill", "spill_s", "tentative_step"),
    "stale_spills_refused": ("paths", "why"),
    "restored": ("old_world_size", "world_size", "lost_ranks", "decode_s", "reshard_s"),  # from survivors' spills
    # after "restored": the new job's parity; kept_parity: the survivors' spilled parity was kept (same layout);
    # verified: it equals a fresh encode (checked under $LIGHTNING_DLROVER_VERIFY_PARITY=1), None: not checked
    "parity_encoded": ("encode_s", "kept_parity", "encoded_ranks", "verified"),
    "fallback": ("why", "checkpoint", "failed_step", "steps_lost", "load_s"),  # checkpoint None: from step 0
    "resumed": (),  # the first step committed after a restore or fallback
    # parity: auto's pick (parity None: checkpoints only); source "planned", or "recorded": a restarted incarnation or
    # a replacement reuses the plan its run recorded (the spills it decodes were written with it)
    "parity_planned": ("world_size", "parity", "mtbf_hours", "source", "measured"),  # measured: history costs used
    "costs_measured": ("job_key", "costs"),  # parity: auto timed the job's steps and recorded them in the job history
    # parity: auto's checkpoint interval (Young/Daly at the blocked time per save of save_mode): applied to each
    # ModelCheckpoint given no interval; why: none applied (no ModelCheckpoint, the user's interval, none needed)
    "checkpoint_interval_planned": ("every_n_train_steps", "every_s", "save_mode", "save_s", "save_lag_s", "applied",
                                    "why", "source"),
    "digest": ("digest", "final"),
    # In-process recovery (lightning-dlrover launch): the launcher's plan, each rank's recovery, the fallbacks
    # cold: the lost ranks no spare was left for (a process started at the loss); readiness: {rank: how far its
    # replacement had got}: "waiting" (a spare set up, waiting for a rank: hot), "forked" (forked from the launcher's
    # warm zygote: libraries imported, its program still setting up), "importing" (a fresh interpreter, still starting)
    "replacement_planned": ("generation", "lost_ranks", "replacements", "cold", "readiness"),
    "rank_started_again": ("ranks",),  # lost before their process group (the others wait for them): started again
    # a launcher started hot spares (spare indices, their pids) after generation's first committed step (step), at
    # "idle" (SCHED_IDLE) or "normal" CPU priority (the message says why once); forked: from the warm zygote
    "spares_started": ("spares", "pids", "generation", "priority", "forked"),
    # the launcher's zygote (fault/inplace/zygote.py) imported `preloaded` (`failed`: {module: error}) in import_s
    "zygote_ready": ("zygote_pid", "import_s", "preloaded", "failed"),
    "zygote_lost": ("why",),  # the zygote cannot fork any more: later workers start as fresh interpreters
    # a hot spare waits for a rank to take: one forked from the zygote right after the fork, before its program runs
    # (it sets up once it holds a rank); one started as a fresh interpreter after its imports and program set-up
    "spare_ready": ("spare",),
    # a replacement that was a hot spare, once it joined: the memory it faulted in while it waited (reserved_bytes,
    # in prepare_s), what of it its tables and parity share took (taken_bytes) and what did not fit (refused_bytes)
    "reserve_used": ("reserved_bytes", "prepare_s", "taken_bytes", "refused_bytes"),
    "recovered_in_process": ("survivor", "lost_ranks", "decode_s", "reshard_s", "lost_at", "failed_at",
                             "connected_at", "restored_at"),  # every rank; times are Unix seconds
    "in_process_refused": ("why", "error"),
    # survivors of a loss with no spare would go on at the smaller world but cannot (fault/inplace/shrink.py): why is
    # below_parity (fewer than k + r survivors) | would_not_fit (the advisor's memory forecast) | no_parity |
    # no_shrinker (the strategy cannot re-shard in process) | failed (half-way; the spills of the step are written) |
    # several_machines (a shrink the job asked for, fault/inplace/retire.py: one-machine jobs only)
    "shrink_refused": ("why", "world_size", "lost_ranks"),
    # the launcher: no spare for lost_ranks and none to start (launch --no-cold-start): the survivors shrink to
    # world_size; pids: {new rank: pid of the process that holds it (started before the loss)}
    "shrink_planned": ("generation", "lost_ranks", "world_size", "pids", "asked"),
    # a rank a shrink the job asked for retires (fault/inplace/retire.py): it leaves at the committed step
    "retired": ("generation", "world_size"),
    # every survivor of a shrink in process: its old rank, the world sizes; times are Unix seconds (as for
    # recovered_in_process); decode_s, reshard_s: the restore's decode and re-shard
    "shrunk_in_process": ("old_rank", "old_world_size", "world_size", "lost_ranks", "decode_s", "reshard_s",
                          "lost_at", "failed_at", "connected_at", "restored_at"),
    # launch --regrow (fault/inplace/grow.py), the launcher: started a process (spare index, spare_pid) to join a job
    # running at world_size of target_world_size ranks; published the plan in which joined_ranks join (the job grows
    # to world_size; pids: {joined rank: pid}); gave the grow up (why: gave_up or would_not_fit; reason: for people)
    "grow_started": ("spare", "spare_pid", "world_size", "target_world_size", "asked"),
    "grow_planned": ("generation", "joined_ranks", "world_size", "pids", "node"),
    "grow_abandoned": ("why", "reason"),
    # launch --node-rank K past --nnodes (fault/inplace/join.py): machine K offered its processes (spare indices,
    # pids) to the running job; machine K does not join (why: capacity, job_ended or died; reason: for people), said
    # by machine 0 or K; grow_planned's node: the machine whose ranks join (absent: this machine's)
    "join_offered": ("node", "spares", "pids"),
    "join_refused": ("node", "why", "reason"),
    # every rank of a grow in process (survivor: it was running; else it joined), at the committed step it resumes at;
    # times as for recovered_in_process; grow_failed: a running rank's grow failed half-way (spills written, restart)
    "grown_in_process": ("survivor", "old_world_size", "world_size", "joined_ranks", "decode_s", "reshard_s",
                         "lost_at", "failed_at", "connected_at", "restored_at"),
    "grow_failed": ("generation", "error"),
    # every rank after the tables were planned and sharded anew in process at the same world size (the advisor's
    # re-plan; sharding: the new plan in words); reshard_failed: half-way (spills written, restart)
    "resharded_in_process": ("world_size", "sharding", "decode_s", "reshard_s", "failed_at", "restored_at"),
    "reshard_failed": ("error",),
    # rank 0, when the pooled embeddings' key order differs from the one the state was trained with (before, after:
    # {collection path: keys}; how: a re-shard in process, a checkpoint or a restart's restore): a model reading
    # KeyedTensor.values() by position sees its features permuted
    "feature_order_changed": ("before", "after", "how"),
    # every rank of a re-plan asked to keep that order (the advisor's): the new plan (after) would have moved it, and
    # the tables stay where they were
    "replan_refused": ("before", "after"),
    # $LIGHTNING_DLROVER_VERIFY_RESIZE=1, rank 0 after a grow or re-shard: the whole training state's digest before and
    # after
    "resize_verified": ("world_size", "before", "after", "equal"),
    "vote_completed_elsewhere": (),  # a survivor whose vote broke commits the step (step) another survivor committed
    "node_lost": ("node", "ranks", "silent_s"),  # machine 0's launcher: another machine's launcher went silent
    # reason: no_survivor | during_recovery | in_process_off | device_taken (a replacement would share a GPU)
    "restarting_all": ("restarts", "failed_ranks", "reason"),
    # ResourceAdvisor (step: the global step it was decided at)
    "advice": ("stage", "current", "recommended", "predicted_gain", "applied", "restart", "elapsed_s"),
    "restart": ("how", "pending", "current", "recommended", "command", "config", "kubernetes", "launcher_honours",
                "stop_nodes", "checkpoint"),
    "advice_applied": ("stage", "knob", "old", "new", "via"),  # every rank, as it applies a live knob
    "advice_in_effect": ("stage", "knob", "value", "applied_step", "steps"),  # the change measured in the job
    "straggler": ("straggler_rank", "cause", "ratio", "excess_ms", "since_step"),
    "oom_forecast": ("node", "rss_bytes", "limit_bytes", "growth_bytes_per_step", "steps_to_oom", "seconds_to_oom",
                     "staging_bytes"),  # staging_bytes: memory for the next checkpoint save, counted as used
    "hot_rank": ("hot_rank", "share", "ratio", "tables"),
    # PipelineTuner (step: the global step of the decision)
    "pipeline_decision": ("tuner", "config", "samples_per_s", "wait_fraction", "memory_bytes", "budget_memory_bytes",
                          "next_config", "reason", "predicted_memory_bytes"),
    "pipeline_tuned": ("tuner", "start_config", "config", "kept_start", "start_samples_per_s", "samples_per_s", "gain",
                       "windows", "resets", "peak_memory_bytes", "budget_memory_bytes", "budget_cpus"),
    # The staged data loader dropped malformed lines (data.pipeline.on_error: skip), one event per file at the end of
    # each epoch and of fit (what the epoch's event did not cover): line and reason of the first, count of them all
    "data_skipped": ("file", "line", "reason", "count"),
    # rank 0 before its first step: training loaders without state_dict() (a recovery restores the model exactly but
    # these start their stream again, so the state after a recovery differs from a fault-free run's)
    "data_not_resumable": ("loaders",),
    # ElasticBatchScaler (step: the global step the change takes effect after)
    "batch_rescaled": ("reason", "policy", "rule", "old_world_size", "world_size", "old_global_batch", "global_batch",
                       "per_rank_batch", "lr_factor", "noise_scale", "predicted_gain"),
    # An add-on (monitor, advisor, tuner, scaler) failed and stepped back (monitor.guard); training went on. hook: the
    # hook, or the part that failed in an add-on that goes on (the advisor's "history", "report", "replan");
    # stepped_back_to: the safe state it is in now.
    "addon_failed": ("addon", "hook", "error_type", "error", "stepped_back_to"),
    # Asynchronous checkpoints (DLRoverStrategy(async_checkpoint=True)), every rank; step: the checkpoint's step.
    # staging: the bytes this rank copies per save (at the first save); saved: committed (blocked_s: training was
    # blocked, write_s: until the commit); waited: a save waited for the one in flight; failed: nothing was committed,
    # kept: the newest complete checkpoint (rank 0). Incremental saves (incremental_checkpoint_every): saved has link
    # (0: full, i: the i-th delta of its chain) and rows (this rank's rows in the delta); chain_broken: a resume found
    # a link of the chain missing and restored the newest complete prefix (used: its last link, step: its step).
    # Every committed save (blocking too) emits saved once with every field (None where it does not apply); a full
    # save with async_checkpoint="precopy" has mode "precopy", precopy_rows (rows the steps copied before writing
    # them) and precopy_hook_s (their time, counted in blocked_s)
    "checkpoint_staging": ("bytes",),
    "checkpoint_saved": ("path", "mode", "blocked_s", "write_s", "bytes", "link", "rows", "precopy_rows",
                         "precopy_hook_s"),
    "checkpoint_chain_broken": ("path", "missing_link", "used"),
    "checkpoint_waited": ("path", "previous", "waited_s"),
    "checkpoint_failed": ("path", "error_type", "error", "kept"),
}


@dataclass(frozen=True)
class Event:
    """One record of the events file (see the module docs)."""

    kind: str
    time: float
    rank: int
    step: int | None = None
    pid: int = 0
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


_configured: dict[str, Path | None] = {"path": None}


def configure(path: str | Path | None) -> None:
    """Sets the events file used when ``$LIGHTNING_DLROVER_EVENTS`` is unset (``None``: no file)."""
    _configured["path"] = Path(path) if path is not None else None


def events_path() -> Path | None:
    """Where :func:`emit` writes: ``$LIGHTNING_DLROVER_EVENTS``, else the configured file, else nowhere."""
    env = os.environ.get(EVENTS_ENV)
    return Path(env) if env else _configured["path"]


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
    except Exception:  # during interpreter shutdown
        return -1


def emit(kind: str, step: int | None = None, message: str | None = None, **fields: Any) -> Event:
    """Records an event; with ``message``, also logs ``lightning_dlrover: <message>`` (stderr, rank-prefixed) for people."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; known: {sorted(KINDS)}")
    unknown = set(fields) - set(KINDS[kind])
    if unknown:
        raise ValueError(f"event {kind!r} has no fields {sorted(unknown)}; its fields are {list(KINDS[kind])}")
    event = Event(kind, time.time(), _rank(), step, os.getpid(), fields)
    if message is not None:
        log.info(f"lightning_dlrover: {message}")
    path = events_path()
    if path is not None:
        line = json.dumps({"schema": SCHEMA, "kind": kind, "time": event.time, "rank": event.rank, "pid": event.pid,
                           "step": step, **fields}, default=str)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    return event


def read_events(paths: Iterable[str | Path]) -> list[Event]:
    """Every event in ``paths`` (missing files are skipped), in time order. Lines of another schema are refused."""
    events = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("schema") != SCHEMA:
                raise ValueError(f"{path}:{number}: event schema {record.get('schema')!r}, expected {SCHEMA}")
            base = {k: record.pop(k) for k in ("kind", "time", "rank", "step", "pid")}
            record.pop("schema")
            events.append(Event(base["kind"], base["time"], base["rank"], base["step"], base["pid"], record))
    return sorted(events, key=lambda e: e.time)
