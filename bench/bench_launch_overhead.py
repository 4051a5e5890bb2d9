"""What being ready for in-process recovery costs a job that never fails: `torchrun` vs `lightning-dlrover launch`.

The packaged chaos job (``lightning_dlrover/cli/configs/chaos.yaml``: a small DLRM, parity k=1 r=1, a
``ModelCheckpoint`` every 150 steps; per-step digests off) on 1 machine with 2 ranks, fault-free, under ``torchrun``
(``--max-restarts 3``), ``launch --spares 0`` and ``launch --spares N``. The runs are interleaved (a drift of a shared
machine hits every mode alike; each mode goes first in one repeat of three); the table gives the median over ``--repeats`` of

- wall: the launcher's process from start to exit;
- CPU: user + system seconds of the whole process tree (the launcher, its ranks and spares, from ``os.wait4``);
- first step: seconds from start until rank 0 committed step 1 (its progress record in the spill directory);
- launcher CPU: user + system seconds of the launcher process alone (``torchrun``'s agent, or ``launch``'s supervisor
  and the store it hosts), its last sample of ``/proc/<pid>/stat`` before it exits;
- ratios of wall and CPU to ``torchrun``'s.

    PYTHONPATH=. python bench/bench_launch_overhead.py                  # about 5 minutes on 2 idle cores
    PYTHONPATH=. python bench/bench_launch_overhead.py --steps 300 --repeats 3 --spares 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "lightning_dlrover" / "cli" / "configs" / "chaos.yaml"
PROGRESS = struct.Struct("<4sIqdq")  # lightning_dlrover.fault.restart.spill's progress record


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(mode: str, spares: int, workdir: Path, steps: int, every: int) -> list[str]:
    overlay = workdir / "checkpoint.yaml"  # a second config replaces the callbacks list of the first
    overlay.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                       f"      init_args: {{every_n_train_steps: {every}, save_top_k: -1}}\n")
    fit = ["-m", "lightning_dlrover", "fit", "--config", str(CONFIG), "--config", str(overlay),
           f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={workdir}"]
    port = free_port()
    if mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3",
                "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=bench-{port}", *fit]
    return [sys.executable, "-m", "lightning_dlrover", "launch", "--nproc-per-node", "2", "--spares", str(spares),
            "--master", f"127.0.0.1:{port}", "--", *fit]


def first_step(spills: Path) -> float | None:
    """The time rank 0 recorded step 1 committed, if its progress record says so now."""
    try:
        data = (spills / "progress0").read_bytes()
    except OSError:
        return None
    if len(data) != PROGRESS.size:
        return None
    _, _, step, when, _ = PROGRESS.unpack(data)
    return when if step == 1 else (time.time() if step > 1 else None)


def exited(pid: int) -> bool:
    """Whether child ``pid`` exited, leaving it to be reaped (by ``os.wait4``, which reports its tree's CPU)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def own_cpu(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` alone (not its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(mode: str, spares: int, steps: int, every: int) -> tuple[float, float, float, float]:
    """(wall seconds, CPU seconds of the tree, seconds to the first committed step, CPU seconds of the launcher
    alone) of one fault-free run."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    spills = workdir / "spills"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LIGHTNING_DLROVER_SPILL_DIR": str(spills),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for name in ("LIGHTNING_DLROVER_DIGEST_EVERY", "LIGHTNING_DLROVER_FAULT", "LIGHTNING_DLROVER_EVENTS"):
        env.pop(name, None)
    log = open(workdir / "out.log", "w")
    started = time.time()
    proc = subprocess.Popen(command(mode, spares, workdir, steps, every), env=env, cwd=workdir, stdout=log,
                            stderr=subprocess.STDOUT)
    first, launcher = None, 0.0
    while first is None and not exited(proc.pid):  # cheap: a 32-byte read every 20 ms until step 1
        time.sleep(0.02)
        first = first_step(spills)
    while not exited(proc.pid):
        launcher = own_cpu(proc.pid) or launcher
        time.sleep(0.5)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - started
    log.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{mode} failed: {(workdir / 'out.log').read_text()[-3000:]}")
    shutil.rmtree(workdir, ignore_errors=True)
    return wall, usage.ru_utime + usage.ru_stime, (first - started) if first is not None else float("nan"), launcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--checkpoint-every", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spares", type=int, default=3, help="hot spares of the last mode")
    args = parser.parse_args()
    modes = [("torchrun", 0), ("launch --spares 0", 0), (f"launch --spares {args.spares}", args.spares)]
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _ in modes}
    load = os.getloadavg()
    for repeat in range(args.repeats):
        for name, spares in modes[repeat % 3:] + modes[:repeat % 3]:  # each mode goes first once in 3 repeats
            runs[name].append(measure(name.split()[0], spares, args.steps, args.checkpoint_every))
            wall, cpu, first, launcher = runs[name][-1]
            print(f"# run {repeat + 1} {name}: wall {wall:.1f} s, CPU {cpu:.1f} s, first step {first:.1f} s, "
                  f"launcher CPU {launcher:.2f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    median = {name: [statistics.median(r[i] for r in runs[name]) for i in range(4)] for name in runs}
    base = median["torchrun"]
    print(f"{args.steps} steps, 2 ranks, parity k1 r1, median of {args.repeats}; load average before "
          f"{load[0]:.2f} / after {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    print("| mode | wall (s) | CPU of the tree (s) | first step (s) | launcher CPU (s) | wall / torchrun | "
          "CPU / torchrun |")
    print("|---|---|---|---|---|---|---|")
    for name in runs:
        wall, cpu, first, launcher = median[name]
        print(f"| `{name}` | {wall:.1f} | {cpu:.1f} | {first:.1f} | {launcher:.2f} | {wall / base[0]:.3f} | "
              f"{cpu / base[1]:.3f} |")


if __name__ == "__main__":
    main()
