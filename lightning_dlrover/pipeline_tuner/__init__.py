"""Data pipeline tuning: an RL agent (and baselines) that set per-stage workers and prefetch of the staged TSV loader
(:mod:`lightning_dlrover.data.staged`)."""

from lightning_dlrover.pipeline_tuner.agent import Decision, RLTuner
from lightning_dlrover.pipeline_tuner.baselines import FixedTuner, GridSearchTuner, HillClimbTuner, default_grid
from lightning_dlrover.pipeline_tuner.callback import PipelineTuner
from lightning_dlrover.pipeline_tuner.harness import Trace, TunerDriver, run_ingestion
from lightning_dlrover.pipeline_tuner.observe import Budget, MemoryGuard, Observation

__all__ = ["Budget", "Decision", "FixedTuner", "GridSearchTuner", "HillClimbTuner", "MemoryGuard", "Observation", "PipelineTuner",
           "RLTuner", "Trace", "TunerDriver", "default_grid", "run_ingestion"]
