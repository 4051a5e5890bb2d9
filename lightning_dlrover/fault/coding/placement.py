"""Where the parity of every rank's embedding state lives: a (k, r) code rotated over the ranks.

The ranks are placed on a ring that alternates between nodes: position ``p`` holds local rank ``p // N``
of node ``p mod N`` (``N`` nodes of ``L`` ranks; ``torchrun`` numbers the ranks of a node contiguously).
Every rank's coded state (its embedding shards and their optimizer state, as bytes) is cut into ``k``
equal chunks. Chunk ``c`` of the rank at position ``i`` is data shard ``c`` of parity group ``g = (i - c) mod W``.
Group ``g`` has data shards at positions ``g, g+1, ..., g+k-1`` and parity shard ``p`` (code shard id
``k + p``) at position ``g + k + p`` (all mod ``W``). With ``k + r <= W`` the ``k + r`` members of a group are
distinct ranks, so losing any ``r`` ranks loses at most ``r`` shards of each group; a group has at most
``ceil((k + r) / N)`` members on one node, so a whole node is recoverable when that is ``<= r``. Every rank
holds exactly ``r`` parity chunks, ``r / k`` of its own state: no rank is a parity-only server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass
class ParityConfig:
    """Erasure coding of the embedding state: any ``r`` lost ranks are recoverable; parity costs ``r / k`` memory.

    Args:
        k: data chunks per parity group (each rank's state is cut into ``k`` chunks).
        r: parity chunks per group (ranks that may be lost at once); ``r == 1`` is plain XOR.
        commit_every_n_steps: commit once every ``N`` steps: a row touched several times in the window sends
            one delta, and a failure resumes at the last commit (at most ``N - 1`` steps are trained again).
        overlap: a commit's deltas travel while Lightning fetches the next batch (and runs epoch-end hooks); the
            commit is decided (deltas folded in, the vote) just before the next step's forward. The recovery
            point is the same as without overlap: the last step every rank voted for (so between a step's end and
            the next forward, ``committed_step`` is one behind ``global_step``). ``False``: the whole commit runs
            at the end of its step.
    """

    k: int = 2
    r: int = 1
    commit_every_n_steps: int = 1
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.k < 1 or self.r < 1:
            raise ValueError(f"parity needs k >= 1 and r >= 1, got ParityConfig(k={self.k}, r={self.r}).")
        if isinstance(self.commit_every_n_steps, bool) or not isinstance(self.commit_every_n_steps, int) or \
                self.commit_every_n_steps < 1:
            raise ValueError(
                f"parity.commit_every_n_steps={self.commit_every_n_steps!r} must be an integer >= 1 (1: every step)."
            )
        if not isinstance(self.overlap, bool):
            raise ValueError(f"parity.overlap={self.overlap!r} must be true or false.")

    @classmethod
    def auto(cls, world_size: int, state_bytes: float, step_s: float, ranks_per_machine: int = 8,
             mtbf_hours: float | None = None, measured: dict[str, float] | None = None) -> ParityConfig | None:
        """The fault-tolerance planner's pick for a job (:func:`lightning_dlrover.planner.plan.plan_job`): the
        ``(k, r, commit_every_n_steps)`` of the highest expected goodput, or ``None`` when checkpoints alone do
        better. ``ValueError`` for a world size parity cannot cover or a job with no embedding state."""
        from lightning_dlrover.planner.plan import plan_job

        best = plan_job(world_size, state_bytes, step_s, ranks_per_machine, mtbf_hours, measured=measured).best
        c = best.candidate
        return None if c.strategy == "checkpoint" else cls(c.k, c.r, c.commit_every)

    @classmethod
    def from_option(cls, value: ParityConfig | dict | str | None) -> ParityConfig | str | None:
        """The strategy's ``parity`` option: a config, its fields as a dict (YAML), ``"auto"`` (the planner picks at
        start, :meth:`auto`) or ``None`` (off)."""
        if isinstance(value, str):
            if value != "auto":
                raise ValueError(f"parity={value!r}: use 'auto', a mapping (k, r, commit_every_n_steps, overlap) or null.")
            return value
        return cls(**value) if isinstance(value, dict) else value

    @classmethod
    def parse(cls, text: str) -> ParityConfig:
        """``"k,r[,commit_every_n_steps[,overlap 0|1]]"`` (a command-line form), e.g. ``"2,1"`` or ``"2,1,16,0"``."""
        try:
            numbers = [int(x) for x in text.split(",")]
            if not 2 <= len(numbers) <= 4 or (len(numbers) == 4 and numbers[3] not in (0, 1)):
                raise ValueError
        except ValueError:
            raise ValueError(f"parity {text!r} is not k,r[,commit_every_n_steps[,overlap 0|1]] (e.g. 2,1 or 2,1,16,0).")
        return cls(*numbers[:3], *(bool(n) for n in numbers[3:]))


@dataclass(frozen=True)
class ParityPlacement:
    """Rotated placement of a systematic ``(k, r)`` code over ``world_size`` ranks (groups are numbered 0..W-1),
    ``local_world_size`` ranks per node."""

    world_size: int
    k: int
    r: int
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.k < 1 or self.r < 1:
            raise ValueError(f"parity needs k >= 1 and r >= 1, got ParityConfig(k={self.k}, r={self.r}).")
        if self.k + self.r > self.world_size:
            raise ValueError(
                f"ParityConfig(k={self.k}, r={self.r}) needs k + r = {self.k + self.r} distinct ranks per parity "
                f"group, but the world size is {self.world_size}. Lower k or r, or add ranks."
            )

    @cached_property
    def nodes(self) -> int:
        """Nodes of the ring (1 when ``local_world_size`` does not divide the world size)."""
        return self.world_size // self.local_world_size if self.world_size % self.local_world_size == 0 else 1

    @cached_property
    def _rank_at(self) -> list[int]:
        local = self.world_size // self.nodes
        return [(p % self.nodes) * local + p // self.nodes for p in range(self.world_size)]

    @cached_property
    def _position(self) -> dict[int, int]:
        return {rank: p for p, rank in enumerate(self._rank_at)}

    @property
    def tolerates_node_loss(self) -> bool:
        """Whether losing every rank of one node loses at most ``r`` members of each group."""
        return self.nodes > 1 and math.ceil((self.k + self.r) / self.nodes) <= self.r

    def data_rank(self, group: int, position: int) -> int:
        """Rank that holds data shard ``position`` (0..k-1) of ``group``."""
        return self._rank_at[(group + position) % self.world_size]

    def parity_rank(self, group: int, index: int) -> int:
        """Rank that holds parity shard ``index`` (0..r-1, code shard id ``k + index``) of ``group``."""
        return self._rank_at[(group + self.k + index) % self.world_size]

    def group_of_chunk(self, rank: int, chunk: int) -> int:
        """Group whose data shard ``chunk`` is chunk ``chunk`` of ``rank``'s state."""
        return (self._position[rank] - chunk) % self.world_size

    def parity_held(self, rank: int) -> list[tuple[int, int]]:
        """``(group, index)`` of the ``r`` parity chunks stored on ``rank``, in index order."""
        return [((self._position[rank] - self.k - index) % self.world_size, index) for index in range(self.r)]

    def members(self, group: int) -> list[int]:
        """Ranks of ``group`` by code shard id: ``k`` data ranks, then ``r`` parity ranks."""
        return [self.data_rank(group, c) for c in range(self.k)] + [self.parity_rank(group, p) for p in range(self.r)]

    def decode_plan(self, lost: list[int]) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """``(lost rank, chunk, [(source rank, code shard id)] * k)`` for every data chunk of the ``lost`` ranks.

        A data shard ``c`` of a group is chunk ``c`` of its data rank; a parity shard ``k + p`` is parity row
        ``p`` of its parity rank. Sources are the group's first ``k`` members that are not lost.
        """
        plan = []
        for rank in lost:
            for chunk in range(self.k):
                members = self.members(self.group_of_chunk(rank, chunk))
                plan.append((rank, chunk, [(m, shard) for shard, m in enumerate(members) if m not in lost][: self.k]))
        return plan
