"""The trace-driven simulator: deterministic for a seed, policies, traces, node losses, cluster actions, CLI."""

import json

import pytest

from lightning_dlrover.cli.simulate import cluster_actions, main
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
    for key, curve in profile.meta["curves"].items():  # the samples-to-target entries follow from the curves
        batch, seed = map(int, key.split("/"))
        target = profile.meta["targets"][str(seed)]
        hit = next((seen for seen, loss in curve if seen > 0 and loss <= target), None)
        assert hit is None or hit <= profile.samples_to_target[batch] * 2 + 1  # the median over seeds
    assert profile.samples_needed(1024) >= profile.samples_needed(128)
