"""Recovery from a lost node: erasure-coded spills vs restoring the job from each checkpoint backend.

Every run is a real elastic job started by the chaos runner (``lightning_dlrover.cli.chaos``): 2
``torchrun`` agents x 2 ranks on 127.0.0.1 train a DLRM of 26 equal tables; node 0 (agent and both
workers) is SIGKILLed before the forward of step ``--at-step``; a replacement node joins. Per table
size, three ways to get the state back, in one invocation:

- ``parity``: ``ParityConfig(k=1, r=1)``; the survivors spill their committed state to shared memory,
  the restarted job decodes the lost ranks and re-shards (0 steps lost by construction);
- ``dcp``, ``torchsnapshot``: no parity; a checkpoint is written at step ``--at-step`` (so this run,
  too, loses no step) and the restarted job loads it through the strategy's fallback.

The time from the kill to the first committed step after it is split, from the jobs' own timestamps:

- detect: kill to the first survivor's collective failing (its ``stopped at``);
- restart: from there to the restored state, less the restore itself (workers exit, the agents
  re-rendezvous, new workers import torch and build and shard the model);
- restore: decode + re-shard (``parity``) or the checkpoint load (``dcp``, ``torchsnapshot``);
- first step: restored state to the first committed step; it includes ``encode``, the new job's parity (only
  the lost ranks' share where the survivors keep theirs: ``kept``).

``parity-fresh`` is ``parity`` with the nodes left in ``torchrun``'s numbering
(``LIGHTNING_DLROVER_RENUMBER_NODES=0``): the surviving node comes back under the other node's ranks, so its
spills are re-sharded across the network and all parity is encoded afresh, as before the renumbering.

``restore x`` is the checkpoint load time over parity's decode + re-shard, ``total x`` the same for
kill-to-resume. A checkpoint every N steps also loses N/2 steps of work on average: ``lost/10`` and
``lost/100`` add that replay (at the job's own mean step time after the restart, ``step``) to the checkpoint rows.

    PYTHONPATH=. python bench/bench_recovery.py                 # 20k and 100k rows per table, ~5 min
    PYTHONPATH=. python bench/bench_recovery.py --quick         # one small size
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import yaml

from lightning_dlrover.cli import chaos
from lightning_dlrover.fault.restart.renumber import RENUMBER_ENV

CONFIG = Path(str(chaos.DEFAULT_CONFIG))
_STEP_MS = re.compile(r"^Throughput over \d+ steps.*\n.*\n-+\n\s*0\s+[\d.]+\s+([\d.]+)", re.MULTILINE)


def job_config(rows: int, dim: int, method: str, at_step: int, steps: int, workdir: Path) -> Path:
    """configs/chaos.yaml with 26 tables of ``rows`` x ``dim`` and the recovery ``method``."""
    config = yaml.safe_load(CONFIG.read_text())
    config["model"]["num_embeddings_per_feature"] = [rows] * 26
    config["model"]["embedding_dim"] = dim
    config["model"]["dense_arch_layer_sizes"] = [128, dim]
    config["trainer"]["max_steps"] = steps
    strategy = config["trainer"]["strategy"]["init_args"]
    checkpoint = config["trainer"]["callbacks"][0]["init_args"]
    config["trainer"]["callbacks"].append(
        {"class_path": "lightning_dlrover.ThroughputMonitor", "init_args": {"log_every_n_steps": 1000, "warmup_steps": 2}}
    )
    if method == "parity":
        checkpoint["every_n_train_steps"] = 10_000  # never: the parity run recovers without one
    else:
        strategy["parity"] = None
        strategy["checkpoint_backend"] = method
        checkpoint["every_n_train_steps"] = at_step
    path = workdir / f"{method}-{rows}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def measure(rows: int, dim: int, method: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Runs one drill and returns its timings (seconds) from the jobs' own timestamps."""
    os.environ[RENUMBER_ENV] = "0" if method == "parity-fresh" else "1"
    method = "parity" if method == "parity-fresh" else method
    config = job_config(rows, dim, method, args.at_step, args.at_step + args.after_steps, workdir)
    drill = chaos.parse_args(["--config", str(config), "--kill-node", "0", "--at-step", str(args.at_step),
                              "--replace", "--no-reference", "--workdir", str(workdir / f"{method}-{rows}")])
    started = time.time()
    run = chaos._faulted_run(drill)
    finished, events = run.finished, run.events
    if not finished:
        sys.exit(f"{method} at {rows} rows did not finish; logs in {drill.workdir}")
    output = "".join(log.read_text() for log in sorted((drill.workdir / "faulted").glob("node*.log")))
    first = {kind: next((e for e in events if e.kind == kind), None) for kind in ("fault_injected", "stopped", "resumed")}
    kill, resumed = first["fault_injected"].time, first["resumed"].time
    # every rank of a stopped job records "stopped" (with or without parity); nan if none got to it
    stopped = first["stopped"].time if first["stopped"] is not None else float("nan")
    if method == "parity":
        event = next(e for e in events if e.kind == "restored")
        at, decode, reshard = event.time, event["decode_s"], event["reshard_s"]
        restore = decode + reshard
        encoded = next(e for e in events if e.kind == "parity_encoded")
        encode, kept = encoded["encode_s"], "yes" if encoded["kept_parity"] else "no"
    else:
        event = next(e for e in events if e.kind == "fallback")
        at, restore = event.time, event["load_s"]
        decode = reshard = encode = float("nan")
        kept = "-"
        if event["steps_lost"] != 0:
            sys.exit(f"{method}: the checkpoint run lost {event['steps_lost']} steps; expected a checkpoint at the kill")
    return {
        "detect": stopped - kill,
        "restart": at - restore - (kill if stopped != stopped else stopped),  # from the kill when no "stopped"
        "decode": decode,
        "reshard": reshard,
        "restore": restore,
        "first_step": resumed - at,
        "encode": encode,
        "kept": kept,
        "total": resumed - kill,
        "step": float(_STEP_MS.findall(output)[-1]) / 1000,  # rank 0's mean step after the restart
        "wall": time.time() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[20_000, 100_000], help="rows per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["parity", "parity-fresh", "dcp", "torchsnapshot"])
    parser.add_argument("--at-step", type=int, default=8)
    parser.add_argument("--after-steps", type=int, default=12, help="steps trained after the kill")
    parser.add_argument("--quick", action="store_true", help="one small size")
    args = parser.parse_args()
    if args.quick:
        args.rows = [5_000]
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="bench_recovery_") as tmp:
        for rows in args.rows:
            results = {m: measure(rows, args.dim, m, args, Path(tmp)) for m in args.methods}
            rows_out.append((rows, results))
    emb_mib = {rows: 26 * rows * args.dim * 4 / 2**20 for rows, _ in rows_out}
    print(f"\nRecovery from a lost node: 2 nodes x 2 ranks (torchrun agents on 127.0.0.1, gloo, CPU), node 0 "
          f"SIGKILLed before step {args.at_step}, a replacement joins. 26 tables x {args.dim} columns, fp32, "
          "row-wise Adagrad. Seconds from the jobs' own timestamps.")
    header = (f"{'emb MiB':>8} {'method':<14} {'detect':>7} {'restart':>8} {'decode':>7} {'reshard':>8} "
              f"{'restore':>8} {'encode':>7} {'kept':>5} {'1st step':>9} {'total':>7} {'step':>6} {'restore x':>10} {'total x':>8} "
              f"{'lost/10':>8} {'lost/100':>9}")
    print(header)
    print("-" * len(header))
    for rows, results in rows_out:
        base = results.get("parity")
        for method, r in results.items():
            step_s = r["step"]
            restore_x = r["restore"] / base["restore"] if base else float("nan")
            total_x = r["total"] / base["total"] if base else float("nan")
            lost10 = r["total"] + (0 if method.startswith("parity") else 5 * step_s)
            lost100 = r["total"] + (0 if method.startswith("parity") else 50 * step_s)
            print(f"{emb_mib[rows]:>8.0f} {method:<14} {r['detect']:>7.2f} {r['restart']:>8.2f} {r['decode']:>7.3f} "
                  f"{r['reshard']:>8.3f} {r['restore']:>8.3f} {r['encode']:>7.3f} {r['kept']:>5} {r['first_step']:>9.2f} {r['total']:>7.2f} "
                  f"{step_s:>6.3f} {restore_x:>10.1f} {total_x:>8.2f} {lost10:>8.2f} {lost100:>9.2f}")
    print("restore x / total x: the method's restore / kill-to-resume time over parity's. lost/N: total plus the "
          "replay of N/2 steps that a checkpoint every N steps loses on average (parity: none).")
    for rows, results in rows_out:
        if "parity" in results and "dcp" in results:
            ratio = results["parity"]["restore"] / results["dcp"]["restore"]
            print(f"{emb_mib[rows]:.0f} MiB: parity restore / dcp restore = {ratio:.2f} "
                  f"(target <= 1: {'yes' if ratio <= 1 else 'NO'})")
        if "parity" in results and "parity-fresh" in results:
            kept, fresh = results["parity"], results["parity-fresh"]
            print(f"{emb_mib[rows]:.0f} MiB: renumbered nodes / torchrun's numbering: restore "
                  f"{kept['restore'] / fresh['restore']:.2f}x, encode {kept['encode'] / fresh['encode']:.2f}x, "
                  f"1st step {kept['first_step'] / fresh['first_step']:.2f}x")


if __name__ == "__main__":
    main()
