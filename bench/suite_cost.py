"""Where the test suite's time goes: runs pytest on each test file given, one after another, and prints per file its
wall time, the CPU seconds of every process it started, how many Python interpreters started (each a fresh import of
whatever it uses) and how many of those imported torch, TorchRec and Lightning, with the CPU that those imports cost.

    PYTHONPATH=. python bench/suite_cost.py tests/strategy/test_checkpoint.py tests/fault/test_coded_embeddings.py

How: ``bench/suite_cost_hook/sitecustomize.py`` is put first on every interpreter's path (``PYTHONPATH``) and logs
each interpreter's start and its own CPU at exit (see its docstring); ``--log-dir`` keeps the logs. The import cost
per interpreter is measured first, the same way (``python -c "import torchrec, lightning.pytorch,
lightning_dlrover.strategy"``, the best of three). CPU seconds are less sensitive to a shared machine's load than wall
seconds; a process killed by a signal is missing from the CPU column (the ``killed`` column counts interpreters that
started and wrote no end line); its CPU is then the last seen by sampling the process tree every 0.25 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "bench" / "suite_cost_hook"
IMPORTS = "import torchrec, lightning.pytorch, lightning_dlrover.strategy"


def _env(log: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["SUITE_COST_LOG"] = str(log)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _lines(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def import_cpu(log_dir: Path, repeats: int = 3) -> float:
    """CPU seconds of one interpreter importing torch, TorchRec, Lightning and the strategy (best of ``repeats``)."""
    best = float("inf")
    for i in range(repeats):
        log = log_dir / f"imports{i}.jsonl"
        subprocess.run([sys.executable, "-c", IMPORTS], env=_env(log), check=True)
        ends = [line for line in _lines(log) if line["kind"] == "end"]
        best = min(best, ends[0]["cpu"])
    return best


def measure(test_file: str, log_dir: Path, pytest_args: list[str]) -> dict:
    log = log_dir / (test_file.replace("/", "_") + ".jsonl")
    log.unlink(missing_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args,
                                 test_file], env=_env(log), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
        sampled = sample_tree(proc)
        out.seek(0)
        output = out.read()
    wall = time.monotonic() - start
    lines = _lines(log)
    starts = {line["pid"]: line for line in lines if line["kind"] == "start"}
    ends = [line for line in lines if line["kind"].startswith("end")]
    ended = {line["pid"] for line in ends if line["kind"] == "end"}
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    heavy = [line for line in ends if line["kind"] == "end" and line["torch"] and line["lightning"]]
    # a launcher's zygote imports them too, and is killed (no end line) once it has forked the ranks
    heavy += [line for pid, line in starts.items() if pid not in ended and "zygote import main" in line["argv"]]
    cpu = {line["pid"]: line["cpu"] for line in ends}
    for pid, seen in sampled.items():  # a process killed by a signal (or never ending in the hook) at its last sample
        cpu[pid] = max(cpu.get(pid, 0.0), seen)
    return {
        "file": test_file, "wall": wall, "cpu": sum(cpu.values()), "output": output, "rc": proc.returncode,
        "starts": len(starts), "heavy_starts": len(heavy), "forks": sum(line["kind"] == "end-fork" for line in ends),
        "killed": len(set(starts) - ended), "summary": summary,
        "per_test": Counter(line["test"].split("::")[-1] for line in starts.values() if line["test"]),
    }


def sample_tree(proc: subprocess.Popen, every: float = 0.25) -> dict[int, float]:
    """Until ``proc`` ends: the last CPU seconds seen of ``proc`` and each of its descendants, by pid."""
    seen: dict[int, float] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                t = p.cpu_times()
                seen[p.pid] = max(seen.get(p.pid, 0.0), t.user + t.system)
            except psutil.Error:
                continue
        time.sleep(every)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--log-dir", default=None, help="keep the per-process logs here (default: a temporary folder)")
    parser.add_argument("--per-test", action="store_true", help="also print interpreter starts per test")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = parser.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="suite_cost_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    per_import = import_cpu(log_dir)
    print(f"one interpreter importing torch + TorchRec + Lightning + the strategy: {per_import:.2f} CPU s")
    print(f"logs: {log_dir}")
    rows = []
    for test_file in args.files:
        row = measure(test_file, log_dir, args.pytest_args.split())
        rows.append(row)
        print(f"  {test_file}: {row['summary']} ({row['wall']:.0f} s)", flush=True)
        if row["rc"] not in (0, 5):
            print(row["output"][-3000:])
    print()
    print("| file | wall s | CPU s | interpreters | with torch+Lightning | imports CPU s | share | forks | killed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in sorted(rows, key=lambda r: -r["cpu"]):
        imports = row["heavy_starts"] * per_import
        share = imports / row["cpu"] if row["cpu"] else 0.0
        print(f"| {row['file']} | {row['wall']:.0f} | {row['cpu']:.0f} | {row['starts']} | {row['heavy_starts']} | "
              f"{imports:.0f} | {share:.0%} | {row['forks']} | {row['killed']} |")
    total_cpu = sum(r["cpu"] for r in rows)
    total_imports = sum(r["heavy_starts"] for r in rows) * per_import
    print(f"| total | {sum(r['wall'] for r in rows):.0f} | {total_cpu:.0f} | {sum(r['starts'] for r in rows)} | "
          f"{sum(r['heavy_starts'] for r in rows)} | {total_imports:.0f} | "
          f"{(total_imports / total_cpu if total_cpu else 0):.0%} | | |")
    if args.per_test:
        for row in rows:
            print(f"\n{row['file']}: interpreter starts per test")
            for test, count in row["per_test"].most_common():
                print(f"  {count:3d}  {test}")


if __name__ == "__main__":
    main()
