"""Job traces for the simulator: the typed record of one job, and reading and checking a JSON-lines trace file.

A trace file has one JSON object per line (blank lines are skipped)::

    {"name": "j0", "arrival": 0, "work": 2.5, "batch_range": [64, 1024], "base_batch": 128, "max_ranks": 8}

``name`` (unique) and ``arrival`` (seconds, >= 0) are required; ``work`` (> 0, multiples of one profiled
training run; default 1), ``batch_range`` (``[min, max]`` global batches, 1 <= min <= max; default
``[64, 1024]``), ``base_batch`` (the batch the job's LR was tuned for, in its range; default 128) and
``max_ranks`` (>= 1; default 8) are optional; any other field is refused (a misspelt field would otherwise
silently take its default). :func:`read_trace` returns the jobs and every problem of the file, each a
:class:`TraceProblem` naming ``file:line``, what is wrong and the fix; :func:`check_fit` adds the problems of
jobs that a cluster of ``nproc_per_node``-device nodes cannot run at all.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, Any] = {"work": 1.0, "batch_range": (64, 1024), "base_batch": 128, "max_ranks": 8}
FIELDS = ("name", "arrival", "work", "batch_range", "base_batch", "max_ranks")
EXAMPLE = '{"name": "j0", "arrival": 0, "work": 1, "batch_range": [64, 1024], "base_batch": 128, "max_ranks": 8}'


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace: arrival time (s), size (``work``: multiples of one profiled training run), batch range,
    base batch (the batch its LR was tuned for, used by ``fixed``) and the most ranks it may use; ``where`` is
    the ``file:line`` it was read from ("" for a generated trace)."""

    name: str
    arrival: float
    work: float
    batch_range: tuple[int, int]
    base_batch: int
    max_ranks: int
    where: str = field(default="", compare=False)

    @property
    def place(self) -> str:
        """Where to point a user at: ``file:line``, or the job's name for a generated trace."""
        return self.where or f"job {self.name!r}"


@dataclass(frozen=True)
class TraceProblem:
    """One thing wrong with a trace or a run's settings: where (``file:line``, a file, a ``--flag``), what, the fix."""

    where: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}; {self.fix}"


class TraceError(ValueError):
    """A trace (or the settings it is run with) that cannot be simulated; ``problems`` lists every reason."""

    def __init__(self, problems: Sequence[TraceProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def _number(raw: dict, key: str, where: str, out: list[TraceProblem], minimum: float, strict: bool) -> float | None:
    value = raw.get(key, DEFAULTS.get(key))
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        out.append(TraceProblem(where, f"{key} {json.dumps(value)} is not a number", f"give {key} as a number {bound}"))
        return None
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        what = "seconds after the trace starts" if key == "arrival" else "multiples of one profiled run"
        out.append(TraceProblem(where, f"{key} {value} is out of range", f"{key} must be {bound} ({what})"))
        return None
    return float(value)


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, float) and value.is_integer() else None


def _batch_range(raw: dict, where: str, out: list[TraceProblem]) -> tuple[int, int] | None:
    value = raw.get("batch_range", DEFAULTS["batch_range"])
    fix = "give batch_range as [min, max] global batches with 1 <= min <= max, e.g. [64, 1024]"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        count = "is not a list"
        if isinstance(value, (list, tuple)):
            count = f"has {len(value)} item{'s' * (len(value) != 1)}"
        out.append(TraceProblem(where, f"batch_range {json.dumps(value)} {count}", fix))
        return None
    lo, hi = (_integer(v) for v in value)
    if lo is None or hi is None or lo < 1 or hi < 1:
        out.append(TraceProblem(where, f"batch_range {json.dumps(value)} is not two positive integers", fix))
        return None
    if lo > hi:
        out.append(TraceProblem(where, f"batch_range {json.dumps(value)} has min > max",
                                f"give the smallest global batch first: [{hi}, {lo}]"))
        return None
    return lo, hi


def parse_job(raw: Any, where: str, out: list[TraceProblem]) -> TraceJob | None:
    """The job of one decoded trace line, or None with its problems appended to ``out``."""
    if not isinstance(raw, dict):
        kind = {list: "a JSON list", str: "a JSON string"}.get(type(raw), f"JSON {json.dumps(raw)[:20]}")
        out.append(TraceProblem(where, f"the line is {kind}, not a JSON object", f"write the job as {EXAMPLE}"))
        return None
    before = len(out)
    for key in raw:
        if key not in FIELDS:
            near = difflib.get_close_matches(str(key), FIELDS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            out.append(TraceProblem(where, f"unknown field {key!r}", f"{hint}the fields are {', '.join(FIELDS)}"))
    name = raw.get("name")
    if "name" not in raw or not isinstance(name, str) or not name:
        got = "lacks field 'name'" if "name" not in raw else f"name {json.dumps(name)} is not a non-empty string"
        out.append(TraceProblem(where, f"the job {got}", 'give each job a unique "name": "..."'))
    if "arrival" not in raw:
        out.append(TraceProblem(where, "the job lacks field 'arrival'",
                                'give "arrival": seconds after the trace starts'))
        arrival = None
    else:
        arrival = _number(raw, "arrival", where, out, 0.0, strict=False)
    work = _number(raw, "work", where, out, 0.0, strict=True)
    batch_range = _batch_range(raw, where, out)
    base_batch, max_ranks = _integer(raw.get("base_batch", 128)), _integer(raw.get("max_ranks", 8))
    if base_batch is None or base_batch < 1:
        out.append(TraceProblem(where, f"base_batch {json.dumps(raw.get('base_batch'))} is not a positive integer",
                                "give base_batch, the global batch the job's LR was tuned for, e.g. 128"))
    elif batch_range and not batch_range[0] <= base_batch <= batch_range[1]:
        default = " (the default)" if "base_batch" not in raw else ""
        out.append(TraceProblem(where, f"base_batch {base_batch}{default} is outside batch_range "
                                       f"[{batch_range[0]}, {batch_range[1]}]",
                                f"give a base_batch in that range, or widen batch_range to include {base_batch}"))
    if max_ranks is None or max_ranks < 1:
        out.append(TraceProblem(where, f"max_ranks {json.dumps(raw.get('max_ranks'))} is not a positive integer",
                                "give max_ranks, the most ranks the job may use, e.g. 8"))
    if len(out) > before:
        return None
    return TraceJob(name, arrival, work, batch_range, base_batch, max_ranks, where)


def read_trace(path: str | Path) -> tuple[list[TraceJob], list[TraceProblem]]:
    """The jobs of the trace file at ``path`` (by arrival) and every problem found in it (empty when it is good)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        return [], [TraceProblem(str(path), f"cannot be read ({err.__class__.__name__}: {err})",
                                 "give a readable UTF-8 JSON-lines file")]
    jobs: list[TraceJob] = []
    problems: list[TraceProblem] = []
    first: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(TraceProblem(where, f"not a JSON object ({err.msg} at column {err.colno})",
                                         f"write one JSON object per line, e.g. {EXAMPLE}"))
            continue
        job = parse_job(raw, where, problems)
        name = raw.get("name") if isinstance(raw, dict) else None
        if isinstance(name, str) and name in first:
            problems.append(TraceProblem(where, f"job name {name!r} is also on line {first[name]}",
                                         "names must be unique: rename one of them"))
            continue
        if isinstance(name, str):
            first[name] = number
        if job is not None:
            jobs.append(job)
    if not jobs and not problems:
        problems.append(TraceProblem(str(path), "no jobs (the file has no non-blank line)",
                                     f"write one JSON object per line, e.g. {EXAMPLE}"))
    return sorted(jobs, key=lambda j: j.arrival), problems


def load_trace(path: str | Path) -> list[TraceJob]:
    """The jobs of the trace file at ``path`` (by arrival); :class:`TraceError` listing every problem if any."""
    jobs, problems = read_trace(path)
    if problems:
        raise TraceError(problems)
    return jobs


def check_fit(jobs: Iterable[TraceJob], nproc_per_node: int, batch_step: int,
              policies: Iterable[str] = ("fixed", "dp", "goodput")) -> list[TraceProblem]:
    """Problems of jobs no allocation can run: fewer ``max_ranks`` than a node's ``nproc_per_node`` devices, or no
    candidate batch (the base batch under ``fixed``; ``batch_step`` multiples in range otherwise) that one of the
    job's rank counts (multiples of ``nproc_per_node`` up to ``max_ranks``) divides. Duplicate names too."""
    problems, seen = [], set()
    policies = set(policies)
    for job in jobs:
        if job.name in seen:
            problems.append(TraceProblem(job.place, f"job name {job.name!r} is used twice",
                                         "names must be unique: rename one of them"))
        seen.add(job.name)
        ranks = list(range(nproc_per_node, job.max_ranks + 1, nproc_per_node))
        if not ranks:
            problems.append(TraceProblem(
                job.place, f"max_ranks {job.max_ranks} is below --nproc-per-node {nproc_per_node}: the job cannot "
                           "fill one node", f"raise max_ranks to {nproc_per_node} or more, or lower --nproc-per-node"))
            continue
        lo, hi = job.batch_range
        batches = sorted({lo, hi, *range(-(-lo // batch_step) * batch_step, hi + 1, batch_step)})
        if "fixed" in policies and not any(job.base_batch % r == 0 for r in ranks):
            problems.append(TraceProblem(
                job.place, f"base_batch {job.base_batch} is divisible by none of the job's rank counts {ranks}, so "
                           "the fixed policy can never run it", f"give a base_batch that is a multiple of {ranks[0]}"))
        if policies - {"fixed"} and not any(b % r == 0 for r in ranks for b in batches):
            problems.append(TraceProblem(
                job.place, f"no batch in batch_range [{lo}, {hi}] is divisible by one of the job's rank counts "
                           f"{ranks}", f"widen batch_range to include a multiple of {ranks[0]}"))
    return problems
