"""The trace-driven simulator: deterministic for a seed, policies, traces, node losses, cluster actions, CLI."""

import json
from pathlib import Path

import pytest

from lightning_dlrover.cli.simulate import cluster_actions, main
from lightning_dlrover.elastic import profile as profile_module
from lightning_dlrover.elastic.profile import Profile
from lightning_dlrover.elastic.simulator import (
    Decision, TraceJob, bursty_trace, node_loss_schedule, simulate, synthetic_trace,
)
from lightning_dlrover.elastic.trace import TraceError, load_trace

# curves of the shape measured on our DLRM: per-step overhead, samples needed growing with the batch
PROFILE = Profile({16: 0.02, 128: 0.025, 1024: 0.06}, 0.002, {64: 3e4, 128: 3.4e4, 256: 4.5e4, 512: 7e4, 1024: 1.2e5},
                  128, {})


def test_profile_curves():
    assert PROFILE.efficiency(128) == 1.0 and PROFILE.efficiency(1024) == pytest.approx(3.4e4 / 1.2e5)
    assert PROFILE.samples_needed(181) == pytest.approx((3.4e4 * 4.5e4) ** 0.5, rel=0.01)  # log-log midpoint
    assert PROFILE.throughput(4, 512) > PROFILE.throughput(4, 128)
    assert PROFILE.step_time(128, 1) < PROFILE.step_time(128, 4)  # all-reduce cost


def test_deterministic_for_a_seed_and_different_across_seeds():
    for make in (synthetic_trace, bursty_trace):
        a, b = make(30, seed=3), make(30, seed=3)
        assert a == b and a != make(30, seed=4)
        losses = node_loss_schedule(3, 2000, 300, 200, 2)
        runs = [simulate(a, PROFILE, "goodput", 16, 2000, node_losses=losses) for _ in range(2)]
        assert runs[0] == runs[1]


def test_policies_use_their_batches():
    trace = [TraceJob("a", 0.0, 20.0, (64, 1024), 128, 8)]
    fixed = simulate(trace, PROFILE, "fixed", 8, 1e5)
    dp = simulate(trace, PROFILE, "dp", 8, 1e5)
    good = simulate(trace, PROFILE, "goodput", 8, 1e5)
    assert {d.global_batch for d in fixed.decisions if d.ranks} == {128}
    assert max(d.global_batch for d in dp.decisions) == 1024  # DP believes a larger batch costs no samples
    assert fixed.completed == dp.completed == good.completed == 1
    # goodput maximises true progress, so it finishes a lone job no later than either
    assert good.mean_jct_s <= min(fixed.mean_jct_s, dp.mean_jct_s) + 1e-6
    with pytest.raises(ValueError, match="unknown"):
        simulate(trace, PROFILE, "fastest", 8, 10)


def test_node_loss_reduces_capacity_and_restarts_are_paid():
    trace = synthetic_trace(20, seed=1, interarrival_s=5)
    calm = simulate(trace, PROFILE, "goodput", 8, 3000, restart_s=5)
    lossy = simulate(trace, PROFILE, "goodput", 8, 3000, restart_s=5,
                     node_losses=[(10.0, -4), (2000.0, 4)])
    assert calm.completed == lossy.completed == 20
    for run in (calm, lossy):
        assert run.restarts == sum(1 for d in run.decisions if d.ranks)
    assert all(d.ranks <= 4 for d in lossy.decisions if 10.0 <= d.time < 2000.0)


def test_trace_file_cluster_actions_and_cli(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"name": f"j{i}", "arrival": 10.0 * i, "work": 1, "max_ranks": 4})
                              for i in range(5)))
    trace = load_trace(path)
    assert [j.name for j in trace] == ["j0", "j1", "j2", "j3", "j4"] and trace[0].batch_range == (64, 1024)
    (tmp_path / "bad.jsonl").write_text('{"arrival": 1}\n')
    with pytest.raises(TraceError, match="bad.jsonl:1: the job lacks field 'name'"):
        load_trace(tmp_path / "bad.jsonl")
    action = cluster_actions(Decision(1.0, "j0", 4, 256), TraceJob("j0", 0, 1, (64, 512), 128, 8), 2)
    assert action["torchrun"].startswith("torchrun --nnodes 2 --nproc-per-node 2")  # the 4 ranks decided
    assert action["pytorchjob"]["spec"]["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 4}
    assert action["pytorchjob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert action["elasticjob"]["spec"]["replicaSpecs"]["worker"]["replicas"] == 2
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"step_s": PROFILE.step_s, "allreduce_s": PROFILE.allreduce_s,
                                   "samples_to_target": PROFILE.samples_to_target, "base_batch": 128}))
    out = tmp_path / "r.json"
    assert main(["--trace", str(path), "--profile", str(profile), "--devices", "8", "--horizon", "5000",
                 "--plot", str(tmp_path / "p.png"), "--json", str(out), "--decisions", str(tmp_path / "d.jsonl")]) == 0
    results = json.loads(out.read_text())
    assert [r["policy"] for r in results] == ["fixed", "dp", "goodput"] and all(r["completed"] == 5 for r in results)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert all(json.loads(line)["ranks"] <= 4 for line in (tmp_path / "d.jsonl").read_text().splitlines())


def test_shipped_profile_is_a_measurement():
    profile = Profile.load()
    # measured by the profile command line (lightning_dlrover.elastic.profile before it moved into cli/)
    assert profile.meta["command"].startswith(("python -m lightning_dlrover.cli.profile",
                                               "python -m lightning_dlrover.elastic.profile"))
    raw = json.loads((Path(profile_module.__file__).with_name("dlrm_profile.json")).read_text())
    seeds = profile.meta["seeds"]
    assert len(seeds) >= 3 and profile.meta["warmup_steps"] > 0
    for key, curve in profile.meta["curves"].items():  # each seed's samples to the target follow from its curve
        batch, seed = map(int, key.split("/"))
        target = profile.meta["targets"][str(seed)]
        hit = next((seen for seen, loss in curve if seen > 0 and loss <= target), None)
        assert raw["samples_to_target_seeds"][str(batch)][seeds.index(seed)] == hit
    for batch, hits in raw["samples_to_target_seeds"].items():  # the median, censored where half or more are
        reached = sorted(h for h in hits if h is not None)
        if 2 * len(reached) <= len(hits):
            assert int(batch) in profile.censored
        else:
            assert profile.samples_to_target[int(batch)] >= reached[0]
    assert profile.samples_needed(1024) >= profile.samples_needed(128)


def test_censored_batches_are_lower_bounds_not_clamped_flat(tmp_path):
    """A profile whose batches 512 and 1024 never reached the target (censored at 73,728 samples): they need more
    than that, so the goodput policy does not pick them (it used to value both at exactly 73,728 samples, flat, and
    then pick 1024 for its throughput), and a DP run that trains there is marked optimistic (an upper bound)."""
    path = tmp_path / "censored.json"
    path.write_text(json.dumps({"step_s": PROFILE.step_s, "allreduce_s": PROFILE.allreduce_s, "base_batch": 128,
                                "samples_to_target": {"64": 2e4, "128": 3e4, "256": 6e4, "512": None, "1024": None},
                                "samples_to_target_seeds": {"64": [2e4, 2e4, 1e4], "128": [3e4, 3e4, 2e4],
                                                            "256": [6e4, None, 5e4], "512": [None] * 3,
                                                            "1024": [None, 7e4, None]},
                                "censored_at": 73728, "meta": {"seeds": [0, 1, 2]}}))
    profile = Profile.load(path)
    trace = [TraceJob("a", 0.0, 20.0, (64, 1024), 128, 8)]
    good = simulate(trace, profile, "goodput", 8, 1e6)
    assert max(d.global_batch for d in good.decisions) <= 256
    assert not good.optimistic
    assert profile.censored == (512, 1024) and profile.largest_known == 256
    assert profile.known(256) and not profile.known(257) and not profile.known(1024)
    assert profile.samples_needed(384) == 6e4 and profile.samples_needed(1024) == 73728  # lower bounds
    dp = simulate(trace, profile, "dp", 8, 1e6)
    assert max(d.global_batch for d in dp.decisions) == 1024 and dp.optimistic
    assert not simulate(trace, profile, "fixed", 8, 1e6).optimistic
    # one seed's curve: seed 1 reached at 1024 but not at 256, so only batches up to 128 are known for it
    one = Profile.load(path, seed=1)
    assert one.censored == (256, 512) and one.largest_known == 128 and one.samples_to_target[1024] == 7e4
    with pytest.raises(ValueError, match="no convergence curve of seed 5"):
        Profile.load(path, seed=5)


def test_median_over_seeds_keeps_censored_seeds_as_more_than_any_value():
    from lightning_dlrover.elastic.profile import _median_censored

    assert _median_censored([9.0, None, 5.0]) == 9.0  # None sorts last: the median is still known
    assert _median_censored([None, 5.0, None]) is None  # half or more censored: unknown
    assert _median_censored([4.0, 6.0, 8.0, None]) == 7.0 and _median_censored([4.0, 6.0, None, None]) is None
