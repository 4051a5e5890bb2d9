"""Data pipeline tuning: an RL agent (and baselines) that set per-stage workers and prefetch of the TSV pipeline."""

from lightning_dlrover.pipeline.agent import Decision, RLTuner
from lightning_dlrover.pipeline.callback import PipelineTuner
from lightning_dlrover.pipeline.baselines import FixedTuner, GridSearchTuner, HillClimbTuner, default_grid
from lightning_dlrover.pipeline.harness import Trace, TunerDriver, run_ingestion
from lightning_dlrover.pipeline.observe import Budget, MemoryGuard, Observation

__all__ = ["Budget", "Decision", "FixedTuner", "GridSearchTuner", "HillClimbTuner", "MemoryGuard", "Observation", "PipelineTuner",
           "RLTuner", "Trace", "TunerDriver", "default_grid", "run_ingestion"]
