"""The tuners' decision logic against a simple pipeline model (stage costs per sample, a core budget, memory per
worker process): the RL agent reaches the grid optimum, respects the CPU and memory budgets, and stops."""

import itertools

import pytest

from lightning_dlrover.data.staged import STAGES, PipelineConfig
from lightning_dlrover.pipeline_tuner import Budget, GridSearchTuner, HillClimbTuner, Observation, RLTuner
from lightning_dlrover.pipeline_tuner.agent import apply_action, shrink
from lightning_dlrover.pipeline_tuner.observe import MemoryGuard

COST = {"read": 0.5e-6, "parse": 12e-6, "transform": 4e-6, "assemble": 1e-6}  # seconds per sample per worker
WORKER_BYTES, BATCH_BYTES = 60 << 20, 1 << 20


class Model:
    """Throughput = the slowest stage (an inline stage counts as half a worker), capped by the cores."""

    def __init__(self, cores):
        self.cores = cores

    def throughput(self, c):
        stage = min(max(c.workers[s], 0.5) / COST[s] for s in STAGES)
        cpu = self.cores / sum(COST.values())
        return min(stage, cpu) * (1.0 if c.prefetch >= 2 else 0.9)

    def observe(self, c):
        rate = self.throughput(c)
        util = {s: rate * COST[s] / max(c.workers[s], 1) for s in STAGES}
        memory = (c.parse + c.transform) * WORKER_BYTES + (c.prefetch + 2) * BATCH_BYTES * 3
        return Observation(c, 2.0, rate, util, 0.5, 1.0, memory, BATCH_BYTES)


def run(tuner, model, steps=60):
    config, seen = tuner.first(), []
    for _ in range(steps):
        obs = model.observe(config)
        seen.append(obs)
        decision = tuner.step(obs, [WORKER_BYTES] * (config.parse + config.transform))
        config = decision.config or config
    return config, seen


def oracle(model, budget):
    grid = [PipelineConfig(r, p, t, a, q) for r, p, t, a, q in itertools.product(range(3), range(1, budget.cpus + 1),
            range(1, budget.cpus + 1), range(2), (1, 2, 4)) if r + p + t + a <= budget.cpus]
    guard = MemoryGuard(budget)
    guard.update(grid[0], [WORKER_BYTES], BATCH_BYTES)
    return max(model.throughput(c) for c in grid if guard.allows(c))


@pytest.mark.parametrize("cpus", [4, 8, 14])
def test_rl_reaches_the_optimum_within_budget_and_stops(cpus):
    budget, model = Budget(cpus=cpus, memory_bytes=4 << 30), Model(cores=cpus)
    tuner = RLTuner(budget, seed=1)
    final, seen = run(tuner, model)
    assert tuner.done
    assert model.throughput(final) >= 0.95 * oracle(model, budget)
    assert all(o.config.total_workers <= cpus for o in seen)
    first_good = next(i for i, o in enumerate(seen) if o.samples_per_s >= 0.95 * oracle(model, budget))
    # every kept change is measured interleaved with the configuration it replaces (2-3 pairs of windows)
    assert first_good <= 40  # windows: at 2 s each, under 80 s


def test_memory_budget_is_a_hard_limit():
    # Room for 3 worker processes (60 MB each, 69 MB with the guard's margin) but 12 cores.
    budget = Budget(cpus=12, memory_bytes=230 << 20)
    tuner = RLTuner(budget, seed=3, epsilon=0.6, decay=0.95)
    final, seen = run(tuner, Model(cores=12), steps=80)
    assert max(o.memory_bytes for o in seen) <= budget.memory_bytes
    assert final.parse + final.transform <= 3
    # The hill climber is bound by half the RAM, not the pipeline's budget: it goes beyond it.
    climb = HillClimbTuner(budget, ram_bytes=64 << 30)
    _, climbed = run(climb, Model(cores=12), steps=80)
    assert climb.done and max(o.memory_bytes for o in climbed) > budget.memory_bytes


def test_measured_memory_near_the_budget_sheds_workers():
    budget = Budget(cpus=8, memory_bytes=200 << 20)
    tuner = RLTuner(budget)
    config = PipelineConfig(1, 3, 2, 1, 4)
    obs = Observation(config, 2.0, 1000.0, {s: 0.5 for s in STAGES}, 0.5, 2.0, 198 << 20, BATCH_BYTES)
    decision = tuner.step(obs, [60 << 20] * 5)
    assert decision.config is not None and "memory guard" in decision.reason
    assert decision.config.parse + decision.config.transform < 5 and tuner.guard.allows(decision.config)


def test_actions_and_shrink():
    c = PipelineConfig(1, 2, 1, 0, 2)
    assert apply_action(c, ("move", "read", "parse")) == PipelineConfig(0, 3, 1, 0, 2)
    assert apply_action(c, ("move", "assemble", "parse")) is None
    assert apply_action(c, ("prefetch", -1)) == c.replace(prefetch=1)
    # fuse: a stage's workers join the next staffed stage, which then runs it too (no hand-over between them)
    assert apply_action(c, ("fuse", "read")) == PipelineConfig(0, 3, 1, 0, 2)
    assert apply_action(c, ("fuse", "parse")) == PipelineConfig(1, 0, 3, 0, 2)
    assert apply_action(c, ("fuse", "transform")) is None  # nothing staffed after it
    assert apply_action(c, ("fuse", "assemble")) is None
    guard = MemoryGuard(Budget(cpus=2, memory_bytes=1 << 30))
    # Over the CPU budget, the in-process stages go first: the parse stays in its own process.
    assert shrink(PipelineConfig(1, 1, 1, 1, 2), guard) == PipelineConfig(0, 1, 1, 0, 1)
    assert shrink(PipelineConfig(1, 1, 1, 1, 2), MemoryGuard(Budget(cpus=1, memory_bytes=1 << 30))) == \
        PipelineConfig(0, 1, 0, 0, 1)


def test_grid_search_measures_every_configuration_then_keeps_the_best():
    grid = [PipelineConfig(1, p, 1, 1, 2) for p in (1, 2, 3)]
    tuner = GridSearchTuner(grid)
    final, seen = run(tuner, Model(cores=16), steps=4)
    assert [o.config for o in seen[:3]] == grid and final == grid[-1] and tuner.done


class Contended:
    """Few cores, the trainer the bottleneck: the consumer never waits, but every pipeline thread or process takes
    a share of its cores (each worker +10% on the trainer's own time per sample, a prefetcher +5% a batch) and a
    stage run inline without a prefetcher runs in the trainer's thread (a third of its cost, the vectorised part)."""

    TRAIN_S = 20e-6

    def seconds_per_sample(self, c):
        inline = sum(COST[s] for s in STAGES if c.workers[s] == 0) / 3 if c.prefetch == 0 else 0.0
        return self.TRAIN_S * (1 + 0.1 * c.total_workers + 0.05 * min(c.prefetch, 2)) + inline

    def throughput(self, c):
        return 1 / self.seconds_per_sample(c)

    def observe(self, c):
        rate = self.throughput(c)
        util = {s: min(1.0, rate * COST[s] / max(c.workers[s], 1)) for s in STAGES}
        return Observation(c, 2.0, rate, util, 0.0, 1.0, (c.parse + c.transform) * WORKER_BYTES, BATCH_BYTES,
                           consumer_s_per_sample=self.seconds_per_sample(c))


def test_rl_judges_the_end_to_end_rate_when_the_trainer_never_waits():
    # The consumer waits 0% in every configuration: only the end-to-end rate (the trainer's own step time
    # included) tells them apart. The agent must leave the default for the least contended configuration.
    model, budget = Contended(), Budget(cpus=1, memory_bytes=4 << 30)
    grid = [PipelineConfig(r, p, t, a, q) for r, p, t, a, q in itertools.product(range(2), range(2), range(2),
            range(2), range(3))]
    best = max(model.throughput(c) for c in grid)
    tuner = RLTuner(budget, start=PipelineConfig(1, 1, 1, 1, 2), seed=0)
    final, seen = run(tuner, model, steps=60)
    assert tuner.done and not tuner.kept_start
    assert model.throughput(final) >= 0.95 * best > 1.2 * model.throughput(PipelineConfig(1, 1, 1, 1, 2))
    # never above the start's workers (it was above the 1-worker budget: the user's choice, not the agent's)
    assert all(o.config.total_workers <= 4 for o in seen)


@pytest.mark.parametrize("start", [PipelineConfig(0, 0, 0, 0, 1), PipelineConfig(0, 4, 2, 0, 2)])
def test_a_start_nothing_beats_is_kept(start):
    # Every change is worse (contended) or level (parse-bound at the CPU budget): the start stays, every trial is
    # undone, and the agent stops.
    model = Contended() if start.prefetch == 1 else Model(cores=6)
    tuner = RLTuner(Budget(cpus=6, memory_bytes=4 << 30), start=start, seed=0)
    final, seen = run(tuner, model, steps=40)
    assert final == start and tuner.done and tuner.kept_start
    assert seen[-1].config == start
