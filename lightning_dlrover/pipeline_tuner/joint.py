"""One decision for all ranks: how :class:`~lightning_dlrover.pipeline_tuner.callback.PipelineTuner` tunes at 2+ ranks.

The ranks of a job step together, so every rank's end-to-end rate is the job's: a trial on one rank's pipeline
changes the rate every other rank measures. Agents deciding per rank would each judge their own trials on a rate
the others' trials change too (and apply them at different steps). So the ranks tune as one:

- **Meetings by step.** Every ``min_batches`` batches (the same batches on every rank) the ranks meet: one
  ``all_gather_object`` on the control plane (:func:`lightning_dlrover.control_plane.group`) of each rank's
  window so far. Whether the window is complete is decided from the gathered windows, alike on every rank (the
  shortest window must have lasted ``window_s`` and ``min_batches``), so windows begin and end at the same step
  everywhere.
- **Rank 0 decides.** When a window closes, rank 0's tuner decides from the ranks' combined observation
  (:func:`combine`) and broadcasts the decision (``broadcast_object_list``); every rank applies it after the
  same batch. The other ranks hold a :class:`Follower`, which only keeps what rank 0 said.
- **Combined observation.** The rate is the *slowest* rank's: synchronous ranks move at the pace of the slowest
  one, so that is the rate a change must raise (a mean would let a fast rank hide a slowed one). The state
  (stage utilisation, the wait for data, the trainer's own time per sample) is of the rank that *waited longest
  for data*: its pipeline is the one holding the job back (the others wait for it inside the step's
  collectives, which counts as their trainer time). Memory is the largest rank's (the budget is per rank).
- **Fail soft, in step.** A rank whose tuner failed (an ``addon_failed`` event on that rank) keeps joining the
  meetings, as failed; at the first meeting that sees it, every other rank steps back too (``addon_failed``
  with ``error_type`` ``PeerFailed`` naming the failed ranks): the pipeline goes back on every rank to the
  configuration of the last meeting all ranks joined healthy, and tuning stops there on every rank. A failure of
  rank 0's decision is broadcast the same way. No rank waits for the process-group timeout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from lightning_dlrover import control_plane
from lightning_dlrover.data.staged import PipelineConfig
from lightning_dlrover.pipeline_tuner.agent import Decision
from lightning_dlrover.pipeline_tuner.observe import Observation


class PeerFailed(RuntimeError):
    """The tuner failed on another rank: it steps back on every rank at the same meeting."""


class Follower:
    """The tuner of a rank other than 0 at 2+ ranks: decides nothing, keeps what rank 0 decided."""

    def __init__(self, name: str, start: PipelineConfig, done: bool) -> None:
        # ``done`` is rank 0's tuner's from the start (a ``fixed`` tuner is done at once): whether a window closes
        # depends on it, so a follower that assumed otherwise would meet at other steps than rank 0 and hang.
        self.name, self.start, self.current = name, start, start
        self.done, self.kept_start = done, None

    def first(self) -> PipelineConfig:
        return self.start

    @property
    def best(self) -> PipelineConfig:
        return self.current

    def follow(self, config: PipelineConfig | None, done: bool, kept_start: bool | None) -> None:
        """Takes rank 0's decision."""
        self.current = config or self.current
        self.done, self.kept_start = done, kept_start

    def step(self, obs: Observation, worker_bytes: list[int] | None = None) -> Decision:
        raise RuntimeError("a Follower does not decide: rank 0's tuner does (lightning_dlrover.pipeline_tuner.joint)")


Window = tuple[Observation, list[int], int]  # observation, worker processes' bytes, batches


def combine(windows: list[Window]) -> tuple[Observation, list[int]]:
    """The job's observation from every rank's window (see the module docstring) and every worker's bytes."""
    observations = [w[0] for w in windows]
    held_back = max(observations, key=lambda o: o.wait_fraction)
    combined = dataclasses.replace(
        held_back, seconds=min(o.seconds for o in observations),
        samples_per_s=min(o.samples_per_s for o in observations),
        memory_bytes=max(o.memory_bytes for o in observations),
        batch_bytes=max(o.batch_bytes for o in observations))
    return combined, [b for w in windows for b in w[1]]


def closes(driver: Any, windows: list[Window]) -> bool:
    """Whether the window is complete on every rank (the same answer on every rank: it reads gathered values)."""
    return driver.closes(min(w[0].seconds for w in windows), min(w[2] for w in windows))


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (a collective on the control plane)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=control_plane.group())
    return out


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a collective on the control plane)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=control_plane.group())
    return box[0]


def failed_ranks(values: list[Any]) -> list[int]:
    """The ranks that joined a meeting as failed (sent ``None``)."""
    return [rank for rank, v in enumerate(values) if v is None]
