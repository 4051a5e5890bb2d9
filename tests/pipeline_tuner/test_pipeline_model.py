"""The calibrated pipeline model (bench/bench_pipeline_scale.py's ground) and the AUTOTUNE-style baseline on it."""

from lightning_dlrover.data.staged import PipelineConfig
from lightning_dlrover.pipeline_tuner import Budget
from lightning_dlrover.pipeline_tuner.baselines import AutotuneTuner
from lightning_dlrover.pipeline_tuner.model import Calibration, PipelineModel

CAL = Calibration(service_s={"read": 0.001, "parse": 0.04, "transform": 0.01, "assemble": 0.002},
                  ipc_s={"parse": 0.001, "transform": 0.001}, step_s=0.005, step_cores=1.0, worker_bytes=50 << 20,
                  batch_bytes=1 << 20, batch_size=1024, noise=0.0)


def test_a_parse_bound_pipeline_scales_with_parse_workers_until_the_cores_are_spent():
    model = PipelineModel(CAL, cores=16)
    rates = [model.rate(PipelineConfig(1, p, 2, 1, 2)) for p in (1, 2, 4, 8)]
    assert rates == sorted(rates) and rates[-1] > 3 * rates[0]
    # on 2 cores the same workers only share the trainer's cores: no gain from 4 to 8
    small = PipelineModel(CAL, cores=2)
    assert small.rate(PipelineConfig(1, 8, 2, 1, 2)) <= small.rate(PipelineConfig(1, 4, 2, 1, 2)) * 1.01
    # all inline is the serial chain: the step plus every stage
    assert abs(model.rate(PipelineConfig(0, 0, 0, 0, 0)) - 1 / (0.005 + 0.053)) < 1e-3


def test_autotune_gives_the_budget_to_the_costliest_stages_and_stops():
    model, budget = PipelineModel(CAL, cores=16), Budget(cpus=15, memory_bytes=8 << 30)
    tuner, config = AutotuneTuner(budget, ram_bytes=8 << 30), None
    config = tuner.first()
    for _ in range(6):
        decision = tuner.step(model.observe(config, 2.0))
        config = decision.config or config
    assert tuner.done and config.total_workers == 15
    assert config.parse == max(config.workers.values()) and config.parse >= 3 * config.transform >= 3


def test_assemble_in_processes_leaves_the_trainer_only_the_receive():
    """The product's chain (#24): with assemble in processes the consumer's serial chain is the step and the
    receive of assembled batches, and the stages before the first staffed one run in its processes."""
    cal = Calibration(**{**CAL.__dict__, "ipc_s": {"parse": 0.02, "transform": 0.01, "assemble": 0.001, "hop": 0.002}})
    model = PipelineModel(cal, cores=64)
    # all fused into 8 assemble processes: each batch costs them every stage plus one send
    assert abs(model.rate(PipelineConfig(0, 0, 0, 8, 0)) - 8 / (0.053 + 0.002)) < 1e-2
    # enough workers: the trainer's step and its receive are the cap, not the process stages' 30 ms of IPC
    assert abs(model.rate(PipelineConfig(0, 8, 3, 2, 0)) - 1 / (0.005 + 0.001)) < 1e-2
    threads = PipelineModel(Calibration(**{**cal.__dict__, "methods": {**cal.methods, "assemble": "thread"}}), 64)
    assert threads.rate(PipelineConfig(0, 8, 3, 2, 0)) < 1 / (0.005 + 0.03) + 1e-6


def test_a_trainer_that_fills_its_cores_pays_for_the_pipeline_work_it_cannot_overlap():
    """``barrier``: on 2 cores a step that keeps both busy is lengthened by the pipeline's work wherever it runs (the
    2-core measurements of #24: a prefetch thread or worker processes were slower than all inline); with cores to
    spare the same work overlaps the step and the term does nothing."""
    filling = Calibration(**{**CAL.__dict__, "step_s": 0.02, "step_cores": 2.0, "barrier": 1.0})
    two = PipelineModel(filling, cores=2)
    inline = two.rate(PipelineConfig(0, 0, 0, 0, 0))
    assert abs(inline - 1 / (0.02 + 0.053)) < 1e-3
    for config in (PipelineConfig(0, 0, 0, 0, 1), PipelineConfig(1, 1, 1, 1, 2), PipelineConfig(0, 2, 1, 0, 2)):
        assert two.rate(config) <= inline + 1e-9  # no setting hides the 53 ms of stage work behind the step
    without = PipelineModel(Calibration(**{**filling.__dict__, "barrier": 0.0}), cores=2)
    assert without.rate(PipelineConfig(0, 0, 0, 0, 1)) > 1.1 * inline  # processor sharing alone: a prefetch "helps"
    many = PipelineModel(Calibration(**{**filling.__dict__, "step_cores": 1.0}), cores=64)
    assert many.rate(PipelineConfig(1, 8, 2, 1, 2)) == PipelineModel(
        Calibration(**{**filling.__dict__, "step_cores": 1.0, "barrier": 0.0}), cores=64).rate(PipelineConfig(1, 8, 2, 1, 2))


def test_the_rl_agent_climbs_a_parse_bound_chain_on_many_cores_within_two_minutes():
    """bench/bench_pipeline_scale.py's question on its own ground: a trainer at a fast GPU's rate, 16 cores, the
    product's chain. The agent must end within 5% of the best setting a full grid finds, within 2 minutes of
    pipeline time (2 s windows, each change paying its rebuild), on most seeds."""
    from lightning_dlrover.pipeline_tuner import RLTuner

    cal = Calibration(service_s={"read": 0.0002, "parse": 0.0077, "transform": 0.0004, "assemble": 0.0001},
                      ipc_s={"assemble": 0.0009, "hop": 0.0011}, step_s=2048 / 2e6, step_cores=1.0,
                      worker_bytes=24 << 20, batch_bytes=540672, batch_size=2048, noise=0.025, barrier=0.9)
    model, budget = PipelineModel(cal, cores=16), Budget(cpus=15, memory_bytes=16 << 30)
    best = max(model.rate(PipelineConfig(r, p, t, a, q)) for r in range(3) for p in range(16) for t in range(16)
               for a in range(16) for q in (0, 1, 2) if r + p + t + a <= 15)
    reached = 0
    for seed in range(5):
        model.rng.seed(seed)
        tuner, config, t = RLTuner(budget, start=PipelineConfig(1, 1, 1, 1, 2), seed=seed), None, 0.0
        config = tuner.first()
        while t < 120:
            t += 2.0
            decision = tuner.step(model.observe(config, 2.0), [cal.worker_bytes] * 4)
            if decision.config is not None and decision.config != config:
                config, t = decision.config, t + model.reset_s(decision.config)
        reached += model.rate(config) >= 0.95 * best
    assert reached >= 4, reached
