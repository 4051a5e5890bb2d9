"""Recovery of a lost rank in process (``lightning-dlrover launch``, hot spare or cold) against the restart path.

Same job as ``bench/bench_recovery.py`` (the chaos config with 26 tables of ``--rows`` x ``--dim``, k=1 r=1):

- ``in-process hot``: one launcher, 4 ranks and 1 hot spare; rank 0 is SIGKILLed before the forward of step
  ``--at-step``; the survivors stay in ``fit``, the spare takes rank 0;
- ``in-process cold``: the same with no spare (a process is started for the rank after the loss);
- ``in-process shrink``: the same with no spare and none wanted (``--spares 0 --no-cold-start``): the survivors
  train on at ``--ranks - 1`` ranks in their own processes (``replace`` is then the group's reconfiguration, and
  ``restore`` re-sharding the model for the smaller world and restoring the committed state into it);
- ``in-process grow``: the shrink, then ``--regrow``: the launcher starts a process after the shrink, and once it is
  set up the job grows back to ``--ranks`` at a commit. Its row times the grow: ``detect`` from the grow plan to the
  step boundary the ranks agreed on, ``replace`` from there until the communicator includes the new rank, ``restore``
  until every rank restored the committed step at the larger size, ``total`` from the step boundary to the first
  commit after it (the pause; nothing was lost). A grow by the restart path is ``dcp``'s total (stop, restart at the
  larger size, load the checkpoint);
- ``in-process replan``: no fault; after step ``--at-step`` every rank asks for the tables to be planned anew with
  every fourth table 20x hotter (``bench/replan_at.py``, what ``ResourceAdvisor(apply=True)`` does with measured
  pooling factors), and at the next commit they are re-sharded in process at the same world size. Its row: ``restore``
  from the commit boundary to the state restored in the new layout, ``total`` to the first commit after it;
- ``in-process retire``: no fault; after step ``--at-step`` every rank asks to shrink the job to ``--ranks - 1`` ranks
  (``bench/replan_at.py``, what ``ResourceAdvisor(apply=True)`` does when fewer ranks are better): the launcher
  publishes the plan, the highest rank retires at the next commit and the others shrink in process. Its row as the
  re-plan's; ``detect`` from the launcher's plan to that commit boundary;
- ``in-process join``: no fault; the job is launched with room for one rank more (``launch --max-nproc-per-node``) and
  after step ``--at-step`` every rank asks to grow to ``--ranks + 1`` (what ``ResourceAdvisor(apply=True)`` does when
  more ranks are better): the launcher starts a process, and once it is set up the new rank joins at a commit. Its
  row as the grow's (``--grow-steps`` steps after the request: the new process sets up meanwhile);
- ``in-process machine``: no fault; the job is launched with room for a second machine (``launch --max-nnodes 2``)
  and once it committed its first step a second launcher starts (``--node-rank 1``, one rank, on this machine: a
  machine added to the job): its process sets up, and it joins as rank ``--ranks`` at a commit. Its row as the
  grow's; the set-up is from the second launcher's offer to machine 0's grow plan (``--machine-steps`` steps after
  ``--at-step``: the second launcher imports everything in a warm process of its own first);
- ``dcp``, ``parity restart``: ``bench_recovery.measure`` in the same run (2 ``torchrun`` agents x 2 ranks, node
  0 killed, every worker restarted; a checkpoint at the kill step for ``dcp``, spills for ``parity``).

The kill waits until the hot spare is hot (imported, waiting for a rank: ``LIGHTNING_DLROVER_FAULT_WAITS_FOR_SPARES``);
on a busy machine an idle-priority spare may otherwise still be importing at the kill, and the drill would time that.

Times (seconds, from the jobs' own events): ``detect`` kill to the first survivor's failed collective;
``replacement`` from there until the replacement reached its fit loop (it imported, set up and sharded its
model); ``decode`` decode + re-shard; ``restore`` until every rank restored the committed step; ``1st step``
until the first step after it was committed; ``total`` kill to that commit. ``x dcp`` is dcp's total over the
method's.

The floor, measured in the same run for each size (two processes, gloo on 127.0.0.1): the
bytes the replacement receives (the lost rank's coded embedding state and its parity share, from the job's own
report) sent and received into fresh memory (``send``), the same again into memory already touched (``warm``: what a
hot spare's reserve is, ``fault/coding/reserve.py``), and copied in memory into fresh memory (``copy``). ``state
part`` is the in-process total less the same drill's total at ``--base-rows`` (the part that does not grow with the
state); ``/ floor`` is it over ``send``, ``/ warm`` over ``warm``. The load average (``uptime``'s) is printed at
the start and at the end: other jobs on the machine move every number.

    PYTHONPATH=. python bench/bench_in_process.py                # 20k rows per table (127 MiB), ~4 min
    PYTHONPATH=. python bench/bench_in_process.py --rows 100000  # 635 MiB
    PYTHONPATH=. python bench/bench_in_process.py --rows 20000 100000 300000 --methods "in-process hot" dcp
    PYTHONPATH=. python bench/bench_in_process.py --methods "in-process shrink" "in-process hot" --base-rows 0
    PYTHONPATH=. python bench/bench_in_process.py --methods "in-process grow" dcp --rows 20000 100000 --base-rows 0
    PYTHONPATH=. python bench/bench_in_process.py --methods "in-process replan" --rows 20000 100000 --base-rows 0
    PYTHONPATH=. python bench/bench_in_process.py --methods "in-process retire" dcp --rows 20000 100000 --base-rows 0
    PYTHONPATH=. python bench/bench_in_process.py --methods "in-process join" dcp --rows 20000 100000 --base-rows 0
    PYTHONPATH=. python bench/bench_in_process.py --methods "in-process machine" dcp --rows 20000 100000 --base-rows 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))

import bench_recovery  # noqa: E402

from lightning_dlrover.fault.inplace import membership  # noqa: E402
from lightning_dlrover.fault.points import WAIT_FOR_SPARES_ENV  # noqa: E402
from lightning_dlrover.monitor.events import read_events  # noqa: E402

_CODED = re.compile(r"rank 0 codes ([\d.]+) MiB of embedding state and holds ([\d.]+) MiB of parity")

FLOOR_WORKER = """
import json, sys, time, torch, torch.distributed as dist
rank, port, nbytes, piece = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), 64 << 20
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if rank == 1:
    data = torch.full((nbytes,), 7, dtype=torch.uint8)  # the survivors' bytes, in memory
    for _ in range(2):
        dist.barrier()
        for lo in range(0, nbytes, piece):
            dist.send(data[lo : lo + piece], 0)
    dist.barrier()
else:
    dist.barrier()
    started = time.perf_counter()
    into = torch.empty(nbytes, dtype=torch.uint8)  # fresh memory, as a replacement's without a reserve
    for lo in range(0, nbytes, piece):
        dist.recv(into[lo : lo + piece], 1)
    send = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    for lo in range(0, nbytes, piece):  # again, into memory already touched (a hot spare's reserve)
        dist.recv(into[lo : lo + piece], 1)
    warm = time.perf_counter() - started
    dist.barrier()
    assert int(into[-1]) == 7
    del into
    source = torch.full((nbytes,), 7, dtype=torch.uint8)
    started = time.perf_counter()
    torch.empty(nbytes, dtype=torch.uint8).copy_(source)
    print(json.dumps({"send": send, "send_warm": warm, "copy": time.perf_counter() - started}))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def asked(rows: int, args: argparse.Namespace, workdir: Path, what: str) -> dict[str, float]:
    """The re-plan, retire, join or machine drill (see the module docs); timings from its events."""
    end = args.at_step + {"join": args.grow_steps, "machine": args.machine_steps}.get(what, args.after_steps)
    config_path = bench_recovery.job_config(rows, args.dim, "parity", args.at_step, end, workdir)
    config = yaml.safe_load(config_path.read_text())
    hot = {f"t_cat_{i}": 20.0 for i in range(0, 26, 4)}
    config["trainer"]["callbacks"] += [] if what == "machine" else [
        {"class_path": "replan_at.ReplanAt", "init_args": {"step": args.at_step, "pooling_factors": hot}}
        if what == "replan" else
        {"class_path": "replan_at.ResizeAt",
         "init_args": {"step": args.at_step, "world_size": args.ranks + (1 if what == "join" else -1)}}]
    config_path.write_text(yaml.safe_dump(config))
    run_dir = workdir / f"{what}-{rows}"
    run_dir.mkdir()
    events_path = run_dir / "events.jsonl"
    env = {**os.environ, "LIGHTNING_DLROVER_EVENTS": str(events_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ["PYTHONPATH"]])}
    address = f"127.0.0.1:{free_port()}"
    launcher = [sys.executable, "-m", "lightning_dlrover", "launch", "--spares", "0", "--master", address,
                "--max-nproc-per-node", str(args.ranks + (what == "join")), "--max-nnodes", str(1 + (what == "machine"))]
    program = ["--", "-m", "lightning_dlrover", "fit", "--config", str(config_path),
               f"--trainer.default_root_dir={run_dir}"]
    with open(run_dir / "launch.log", "w") as log, open(run_dir / "machine1.log", "w") as log1:
        job = subprocess.Popen([*launcher, "--nproc-per-node", str(args.ranks), *program], env=env, cwd=run_dir,
                               stdout=log, stderr=subprocess.STDOUT)
        if what == "machine":  # a machine added once the job trains
            store = membership.connect(address, timeout=300)
            while membership.committed(store, 0, 0) is None and job.poll() is None:
                time.sleep(0.2)
            added = subprocess.Popen([*launcher, "--node-rank", "1", "--nproc-per-node", "1", *program], env=env,
                                     cwd=run_dir, stdout=log1, stderr=subprocess.STDOUT)
        code = job.wait(timeout=900)
        if what == "machine":
            code = code or added.wait(timeout=120)
    events = read_events([events_path])
    kind = {"replan": "resharded_in_process", "retire": "shrunk_in_process", "join": "grown_in_process",
            "machine": "grown_in_process"}[what]
    done = [e for e in events if e.kind == kind]
    if code != 0 or not done:
        sys.exit(f"the {what} drill ({rows} rows) did not change the job in process; see {run_dir}")
    boundary = min(e.fields["failed_at"] for e in done if e.fields["failed_at"] is not None)  # (a joined rank: None)
    restored = max(e.fields["restored_at"] for e in done)
    resumed = next(e for e in events if e.kind == "resumed" and e.time >= restored).time
    if what == "replan":
        print(f"{rows} rows, re-planned: {done[0].fields['sharding']}", flush=True)
    asked_at = next((e.time for e in events if e.kind in ("shrink_planned", "grow_planned")), boundary)  # the plan
    started = next((e.time for e in events if e.kind in ("grow_started", "join_offered")), asked_at)
    return {"lost_bytes": float("nan"), "detect": max(boundary - asked_at, 0.0), "replacement": 0.0,
            "decode": max(e.fields["decode_s"] + e.fields["reshard_s"] for e in done), "restore": restored - boundary,
            "first_step": resumed - restored, "total": resumed - boundary, "set_up": asked_at - started}


def in_process(rows: int, args: argparse.Namespace, workdir: Path, spares: int, shrink: bool = False,
               grow: bool = False) -> dict[str, float]:
    """One in-process drill (``shrink``: no spare and none wanted, the survivors go on at one rank fewer; ``grow``: and
    then grow back); timings from its events."""
    end = args.at_step + (args.grow_steps if grow else args.after_steps)
    config = bench_recovery.job_config(rows, args.dim, "parity", args.at_step, end, workdir)
    run_dir = workdir / f"inprocess-{spares}-{rows}{'-shrink' if shrink else ''}{'-grow' if grow else ''}"
    run_dir.mkdir()
    events_path = run_dir / "events.jsonl"
    env = {**os.environ, "LIGHTNING_DLROVER_EVENTS": str(events_path), WAIT_FOR_SPARES_ENV: "1" if spares else "0",
           "LIGHTNING_DLROVER_FAULT": f"rank=0,step={args.at_step},phase=before_forward"}
    command = [sys.executable, "-m", "lightning_dlrover", "launch", "--nproc-per-node", str(args.ranks),
               "--spares", str(spares), *(["--no-cold-start"] if shrink else []), *(["--regrow"] if grow else []), "--master", f"127.0.0.1:{free_port()}",
               "--", "-m", "lightning_dlrover", "fit",
               "--config", str(config), f"--trainer.default_root_dir={run_dir}"]
    with open(run_dir / "launch.log", "w") as log:
        code = subprocess.run(command, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
    events = read_events([events_path])
    recovered = [e for e in events if e.kind == ("shrunk_in_process" if shrink else "recovered_in_process")]
    if code != 0 or not recovered:
        sys.exit(f"in-process drill ({spares} spares, {rows} rows) did not recover in process; see {run_dir}")
    if grow:
        return _grown(events, run_dir)
    kill = next(e for e in events if e.kind == "fault_injected").time
    resumed = next(e for e in events if e.kind == "resumed").time
    survivors = [e for e in recovered if shrink or e.fields["survivor"]]
    failed = min(e.fields["failed_at"] for e in survivors)
    restored = max(e.fields["restored_at"] for e in recovered)
    if shrink:  # no joiner: "replacement" is the group's reconfiguration, "restore" the re-shard and restore
        connected = max(e.fields["connected_at"] for e in recovered)
        return {"lost_bytes": float("nan"), "detect": failed - kill, "replacement": connected - failed,
                "decode": max(e.fields["decode_s"] + e.fields["reshard_s"] for e in recovered),
                "restore": restored - connected, "first_step": resumed - restored, "total": resumed - kill}
    joiner = next(e for e in recovered if not e.fields["survivor"])
    coded = _CODED.search((run_dir / "launch.log").read_text())
    reserve = next((e.fields for e in events if e.kind == "reserve_used"), None)  # a hot spare's, before the loss
    return {
        "reserve_taken_mib": reserve["taken_bytes"] / 2**20 if reserve else 0.0,
        "reserve_prepare_s": reserve["prepare_s"] if reserve else 0.0,
        "lost_bytes": (float(coded[1]) + float(coded[2])) * 2**20 if coded else float("nan"),
        "detect": failed - kill,
        "replacement": joiner.fields["connected_at"] - failed,
        "decode": max(e.fields["decode_s"] + e.fields["reshard_s"] for e in recovered),
        "restore": restored - joiner.fields["connected_at"],
        "first_step": resumed - restored,
        "total": resumed - kill,
    }


def _grown(events: list, run_dir: Path) -> dict[str, float]:
    """The grow's timings (see the module docs) from a ``--regrow`` drill's events."""
    grown = [e for e in events if e.kind == "grown_in_process"]
    if not grown:
        sys.exit(f"the job did not grow back in process (give it more --grow-steps); see {run_dir}")
    planned = next(e for e in events if e.kind == "grow_planned").time
    started = next(e for e in events if e.kind == "grow_started").time
    boundary = min(e.fields["failed_at"] for e in grown if e.fields["survivor"])
    connected = max(e.fields["connected_at"] for e in grown)
    restored = max(e.fields["restored_at"] for e in grown)
    resumed = next(e for e in events if e.kind == "resumed" and e.time >= restored).time
    return {"lost_bytes": float("nan"), "set_up": planned - started, "detect": boundary - planned,
            "replacement": connected - boundary, "decode": max(e.fields["decode_s"] + e.fields["reshard_s"] for e in grown),
            "restore": restored - connected, "first_step": resumed - restored, "total": resumed - boundary}


def floor(nbytes: int) -> dict[str, float]:
    """``send``: ``nbytes`` sent over loopback gloo into fresh memory; ``copy``: copied in memory into fresh memory."""
    port = str(free_port())
    workers = [subprocess.Popen([sys.executable, "-c", FLOOR_WORKER, str(rank), port, str(nbytes)],
                                stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    out = workers[0].communicate(timeout=600)[0]
    workers[1].wait(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def restart(rows: int, method: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    r = bench_recovery.measure(rows, args.dim, method, args, workdir)
    return {"detect": r["detect"], "replacement": r["restart"], "decode": r["restore"], "restore": r["restore"],
            "first_step": r["first_step"], "total": r["total"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[20_000], help="rows per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the in-process job")
    parser.add_argument("--at-step", type=int, default=8)
    parser.add_argument("--after-steps", type=int, default=6)
    parser.add_argument("--grow-steps", type=int, default=60,
                        help="in-process grow: steps after the kill (the new process sets up meanwhile)")
    parser.add_argument("--machine-steps", type=int, default=400,
                        help="steps after --at-step of the machine drill: the second launcher starts its own warm "
                             "process and sets up meanwhile")
    parser.add_argument("--methods", nargs="+", default=["in-process hot", "in-process cold", "parity restart", "dcp"])
    parser.add_argument("--base-rows", type=int, default=1_000,
                        help="rows per table of the drill whose total is the part that does not grow with the state "
                        "(0: none, no 'state part')")
    args = parser.parse_args()
    # The jobs run in their own directories: a relative PYTHONPATH (``PYTHONPATH=.``) would not reach this checkout
    # there, and they would import whichever lightning_dlrover the interpreter has installed instead.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent)]
        + [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    table = []
    with tempfile.TemporaryDirectory(prefix="bench_in_process_") as tmp:
        base = None
        if args.base_rows and any(m.startswith("in-process") for m in args.methods):
            base = in_process(args.base_rows, args, Path(tmp), spares=1)
            print(f"{args.base_rows} rows (base), in-process hot: {base}", flush=True)
        for rows in args.rows:
            results = {}
            for method in args.methods:
                if method in ("in-process replan", "in-process retire", "in-process join", "in-process machine"):
                    results[method] = asked(rows, args, Path(tmp), method.split()[-1])
                elif method.startswith("in-process"):
                    results[method] = in_process(rows, args, Path(tmp), spares=1 if method.endswith("hot") else 0,
                                                 shrink=method.endswith(("shrink", "grow")),
                                                 grow=method.endswith("grow"))
                else:
                    results[method] = restart(rows, "parity" if method == "parity restart" else method, args, Path(tmp))
                print(f"{rows} rows, {method}: {results[method]}", flush=True)
            hot = results.get("in-process hot")
            bottom = floor(int(hot["lost_bytes"])) if hot is not None and hot["lost_bytes"] == hot["lost_bytes"] else None
            print(f"{rows} rows, floor: {bottom}", flush=True)
            table.append((rows, results, bottom))
    print(f"\nLost rank to first committed step after it. 26 tables x {args.dim} columns fp32, row-wise Adagrad, gloo "
          f"on CPU, 127.0.0.1, {args.ranks} ranks. Seconds from the jobs' events.")
    header = (f"{'emb MiB':>8} {'method':<16} {'detect':>7} {'replace':>8} {'decode':>7} {'restore':>8} {'1st step':>9} "
              f"{'total':>7} {'x dcp':>6}")
    print(header)
    print("-" * len(header))
    for rows, results, _ in table:
        dcp = results.get("dcp")
        for method, r in results.items():
            ratio = dcp["total"] / r["total"] if dcp else float("nan")
            print(f"{26 * rows * args.dim * 4 / 2**20:>8.0f} {method:<16} {r['detect']:>7.2f} {r['replacement']:>8.2f} "
                  f"{r['decode']:>7.3f} {r['restore']:>8.2f} {r['first_step']:>9.2f} {r['total']:>7.2f} {ratio:>6.1f}")
    print("restart rows: 'replace' is the restart (workers exit, re-rendezvous, import, build); 'decode' and 'restore' "
          "the restore (decode + re-shard for parity, the checkpoint load for dcp).")
    for rows, results, _ in table:
        for method in ("in-process grow", "in-process join", "in-process machine"):
            if (g := results.get(method)) is None:
                continue
            print(f"{method} at {26 * rows * args.dim * 4 / 2**20:.0f} MiB: 'detect' is the wait for the step "
                  f"boundary after the grow plan; 'total' the pause from that boundary (the new process set up in "
                  f"{g['set_up']:.2f} s before it, while the job trained on)")
    base = base or {"total": float("nan")}
    print(f"\nThe floor beside each size: the bytes the replacement receives (its coded state and parity share) sent "
          f"over loopback gloo into fresh memory ('send'), into memory already touched ('warm'), and copied in memory "
          f"('copy'). 'state part' is the in-process "
          f"hot total less the total at {args.base_rows} rows ({base['total']:.2f} s).")
    header = (f"{'emb MiB':>8} {'lost MiB':>9} {'total':>7} {'state part':>11} {'send':>7} {'warm':>6} {'copy':>7} "
              f"{'/ floor':>8} {'/ warm':>7} "
              f"{'dcp':>7} {'x dcp':>6}")
    print(header)
    print("-" * len(header))
    for rows, results, bottom in table:
        hot, dcp = results.get("in-process hot"), results.get("dcp")
        if hot is None or bottom is None:
            continue
        part = hot["total"] - base["total"]
        dcp_total = dcp["total"] if dcp else float("nan")
        print(f"{26 * rows * args.dim * 4 / 2**20:>8.0f} {hot['lost_bytes'] / 2**20:>9.0f} {hot['total']:>7.2f} "
              f"{part:>11.2f} {bottom['send']:>7.2f} {bottom['send_warm']:>6.2f} {bottom['copy']:>7.2f} "
              f"{part / bottom['send']:>8.1f} {part / bottom['send_warm']:>7.1f} "
              f"{dcp_total:>7.2f} {dcp_total / hot['total']:>6.1f}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
