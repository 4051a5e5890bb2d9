"""A tuner's change of assemble workers applies live (issue #24): the driver's decisions move assemble between the
training process and worker processes while batches flow, and the batches stay exactly the loader's."""

import torch

from lightning_dlrover.data import CriteoTSV, ResumableLoader
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.pipeline_tuner.agent import Decision
from lightning_dlrover.pipeline_tuner.harness import TunerDriver

SIZES = [1000 + 17 * i for i in range(26)]
PLAN = [PipelineConfig(0, 1, 0, 1, 1), PipelineConfig(0, 1, 0, 3, 1), PipelineConfig(1, 1, 1, 0, 1),
        PipelineConfig(0, 0, 0, 2, 0)]


class Scripted:
    """Applies the configurations of PLAN one per window."""

    name, done, guard = "scripted", False, None

    def __init__(self) -> None:
        self.left = list(PLAN)

    def first(self) -> PipelineConfig:
        return self.left.pop(0)

    def step(self, obs, worker_bytes=None) -> Decision:
        return Decision(obs, self.left.pop(0) if self.left else None, "scripted", 0)


def test_a_tuner_moves_assemble_into_and_out_of_worker_processes_live(tmp_path):
    source = CriteoTSV(generate_days(tmp_path, 1, 1200, GeneratorConfig(max_vocab=20_000, seed=3)), SIZES)
    loader = PipelinedLoader(source, 0, 1, 60)
    driver = TunerDriver(loader, Scripted(), window_s=0.0, min_batches=1, settle_batches=1)
    got, seen = [], []
    for batch in loader:
        got.append(batch)
        seen.append((loader.config, len(loader.worker_pids())))
        driver.after_batch()
    want = list(ResumableLoader(source, 0, 1, 60))
    assert len(got) == len(want) and all(
        torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values()) for a, b in zip(got, want))
    # every configuration ran, with its processes: assemble workers make every staffed stage a process
    assert {c: n for c, n in seen} == {PLAN[0]: 2, PLAN[1]: 4, PLAN[2]: 2, PLAN[3]: 2}
    assert loader.stats.resets == 3 and loader.worker_pids() == []
