"""``lightning-dlrover advise``: the job history, and a configuration for a training config without training.

    lightning-dlrover advise                                  # list the user-wide job history
    lightning-dlrover advise --config configs/demo.yaml       # recommend resources for that job
    lightning-dlrover advise --config configs/demo.yaml --objective cost --target 20000 --nodes 1:4

The recommendation comes from the measurements of similar past jobs (warm start): the model is fitted on them
and every configuration of the search space is predicted. Nothing is trained. Without ``--history``, the history
is the one the config's ``ResourceAdvisor`` writes to (its ``history:``), else the user-wide one.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
from pathlib import Path

import yaml

from lightning_dlrover.advisor.control import restart_instructions
from lightning_dlrover.advisor.history import JobHistory, resolve_url
from lightning_dlrover.advisor.report import fit_errors, plot
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.restart import resume_program
from lightning_dlrover.advisor.signature import JobSignature, signature_of
from lightning_dlrover.advisor.warmstart import warm_start


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightning-dlrover advise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", default=None,
                        help="job history: 'user' ($LIGHTNING_DLROVER_HISTORY or ~/.cache/lightning_dlrover/"
                             "history.sqlite), a file path or an SQLAlchemy URL (default: the --config's ResourceAdvisor "
                             "history, else 'user')")
    parser.add_argument("--config", type=Path, default=None, help="a `lightning-dlrover fit` config to advise on")
    parser.add_argument("--list", type=int, default=20, metavar="N", help="list the newest N jobs (0: none)")
    parser.add_argument("--objective", choices=("throughput", "cost"), default="throughput")
    parser.add_argument("--target", type=float, default=None, help="samples/s to reach (objective cost)")
    parser.add_argument("--nodes", default=None, metavar="MIN:MAX", help="nodes the job may use (default: its own)")
    parser.add_argument("--workers", default="0", help="data workers per rank to consider, e.g. 0,1,2")
    parser.add_argument("--batches", default=None, help="per-rank batches to consider, e.g. 256,512 (default: the config's)")
    parser.add_argument("--min-similarity", type=float, default=0.3)
    parser.add_argument("--plot", type=Path, default=None, help="write the model's plot (PNG) here")
    args = parser.parse_args(argv)
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")
    if args.objective == "cost" and not args.target:
        parser.error("--objective cost needs --target SAMPLES_PER_SEC")
    return args


def list_jobs(history: JobHistory, limit: int) -> list[str]:
    """One line per job, newest first."""
    jobs = history.jobs(limit)
    lines = [f"job history {history.url}: {len(jobs)} most recent job(s)"]
    header = ["id", "started", "outcome", "model", "tables", "emb MB", "resources", "samples/s", "peak MB"]
    rows = []
    for j in jobs:
        sig = JobSignature.from_dict(j.signature) if j.signature and "tables" in j.signature else None
        res = ResourceConfig(**j.resources).short() if j.resources else "-"
        rows.append([str(j.id), datetime.datetime.fromtimestamp(j.started_at).strftime("%Y-%m-%d %H:%M"), j.outcome,
                     sig.model if sig else "-", str(len(sig.tables)) if sig else "-",
                     f"{sig.embedding_bytes / 2**20:.0f}" if sig else "-", res,
                     f"{j.samples_per_sec:.0f}" if j.samples_per_sec else "-",
                     f"{j.peak_rss_bytes / 2**20:.0f}" if j.peak_rss_bytes else "-"])
    if rows:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    return lines


def _section(config: dict, key: str) -> tuple[str | None, dict]:
    value = config.get(key) or {}
    if "class_path" in value:
        return value["class_path"], dict(value.get("init_args") or {})
    return None, dict(value)


def history_of_config(path: Path) -> tuple[str | None, str]:
    """The job history a LightningCLI config's ``ResourceAdvisor`` writes to, as an SQLAlchemy URL (``None`` when its
    ``history`` is null), and where that came from. ``run`` resolves under the config's ``trainer.default_root_dir``
    (relative to the working directory, as for ``fit``); a config without an advisor, or an advisor without
    ``history``, means ``user`` (the advisor's default)."""
    config = yaml.safe_load(path.read_text()) or {}
    trainer = config.get("trainer") or {}
    for callback in trainer.get("callbacks") or []:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).rpartition(".")[2] == "ResourceAdvisor":
            args = callback.get("init_args") or {}
            if "history" not in args:
                break
            if args["history"] is None:
                return None, f"{path}: ResourceAdvisor history: null"
            root = trainer.get("default_root_dir") or os.getcwd()
            return resolve_url(str(args["history"]), root), f"{path}: ResourceAdvisor history: {args['history']}"
    return resolve_url("user"), "user (the ResourceAdvisor's default)"


def job_from_config(path: Path, machine: Machine) -> tuple[JobSignature, ResourceConfig, list[str]]:
    """The signature and resources of the job a LightningCLI config describes (the model is built with its tables
    on the meta device: no memory, no training)."""
    config = yaml.safe_load(path.read_text()) or {}
    class_path, model_args = _section(config, "model")
    if class_path:
        module_name, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module_name), name)
    else:
        from lightning_dlrover.models import DLRMModule as cls
    model = cls(**model_args)
    trainer = config.get("trainer") or {}
    _, data = _section(config, "data")
    devices = trainer.get("devices", 1)
    devices = int(devices) if str(devices).isdigit() else machine.cores
    nodes = int(trainer.get("num_nodes", 1))
    global_batch = int(data.get("global_batch_size", 256 * devices * nodes))
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, machine.cores // devices))  # what Lightning sets
    current = ResourceConfig(nodes, devices, threads, int(data.get("num_workers", 0) or 0),
                             max(1, global_batch // (devices * nodes)))
    _, strategy = _section(trainer, "strategy") if isinstance(trainer.get("strategy"), dict) else (None, {})
    types = tuple(strategy.get("sharding_types") or ("table_wise",))
    program = ["-m", "lightning_dlrover", "fit", "--config", str(path)]
    return signature_of(model, global_batch, types, machine), current, program


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.history is not None:
        url: str | None = resolve_url(args.history)
    elif args.config is not None:
        url, origin = history_of_config(args.config)
        if url is None:
            print(f"lightning-dlrover advise: {origin}: the job keeps no history to advise from; give --history "
                  "(user, a file path or an SQLAlchemy URL).", file=sys.stderr)
            return 2
        print(f"job history from {origin}")
    else:
        url = resolve_url("user")
    try:
        history = JobHistory(url)
    except ValueError as err:
        print(f"lightning-dlrover advise: {err}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(list_jobs(history, args.list)))
    if args.config is None:
        return 0
    machine = Machine.detect()
    signature, current, program = job_from_config(args.config, machine)
    low, _, high = (args.nodes or f"{current.nodes}:{current.nodes}").partition(":")
    space = SearchSpace(nodes=(int(low), int(high or low)), data_workers=tuple(int(w) for w in args.workers.split(",")),
                        batch_per_rank=tuple(int(b) for b in args.batches.split(",")) if args.batches else None)
    found = warm_start(history, signature, current, space, machine, args.min_similarity, objective=args.objective,
                       target_samples_per_sec=args.target)
    print(f"\n{args.config}: {signature.model}, {len(signature.tables)} tables "
          f"({signature.embedding_bytes / 2**20:.0f} MB), global batch {signature.global_batch}; "
          f"now {current.short()} on {machine.cores} cores / {machine.memory_bytes / 2**30:.1f} GiB")
    print(found.message)
    rec = found.recommendation
    if rec is not None:
        for p in rec.candidates[:8]:
            mark = " <- recommended" if p.config == rec.best.config else " <- current" if p.config == current else ""
            print(f"  {p.config.short():>36}  {p.samples_per_sec:10.0f} samples/s predicted{mark}")
        print(f"recommended: {rec.best.config.short()} ({rec.gain:.2f}x the current configuration; {rec.reason})")
        if args.plot is not None:
            errors = fit_errors(found.model, found.observations)
            plot(args.plot, found.model, signature.shape(), machine.cores, found.observations, rec,
                 f"advise: {args.config.name}", errors, "similar past jobs' measurements")
            print(f"plot: {args.plot} ({len(found.observations)} measured configurations of similar past jobs; "
                  f"{errors.text()})")
    elif args.plot is not None:
        print(f"no plot: {found.message}")
    if found.config is not None:
        text = restart_instructions(current, found.config, [], resume_program(program, current, found.config))
        print(text or "the config already uses the recommended resources")
    return 0
