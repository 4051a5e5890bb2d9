"""The report of a ``lightning-dlrover chaos`` drill, computed from the jobs' structured events (never from their
logs): recovered or not and how, detection and resume times, steps lost, and the digests against the fault-free run."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_dlrover.cli.chaos_kills import newest_digest
from lightning_dlrover.monitor.events import Event

#: How a job came back from a kill, by the event that says so.
RECOVERY_KINDS = {"recovered_in_process": "in process", "restored": "restart + decode", "fallback": "checkpoint",
                  "shrunk_in_process": "shrunk in process"}


def _digests(events: list[Event], after: float = 0.0) -> dict[int, str]:
    """``{step: digest}`` of the per-step digests recorded after time ``after`` (the first one of each step)."""
    found: dict[int, str] = {}
    for e in events:
        if e.kind == "digest" and not e["final"] and e.time >= after:
            found.setdefault(e.step, e["digest"])
    return found


def _describe_recovery(e: Event) -> str:
    if e.kind == "shrunk_in_process":
        return (f"yes, shrunk in process from {e['old_world_size']} to {e['world_size']} ranks (the survivors kept "
                f"training in their processes without ranks {e['lost_ranks']}; recovered step {e.step}; decode "
                f"{e['decode_s']:.3f} s, re-shard {e['reshard_s']:.3f} s)")
    if e.kind == "recovered_in_process":
        return (f"yes, in process (survivors kept training in their processes; ranks {e['lost_ranks']} replaced; "
                f"recovered step {e.step}; decode {e['decode_s']:.3f} s, re-shard {e['reshard_s']:.3f} s)")
    if e.kind == "restored":
        lost = f"decoded lost ranks {e['lost_ranks']}" if e["lost_ranks"] else "no rank lost"
        return (f"yes, from survivors' spills (recovered step {e.step} of a {e['old_world_size']}-rank job onto "
                f"{e['world_size']} ranks: {lost} (decode {e['decode_s']:.3f} s, re-shard {e['reshard_s']:.3f} s))")
    if e["checkpoint"] is None:
        return f"no checkpoint: started over from step 0 ({e['why']})"
    return f"from the last checkpoint ({e['why']} Resuming from {e['checkpoint']} at step {e.step})"


def summarize(args: argparse.Namespace, finished: bool, events: list[Event], reference: list[Event] | None,
              walls: tuple[float | None, float | None] = (None, None), landed: tuple[int, str] = (0, "")) -> list[str]:
    """The report's lines, computed from the jobs' events: recovered or not, detection time, time to resume,
    steps lost (the last committed step before the kill against the step the job resumed at), and whether the
    restored and final states equal the fault-free run's. ``walls``: the wall times of this run and of the
    fault-free one; ``landed``: the kills of a ``--kills`` drill that landed, and why not all."""
    if args.kills:
        return _drill_lines(drill_facts(args, finished, events, reference, walls, landed))
    injected = [e for e in events if e.kind == "fault_injected"]
    # a node's kill is recorded by each of its ranks: one kill per (step, phase) of a node target
    kills = len({(e.step, e["phase"]) if e["target"] == "node" else id(e) for e in injected})
    kill = injected[0] if injected else None
    after = kill.time if kill else 0.0
    in_process = [e for e in events if e.kind == "recovered_in_process" and e.time >= after]
    generations = sorted({e["lost_at"] for e in in_process if e["lost_at"] is not None})
    confirmed = _resumed_generations(events, in_process, generations)
    in_process = [e for e in in_process if generations and e["lost_at"] == generations[0]]  # the first kill's
    recoveries = [e for e in events if e.kind in ("restored", "fallback") and e.time >= after]
    shrunk = [e for e in events if e.kind == "shrunk_in_process" and e.time >= after]
    if shrunk and (not recoveries or shrunk[0].time < recoveries[0].time):
        recoveries = [min(shrunk, key=lambda e: e.rank)] + recoveries
    if in_process and (not recoveries or in_process[0].time < recoveries[0].time):  # the first kill's recovery first
        recoveries = [e for e in in_process if e.rank == min(x.rank for x in in_process)] + recoveries
    stopped = [e.time for e in events if e.kind == "stopped" and e.time >= after]
    stopped += [e["failed_at"] for e in in_process + shrunk if e["failed_at"] is not None]
    resumed = [e.time for e in events if e.kind == "resumed" and e.time >= after]
    finals = [e["digest"] for e in events if e.kind == "digest" and e["final"]]
    fault_free = ([e["digest"] for e in reference if e.kind == "digest" and e["final"]] or [None])[-1] if reference else None
    if args.reference_steps is not None:  # a shortened fault-free run: no final state to compare
        fault_free = None
    victim = "every rank" if args.kill_all else f"rank {args.kill_rank}" if args.in_process else f"node {args.kill_node}"
    unseeded = _unseeded(events, reference)
    lines = [
        f"nodes: {args.nodes} x {args.nproc_per_node} ranks; killed {victim} at step {args.at_step} ({args.phase}); "
        f"replacement: {'none (the survivors shrink in process)' if getattr(args, 'shrink', False) else f'a hot spare ({args.spares} per node)' if args.in_process and args.spares else 'started cold' if args.in_process else 'yes' if args.replace else 'no' if args.kill_all else 'no (shrink)'}"
        + (f", a node rejoins {args.rejoin_after} s after it resumed" if args.rejoin_after is not None else ""),
        f"node killed: {'yes' if kill is not None else 'no'}",
    ]
    lines += [f"recovered: {_describe_recovery(e)}" for e in recoveries] or ["recovered: no"]
    first = recoveries[0] if recoveries else None
    if first is not None:
        lines.append(f"resumed at step: {first.step}")
        expected = _digests(reference or []).get(first.step)
        restored = _digests(events, after=first.time).get(first.step)
        verdict = ("yes" if restored == expected else "no") if expected and restored else "no (cannot confirm: " + (
            "no fault-free run" if not reference else "no digest of that step") + ")"
        if unseeded:
            verdict = f"not comparable ({unseeded})"
        lines.append(f"restored state equals the fault-free state at step {first.step}: {verdict}")
    encoded = next((e for e in events if e.kind == "parity_encoded" and first is not None and e.time >= first.time), None)
    if encoded is not None:
        lines.append(f"parity after the restore: {'kept on the survivors, ' if encoded['kept_parity'] else ''}encoded for "
                     f"ranks {encoded['encoded_ranks']} in {encoded['encode_s']:.3f} s; equals a fresh encode: "
                     f"{'not checked' if encoded['verified'] is None else 'yes' if encoded['verified'] else 'no'}")
    if kill is not None and stopped:
        lines.append(f"detection: {min(stopped) - kill.time:.2f} s (kill to the first survivor stopping)")
    if kill is not None and in_process and stopped:
        joined = [e["connected_at"] for e in in_process if not e["survivor"]]
        if joined:
            lines.append(f"replacement ready: {max(joined) - min(stopped):.2f} s after detection (the spare took the "
                         "rank, set up its trainer and sharded its model)")
        lines.append(f"decode: {max(e['decode_s'] + e['reshard_s'] for e in in_process):.3f} s")
    if kill is not None and first is not None:
        what = ("replacement, communicator, decode" if in_process else "plan, communicator, re-shard, decode"
                if first.kind == "shrunk_in_process" else "restart, rendezvous, decode, re-shard")
        lines.append(f"state restored: {first.time - kill.time:.2f} s after the kill ({what})")
    if kill is not None and resumed:
        lines.append(f"time to resume: {resumed[0] - kill.time:.2f} s (kill to the first committed step after)")
    committed = committed_at(events, kill, first) if kill is not None else None
    lost = committed - first.step if first is not None and committed is not None else "unknown"
    lines.append(f"last committed step before the kill: {committed if committed is not None else 'unknown'}")
    lines.append(f"steps lost: {lost}")
    if kill is not None and first is not None and kill.step is not None:
        lines.append(f"steps trained again: {kill.step - first.step} (the step in flight and any since the last commit)")
    if kills > 1:
        restarts = sum(e.kind == "restarting_all" for e in events)
        lines.append(f"kills: {kills}; recovered in process: {confirmed}; full restarts: {restarts}")
    lines += _grow_lines(events)
    lines.append(f"job finished: {'yes' if finished else 'no'}")
    lines.append(f"final digest: {finals[-1] if finals else 'none'}")
    reference_name = "the restart path's shrink" if getattr(args, "shrink", False) else "fault-free"
    if fault_free is not None:
        lines.append(f"{reference_name} digest: {fault_free}")
    match = bool(finals) and fault_free is not None and finals[-1] == fault_free and finished
    why = "" if reference else " (no fault-free run to compare)"
    if reference and args.reference_steps is not None:
        why = f" (not compared: the fault-free run stopped at step {args.reference_steps}, --reference-steps)"
    if unseeded:
        why = f" ({unseeded})"
    elif not match and (data := _data_not_resumable(events)):
        why = f" ({data})"
    if getattr(args, "regrow", False) and not reference:
        why = " (--regrow: no reference run grows at the same step; the grow's state check is above)"
    lines.append(f"digest match: {'yes' if match else 'no'}{why}")
    return lines


def _grow_lines(events: list[Event]) -> list[str]:
    """What a grow in process did (``launch --regrow``): when, how long the new process took to be ready and the job
    paused, and whether the state across it was the same (``$LIGHTNING_DLROVER_VERIFY_RESIZE``)."""
    grown = [e for e in events if e.kind == "grown_in_process"]
    if not grown:
        gave_up = next((e for e in events if e.kind == "grow_abandoned"), None)
        return [f"grown in process: no ({gave_up['reason']})"] if gave_up is not None else []
    first, running = grown[0], [e for e in grown if e["survivor"]]
    lines = [f"grown in process: from {first['old_world_size']} to {first['world_size']} ranks at step {first.step} "
             f"(ranks {first['joined_ranks']} joined; the survivors kept their processes)"]
    started = next((e for e in events if e.kind == "grow_started"), None)
    planned = next((e for e in events if e.kind == "grow_planned"), None)
    if started is not None and planned is not None:
        lines.append(f"new process set up: {planned.time - started.time:.2f} s after it was started (training went on)")
    asked = [e["failed_at"] for e in running if e["failed_at"] is not None]
    if asked:
        lines.append(f"grow pause: {max(e['restored_at'] for e in grown) - min(asked):.2f} s (the step boundary to the "
                     "state restored at the larger size: plan, communicator, shard, re-shard)")
    verified = next((e for e in events if e.kind == "resize_verified"), None)
    lines.append("state after the grow equals the committed state before it: " + (
        "not checked" if verified is None else "yes" if verified["equal"] else "NO"))
    return lines


def _data_not_resumable(events: list[Event]) -> str:
    """Why a recovered run's final state can differ from the fault-free one's although the model was restored
    exactly: a training loader without ``state_dict`` started its stream again (the strategy's
    ``data_not_resumable`` event); empty when none did."""
    loaders = sorted({name for e in events if e.kind == "data_not_resumable" for name in e["loaders"]})
    if not loaders:
        return ""
    return (f"the training loader {', '.join(loaders)} has no state_dict(): a recovery restores the model and "
            "optimizers exactly, but this loader starts its stream again, so the data after it differ from the "
            "fault-free run's; return a torchdata StatefulDataLoader from train_dataloader() to make it exact")


def _unseeded(events: list[Event], reference: list[Event] | None) -> str:
    """Why the drill's states cannot be compared with the fault-free run's: they differ at the start already,
    before any fault (the job is not seeded); empty when they agree or there is nothing to compare."""
    ours, theirs = _digests(events), _digests(reference or [])
    start = min(set(ours) & set(theirs), default=None)
    if start is None or ours[start] == theirs[start]:
        return ""
    return (f"the two runs differ at step {start}, before any fault: the job is not seeded, so no run repeats another. "
            "Set seed_everything: <n> in the config (or call lightning.seed_everything(n, workers=True) in your "
            "script) to compare states")


def committed_at(events: list[Event], kill: Event, recovery: Event | None) -> int | None:
    """The job's last committed step when ``kill`` landed: the injector's record, else (a kill of chaos's runner,
    which cannot see commits) the recovery's own: the step the survivors rolled back to in process, the newest step
    the survivors spilled, the step a fallback's progress records reached; else the newest step digested before."""
    if kill["committed_step"] is not None:
        return kill["committed_step"]
    if recovery is not None and recovery.kind in ("recovered_in_process", "shrunk_in_process"):
        return recovery.step
    if recovery is not None and recovery.kind == "fallback" and recovery["failed_step"] is not None:
        return recovery["failed_step"]
    if recovery is not None and recovery.kind == "restored":
        spilled = [e.step for e in events if e.kind == "stopped" and kill.time <= e.time <= recovery.time]
        return max((s for s in spilled if s is not None), default=recovery.step)
    return newest_digest(events, kill.time)


def recoveries(events: list[Event]) -> list[Event]:
    """Each recovery of the job once, in time order: a restore from spills, a checkpoint fallback (or start-over),
    an in-process recovery (its lowest rank's event)."""
    found, seen = [], set()
    for e in events:
        if e.kind == "recovered_in_process":
            if e["lost_at"] in seen:
                continue
            seen.add(e["lost_at"])
            e = min((x for x in events if x.kind == e.kind and x["lost_at"] == e["lost_at"]), key=lambda x: x.rank)
        if e.kind in RECOVERY_KINDS:
            found.append(e)
    return sorted(found, key=lambda e: e.time)


def _kind(e: Event) -> str:
    return "start over" if e.kind == "fallback" and e["checkpoint"] is None else RECOVERY_KINDS[e.kind]


def drill_facts(args: argparse.Namespace, finished: bool, events: list[Event], reference: list[Event] | None,
                walls: tuple[float | None, float | None], landed: tuple[int, str]) -> dict[str, Any]:
    """A ``--kills`` drill's facts (also its ``--json``): kills asked and landed, recoveries by kind, steps lost
    (per kill: the last committed step before it against the step its recovery resumed at), goodput (the
    fault-free wall of the same mode over this run's) and the digest check."""
    kills = sorted((e for e in events if e.kind == "fault_injected"), key=lambda e: e.time)
    found = recoveries(events)
    lost: int | None = 0
    answered: dict[int, int] = {}  # recovery index: the last commit before the first kill it answered
    per_kill = []
    for kill in kills:
        after = next((i for i, r in enumerate(found) if r.time >= kill.time), None)
        committed = committed_at(events, kill, found[after] if after is not None else None)
        per_kill.append({"time": kill.time, "committed_step": committed,
                         "recovery": _kind(found[after]) if after is not None else None,
                         "resumed_step": found[after].step if after is not None else None})
        if after is None or committed is None:
            lost = None  # no recovery followed (the job failed, or finished first), or nothing tells the step
            continue
        answered.setdefault(after, committed)
    if lost is not None:
        lost = sum(max(committed - found[i].step, 0) for i, committed in answered.items())
    wall, fault_free_wall = walls
    finals = [e["digest"] for e in events if e.kind == "digest" and e["final"]]
    fault_free = [e["digest"] for e in reference or [] if e.kind == "digest" and e["final"]]
    mode = "in process" if args.in_process else "torchrun, " + (
        "checkpoint only" if args.no_parity else "parity (decode from spills)")
    return {
        "mode": mode, "seed": args.seed, "schedule": f"poisson {args.kill_rate}/min" if args.kill_rate is not None else
        f"after each recovery's first commit + U(0, {args.kill_jitter}) s", "kills_asked": args.kills,
        "kills_landed": landed[0], "why_short": landed[1] or None,
        "recoveries": {kind: sum(_kind(r) == kind for r in found) for kind in (*RECOVERY_KINDS.values(), "start over")},
        "full_restarts": sum(e.kind == "restarting_all" for e in events),
        "steps_lost": lost, "kills": per_kill,
        "finished": finished, "wall_s": wall, "fault_free_wall_s": fault_free_wall,
        "goodput": fault_free_wall / wall if wall and fault_free_wall else None,
        "final_digest": finals[-1] if finals else None, "fault_free_digest": fault_free[-1] if fault_free else None,
        "digest_match": bool(finals and fault_free) and finals[-1] == fault_free[-1] and finished,
        "unseeded": _unseeded(events, reference) or None,
        "data_not_resumable": _data_not_resumable(events) or None,
    }


def _drill_lines(f: dict[str, Any]) -> list[str]:
    """The summary of a ``--kills`` drill (see :func:`drill_facts`)."""
    short = "" if f["kills_landed"] == f["kills_asked"] else f" (FAILED: {f['why_short']})"
    by_kind = ", ".join(f"{kind} {count}" for kind, count in f["recoveries"].items() if count) or "none"
    goodput = (f"{f['goodput']:.3f} (fault-free {f['fault_free_wall_s']:.1f} s / this run {f['wall_s']:.1f} s, same mode)"
               if f["goodput"] is not None else "unknown (" + ("no fault-free run" if f["fault_free_wall_s"] is None
                                                             else "the job did not finish") + ")")
    why = f" ({f['unseeded']})" if f["unseeded"] else "" if f["fault_free_digest"] else " (no fault-free run to compare)"
    if not f["digest_match"] and not f["unseeded"] and f["data_not_resumable"]:
        why = f" ({f['data_not_resumable']})"
    return [
        f"mode: {f['mode']}; kills: {f['schedule']}, seed {f['seed']}",
        f"kills landed: {f['kills_landed']} of {f['kills_asked']}{short}",
        f"recoveries: {by_kind}" + (f"; full restarts of the launcher: {f['full_restarts']}" if f["full_restarts"] else ""),
        f"steps lost: {f['steps_lost'] if f['steps_lost'] is not None else 'unknown (a kill had no recovery after it)'}",
        "last committed step before each kill: " + (", ".join(
            "unknown" if k["committed_step"] is None else f"{k['committed_step']} (resumed at {k['resumed_step']}, "
            f"{k['recovery']})" if k["recovery"] else f"{k['committed_step']} (no recovery)" for k in f["kills"]) or "none"),
        f"job finished: {'yes' if f['finished'] else 'no'}",
        "wall: " + (f"{f['wall_s']:.1f} s (start to exit)" if f["wall_s"] else "unknown (the job did not finish)"),
        f"goodput: {goodput}",
        f"final digest: {f['final_digest'] or 'none'}",
        f"digest match: {'yes' if f['digest_match'] else 'no'}{why}",
    ]


def _resumed_generations(events: list[Event], in_process: list[Event], generations: list[float]) -> int:
    """How many in-process recoveries trained on: a step was committed after one and before the next failure's
    handling (a recovery that then failed again is not counted)."""
    handling = sorted(e.time for e in events if e.kind in ("replacement_planned", "restarting_all"))
    resumed = [e.time for e in events if e.kind == "resumed"]
    count = 0
    for generation in generations:
        done = max(e.time for e in in_process if e["lost_at"] == generation)
        until = next((t for t in handling if t > done), float("inf"))
        count += any(done <= t < until for t in resumed)
    return count
