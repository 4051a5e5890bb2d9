"""The advisor's straggler detector under load: false namings in clean runs, steps to name a slow rank.

Every run is a real 2-rank job of ``tests/scripts/advisor_job.py`` (the benchmark DLRM under ``DLRoverStrategy``,
gloo on CPU, Lightning's launcher: rank 1 is a child of rank 0) with the ``ResourceAdvisor`` (a profiling window of
``--profile-steps``, after which rank 0 alone fits the model and re-plans; checks every ``--check-every`` steps),
while ``--hogs`` CPU busy loops run beside it (the script starts and stops them). Runs:

- **clean**: nothing is slowed. Any ``straggler`` event is a false naming.
- **idle**: from step ``--slow-from`` rank 1 sleeps ``--idle-ms`` inside each step (between forward and backward).
- **cpu**: from step ``--slow-from`` rank 1 burns ``--cpu-ms`` of CPU time in each step.

For a slow run, steps-to-name is the first ``straggler`` event naming rank 1 (at or after the slow-down) minus the
step the slow-down began; a naming of another rank, or before the slow-down, is a false naming. A communication-bound
verdict (``straggler`` event of rank -1: no rank named) is counted apart. One line per run, then a summary per kind;
the events are the structured ones (``dlrover_events.jsonl``).

    PYTHONPATH=. python bench/bench_detectors.py                 # 10 clean + 5 idle + 5 cpu runs
    PYTHONPATH=. python bench/bench_detectors.py --quick         # 2 + 1 + 1
    PYTHONPATH=. python bench/bench_detectors.py --record windows.jsonl   # and keep every window the detector judged

``--record`` appends, per check of every run, the windows of all ranks the detector was given (``RankWindow`` fields,
per-step own times included): a rule can be replayed on them offline, and ``tests/advisor/straggler_windows.json``
holds some of them for the rule's tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "scripts" / "advisor_job.py"


def hogs(n: int) -> list[subprocess.Popen]:
    """``n`` CPU busy loops (separate processes)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run(kind: str, args: argparse.Namespace, root: Path) -> dict:
    """One job; returns its row."""
    cmd = [sys.executable, str(JOB), "--root", str(root), "--devices", "2", "--advisor", "--steps", str(args.steps),
           "--profile-steps", str(args.profile_steps), "--probe-steps", str(args.probe_steps),
           "--check-every", str(args.check_every)]
    if args.patience:
        cmd += ["--straggler-patience", str(args.patience)]
    if args.record:
        cmd += ["--record-windows", str(root / "windows.jsonl")]
    if kind == "idle":
        cmd += ["--slow-rank", "1", "--slow-from", str(args.slow_from), "--slow-ms", str(args.idle_ms), "--slow-idle"]
    elif kind == "cpu":
        cmd += ["--slow-rank", "1", "--slow-from", str(args.slow_from), "--slow-ms", str(args.cpu_ms)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.time()
    proc = subprocess.run(cmd, cwd=root.parent, capture_output=True, text=True, timeout=600, env=env)
    wall = time.time() - started
    events = []
    path = root / "dlrover_events.jsonl"
    if path.is_file():
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    comm = [e for e in events if e["kind"] == "straggler" and e["straggler_rank"] == -1]
    named = [e for e in events if e["kind"] == "straggler" and e["straggler_rank"] >= 0]
    final = re.search(r"FINAL_STEP (\d+)", proc.stdout)
    if args.record and (root / "windows.jsonl").is_file():
        with open(args.record, "a") as f:
            for line in (root / "windows.jsonl").read_text().splitlines():
                f.write(json.dumps({"run": root.name, "kind": kind, "windows": json.loads(line)}) + "\n")
    row = {"kind": kind, "ok": proc.returncode == 0 and final is not None, "wall_s": wall,
           "named": [(e["step"], e["straggler_rank"], e["cause"], round(e["ratio"], 1), round(e["excess_ms"]))
                     for e in named], "comm": len(comm)}
    if kind == "clean":
        row["false"] = len(named)
        row["steps_to_name"] = None
    else:
        slow_from = args.slow_from
        # the batch that starts at global step slow_from ends at step slow_from + 1: the first slow step
        right = [e for e in named if e["straggler_rank"] == 1 and e["step"] > slow_from]
        row["false"] = len([e for e in named if e not in right])
        row["steps_to_name"] = right[0]["step"] - slow_from if right else None
        row["cause"] = right[0]["cause"] if right else None
    if not row["ok"]:
        row["tail"] = (proc.stdout + proc.stderr)[-2000:]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clean", type=int, default=10)
    p.add_argument("--idle", type=int, default=5)
    p.add_argument("--cpu", type=int, default=5)
    p.add_argument("--hogs", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile-steps", type=int, default=12)
    p.add_argument("--probe-steps", type=int, default=4)
    p.add_argument("--check-every", type=int, default=5)
    p.add_argument("--slow-from", type=int, default=20)
    p.add_argument("--idle-ms", type=float, default=200.0)
    p.add_argument("--cpu-ms", type=float, default=100.0)
    p.add_argument("--patience", type=int, default=None, help="ResourceAdvisor(straggler_patience=...)")
    p.add_argument("--quick", action="store_true", help="2 clean, 1 idle, 1 cpu run")
    p.add_argument("--record", default=None, help="append every window the detector judged to this JSONL file "
                   "(one line per check: run, kind, windows) for replaying rules offline")
    args = p.parse_args()
    if args.quick:
        args.clean, args.idle, args.cpu = 2, 1, 1
    # Interleaved (clean, idle, clean, cpu, ...) so that slow drifts of the shared machine hit every kind alike.
    left = {"clean": args.clean, "idle": args.idle, "cpu": args.cpu}
    kinds, slow = [], "idle"
    while any(left.values()):
        for kind in ("clean", slow):
            if left[kind]:
                kinds.append(kind)
                left[kind] -= 1
        slow = "cpu" if slow == "idle" or not left["idle"] else "idle"
        if not left["clean"] and not left[slow]:
            slow = "cpu" if left["cpu"] else "idle"
    base = Path(tempfile.mkdtemp(prefix="bench_detectors_"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the busy loops when stopped
    busy = hogs(args.hogs)
    rows = []
    try:
        for n, kind in enumerate(kinds):
            row = run(kind, args, base / f"run{n}")
            rows.append(row)
            print(f"[{n + 1}/{len(kinds)}] {row['kind']:5s} ok={row['ok']} false={row['false']} "
                  f"steps_to_name={row['steps_to_name']} named={row['named']} comm={row['comm']} ({row['wall_s']:.0f} s)",
                  flush=True)
            if not row["ok"]:
                print(row["tail"], flush=True)
    finally:
        for h in busy:
            h.kill()
            h.wait()
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"Straggler detector, 2 ranks (gloo, CPU), {args.hogs} CPU busy loops beside the job; {args.steps} steps, "
          f"profiling window {args.profile_steps} steps, checks every {args.check_every} steps; slow rank 1 from "
          f"step {args.slow_from}: idle {args.idle_ms:.0f} ms or cpu {args.cpu_ms:.0f} ms per step.")
    print(f"{'kind':6s} {'runs':>4s} {'failed':>6s} {'false namings':>13s} {'runs w/ false':>13s} {'named':>7s} "
          f"{'<=10 steps':>10s} {'steps to name (median, max)':>28s} {'comm verdicts':>13s}")
    for kind in ("clean", "idle", "cpu"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        steps = [r["steps_to_name"] for r in rs if r["steps_to_name"] is not None]
        named = "-" if kind == "clean" else f"{len(steps)}/{len(rs)}"
        within = "-" if kind == "clean" else f"{sum(s <= 10 for s in steps)}/{len(rs)}"
        spread = f"{statistics.median(steps):.0f}, {max(steps)}" if steps else "-"
        print(f"{kind:6s} {len(rs):4d} {sum(not r['ok'] for r in rs):6d} {sum(r['false'] for r in rs):13d} "
              f"{sum(r['false'] > 0 for r in rs):13d} {named:>7s} {within:>10s} {spread:>28s} "
              f"{sum(r['comm'] for r in rs):13d}")


if __name__ == "__main__":
    main()
