"""How often a training job loses ranks: independent rank failures and the correlated loss of a whole machine.

Two Poisson processes, per unit and per hour: a rank (one device and its process) fails on its own at
``1 / rank_mtbf_hours``, and a machine loses every one of its ranks at once at ``1 / machine_mtbf_hours``. A job of
``W`` ranks on ``M = ceil(W / ranks_per_machine)`` machines then sees rank failures at ``W / rank_mtbf_hours`` and
machine losses at ``M / machine_mtbf_hours``; its mean time between failures is the inverse of their sum.

Defaults (:data:`LLAMA3`), from Meta's report of Llama 3 405B pre-training ("The Llama 3 Herd of Models", 2024,
section 3.3.4): 419 unexpected interruptions in a 54-day window on 16,384 H100 GPUs (2,048 servers of 8), one
every 3.1 hours; 58.7% were GPU issues (faulty GPU 30.1%, HBM3 17.2%, SRAM 4.5%, the GPU's system processor 4.1%,
...), counted here as failures of one rank; the other 41.3% (network switch and cable 8.4%, host maintenance, NIC,
software, the host's CPU, memory, power, SSD) as the loss of a whole machine, the conservative reading. Hence
``rank_mtbf_hours = 16384 / (0.587 * 419 / 1296) = 86,300`` and ``machine_mtbf_hours = 2048 / (0.413 * 419 / 1296)
= 15,300``. ``--mtbf-hours`` (:meth:`FailureModel.from_job_mtbf`) or a job history's observed failures
(:meth:`FailureModel.from_observed`) replace them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Llama 3 405B pre-training (Meta, 2024): interruptions, days, GPUs, GPUs per server, share of GPU (one-rank) causes.
LLAMA3_REPORT = {"unexpected_interruptions": 419, "days": 54, "gpus": 16384, "gpus_per_server": 8, "gpu_share": 0.587}


def _positive(name: str, value: float, unit: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive finite number{unit}.")
    return float(value)


@dataclass(frozen=True)
class FailureModel:
    """Failure rates of ranks and machines (see the module docs).

    Args:
        rank_mtbf_hours: mean hours between failures of one rank on its own.
        machine_mtbf_hours: mean hours between losses of one whole machine (all its ranks at once);
            ``math.inf``: machines are never lost whole.
        ranks_per_machine: ranks a machine holds (a machine loss takes this many).
        source: where the rates come from (printed with a plan).
    """

    rank_mtbf_hours: float
    machine_mtbf_hours: float = math.inf
    ranks_per_machine: int = 8
    source: str = "given"

    def __post_init__(self) -> None:
        _positive("rank_mtbf_hours", self.rank_mtbf_hours, " (hours)")
        if self.machine_mtbf_hours != math.inf:
            _positive("machine_mtbf_hours", self.machine_mtbf_hours, " (hours), or inf")
        if isinstance(self.ranks_per_machine, bool) or not isinstance(self.ranks_per_machine, int) or \
                self.ranks_per_machine < 1:
            raise ValueError(f"ranks_per_machine={self.ranks_per_machine!r} must be an integer >= 1.")

    @classmethod
    def published(cls, ranks_per_machine: int = 8) -> FailureModel:
        """The defaults of the module docs (Llama 3 405B pre-training)."""
        report = LLAMA3_REPORT
        per_hour = report["unexpected_interruptions"] / (24.0 * report["days"])
        servers = report["gpus"] / report["gpus_per_server"]
        return cls(rank_mtbf_hours=report["gpus"] / (report["gpu_share"] * per_hour),
                   machine_mtbf_hours=servers / ((1 - report["gpu_share"]) * per_hour),
                   ranks_per_machine=ranks_per_machine, source="Llama 3 405B pre-training report (Meta, 2024)")

    @classmethod
    def from_job_mtbf(cls, mtbf_hours: float, world_size: int, ranks_per_machine: int = 8,
                      machine_share: float | None = None) -> FailureModel:
        """Rates such that a job of ``world_size`` ranks fails once every ``mtbf_hours``, a ``machine_share`` of
        its failures whole machines (default: the published share; ``0``: ranks only, as ``chaos`` kills)."""
        _positive("mtbf_hours", mtbf_hours, " (hours): the job's mean time between failures, e.g. --mtbf-hours 24")
        world_size = _world(world_size)
        share = 1 - LLAMA3_REPORT["gpu_share"] if machine_share is None else machine_share
        if not 0 <= share < 1:
            raise ValueError(f"machine_share={machine_share!r} must be in [0, 1).")
        machines = math.ceil(world_size / ranks_per_machine)
        rate = 1.0 / mtbf_hours
        return cls(rank_mtbf_hours=world_size / ((1 - share) * rate),
                   machine_mtbf_hours=machines / (share * rate) if share > 0 else math.inf,
                   ranks_per_machine=ranks_per_machine, source=f"job MTBF {mtbf_hours:g} h at {world_size} ranks")

    @classmethod
    def from_observed(cls, failures: int, rank_hours: float, ranks_per_machine: int = 8,
                      prior: FailureModel | None = None) -> FailureModel:
        """Rank failures observed over ``rank_hours`` of running ranks (a job history's), as one rank's MTBF; machine
        losses keep ``prior``'s rate (default: the published one). With no failure observed, ``prior`` stays unless
        the exposure alone already bounds the MTBF below it (the observed time is then a lower bound, kept)."""
        prior = prior or cls.published(ranks_per_machine)
        _positive("rank_hours", rank_hours, " (hours of ranks running)")
        if failures < 0:
            raise ValueError(f"failures={failures!r} must be >= 0.")
        if failures == 0:
            return prior
        return cls(rank_mtbf_hours=rank_hours / failures, machine_mtbf_hours=prior.machine_mtbf_hours,
                   ranks_per_machine=ranks_per_machine,
                   source=f"job history: {failures} failure(s) in {rank_hours:.1f} rank-hours")

    def machines(self, world_size: int) -> int:
        return math.ceil(_world(world_size) / self.ranks_per_machine)

    def rank_rate(self, world_size: int) -> float:
        """Rank failures per hour of a job of ``world_size`` ranks."""
        return _world(world_size) / self.rank_mtbf_hours

    def machine_rate(self, world_size: int) -> float:
        """Whole-machine losses per hour of a job of ``world_size`` ranks."""
        return self.machines(world_size) / self.machine_mtbf_hours

    def job_mtbf_hours(self, world_size: int) -> float:
        """Mean hours between failures of any kind of a job of ``world_size`` ranks."""
        return 1.0 / (self.rank_rate(world_size) + self.machine_rate(world_size))


def _world(world_size: int) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size {world_size!r} must be an integer >= 1 (ranks).")
    return world_size
