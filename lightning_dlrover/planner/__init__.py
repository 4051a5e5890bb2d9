"""The fault-tolerance planner: from a job's measured costs and a failure model, the expected goodput of
checkpoints only, parity with restart recovery and parity with in-process recovery, for each candidate setting
(``k``, ``r``, commit interval, checkpoint interval, hot spares), and the pick. Pure Python: no torch, no Lightning.

- :mod:`.failures`: rank and whole-machine failure rates, published defaults, ``--mtbf-hours``, observed failures;
- :mod:`.costs`: what each option costs this job (measured, from the history, or measured defaults);
- :mod:`.goodput`: the expected goodput of one setting (Young/Daly checkpoint interval);
- :mod:`.plan`: every candidate, the pick, the sweep over world sizes.
"""

from lightning_dlrover.planner.costs import MEASURED_HERE, JobCosts
from lightning_dlrover.planner.failures import FailureModel
from lightning_dlrover.planner.goodput import STRATEGIES, Candidate, Estimate, estimate, young_daly_interval
from lightning_dlrover.planner.plan import Plan, candidates, make_plan, sweep

__all__ = ["MEASURED_HERE", "STRATEGIES", "Candidate", "Estimate", "FailureModel", "JobCosts", "Plan", "candidates",
           "estimate", "make_plan", "sweep", "young_daly_interval"]
