"""The advisor's report says how good its model is truthfully (held-out error, or that there is too little data to
tell; an in-sample error is labelled as one), its plot has data in both panels, and its restart line always belongs
to the final recommendation."""

import lightning.pytorch as pl
import numpy as np

from lightning_dlrover.advisor.act import Actor
from lightning_dlrover.advisor.config import AdvisorConfig
from lightning_dlrover.advisor.model import JobShape, Observation, PerformanceModel
from lightning_dlrover.advisor.recommend import recommend
from lightning_dlrover.advisor.report import fit_errors, plot, plot_data, summary_table
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace

SHAPE = JobShape(table_loads=(16.0,) * 26, dense_params=20_000, embedding_bytes=2**24)
MACHINE = Machine(cores=8, memory_bytes=2**34)
CURRENT = ResourceConfig(1, 2, 1, 0, 128)


def measured(configs: list[ResourceConfig]) -> list[Observation]:
    """Step times of a known model, each off by a different few percent (as measurements are)."""
    truth = PerformanceModel()
    truth.train = np.array([2e-3, 4e-5, 1e-8, 1e-5, 1e-5, 1e-9, 1e-4, 1e-9, 1e-3])
    truth.make = np.array([1e-4, 1e-6, 1e-7])
    noise = [1.00, 1.12, 0.93, 1.05, 0.97, 1.09]
    return [Observation(c, SHAPE, 8.0, truth.predict(c, SHAPE, 8.0).step_s * noise[i % len(noise)])
            for i, c in enumerate(configs)]


def test_two_points_get_no_accuracy_claim():
    obs = measured([CURRENT, CURRENT.with_(threads_per_rank=2)])
    model = PerformanceModel().fit(obs)
    rec = recommend(model, SHAPE, MACHINE, CURRENT, SearchSpace(ranks_per_node=(2,)))
    errors = fit_errors(model, obs)
    assert errors.held_out is None and len(errors.in_sample) == 2
    table = summary_table(model, SHAPE, 8, obs, rec)
    first = table.splitlines()[0]
    assert "not enough data for a held-out error (2 measured" in first and "in-sample error" in first
    assert "is not accuracy" in first and "held-out err" not in table.splitlines()[1]
    data = plot_data(model, obs, rec)
    assert data.left_title.startswith("fit: not enough data") and "mean abs. error" not in data.left_title


def test_held_out_error_is_leave_one_out_over_the_measured_points(tmp_path):
    configs = [CURRENT.with_(threads_per_rank=t, batch_per_rank=b) for t in (1, 2, 4) for b in (64, 128)]
    past = measured([ResourceConfig(1, 1, 1, 0, 128), ResourceConfig(1, 4, 1, 0, 128)])
    obs = measured(configs)
    prior = PerformanceModel().fit(past)
    model = PerformanceModel(prior=prior).fit(obs + past)
    errors = fit_errors(model, obs)
    assert errors.held_out is not None and len(errors.held_out) == len(obs)
    for i, o in enumerate(obs):  # each point predicted by the model refitted without it (past points and prior kept)
        alone = PerformanceModel(prior=prior).fit(obs[:i] + obs[i + 1:] + past)
        expected = 100 * (alone.predict(o.config, SHAPE, 8.0).samples_per_sec - o.samples_per_sec) / o.samples_per_sec
        assert abs(errors.held_out[i] - expected) < 1e-6
    # held out is worse than in-sample on noisy points: the in-sample residual is not the accuracy
    assert np.mean(np.abs(errors.held_out)) > np.mean(np.abs(errors.in_sample))
    rec = recommend(model, SHAPE, MACHINE, CURRENT, SearchSpace(ranks_per_node=(2,), batch_per_rank=(64, 128)))
    table = summary_table(model, SHAPE, 8, obs, rec)
    assert f"held-out error {np.mean(np.abs(errors.held_out)):.1f}% (leave-one-out over 6" in table.splitlines()[0]
    assert "held-out err" in table.splitlines()[1]
    data = plot_data(model, obs, rec)
    assert len(data.measured) == len(data.predicted) == len(data.held_out) == 6  # left panel: three series
    assert len(data.candidates) == len(data.labels) >= 6 and len(data.measured_at) == 6  # right panel
    assert data.best_at is not None and data.current_at is not None and data.left_title.startswith("fit: held-out")
    assert plot(tmp_path / "m.png", model, SHAPE, 8, obs, rec).stat().st_size > 10_000


def test_report_has_no_restart_line_of_an_earlier_decision():
    obs = measured([CURRENT, CURRENT.with_(threads_per_rank=2), CURRENT.with_(threads_per_rank=4)])
    model = PerformanceModel().fit(obs)
    keep = recommend(model, SHAPE, MACHINE, CURRENT, SearchSpace(ranks_per_node=(2,), threads_per_rank=(1,)))
    assert not keep.changed
    table = summary_table(model, SHAPE, 8, obs, keep, restart="Restart needed for: nodes (...)")
    assert table.splitlines()[-1].startswith("recommended: keep 1x2 ranks, 1 thr") and "Restart" not in table


def test_actor_forgets_the_warm_starts_restart_when_the_profile_keeps(tmp_path):
    """The warm start recommends 2 nodes (a restart, printed), the profiling window then keeps the configuration:
    the actor's last decision, what the end-of-fit report prints, is no restart."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    actor = Actor(AdvisorConfig(history=None))
    actor.start(trainer, None)
    current = actor.current
    actor.act(trainer, current.with_(nodes=2), "warm_start", None, 0.0)
    assert actor.restart is not None and actor.restart_text.startswith("Restart needed for: nodes")
    actor.act(trainer, current, "profile", None, 0.0)
    assert actor.restart is None and actor.restart_text == ""
