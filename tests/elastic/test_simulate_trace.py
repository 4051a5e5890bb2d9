"""``lightning-dlrover simulate`` refuses bad input (issue #20): every problem of a trace file or a flag is one
line ``WHERE: what is wrong; the fix`` on stderr, all of them at once, exit code 2 and no traceback. Also the
plot's node-loss marks and the ``torchrun`` line of each decision."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dlrover.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"name": "j0", "arrival": 0.0, "work": 1.0, "batch_range": [64, 1024], "base_batch": 128, "max_ranks": 8}
# a profile of the shape measured on our DLRM (tests/elastic/test_simulator.py), so runs take milliseconds
PROFILE = {"step_s": {"16": 0.02, "128": 0.025, "1024": 0.06}, "allreduce_s": 0.002,
           "samples_to_target": {"64": 3e4, "128": 3.4e4, "256": 4.5e4, "512": 7e4, "1024": 1.2e5}, "base_batch": 128}


def job(**fields) -> str:
    return json.dumps({**GOOD, **fields})


def simulate(tmp_path: Path, capsys, lines: list[str] | None, *flags: str) -> tuple[int, str, Path]:
    """Runs the CLI on a trace file of ``lines`` (None: no --trace); its exit code, stderr, and the file."""
    path = tmp_path / "trace.jsonl"
    if lines is not None:
        path.write_text("".join(line + "\n" for line in lines))
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    trace = ["--trace", str(path)] if lines is not None else []
    with pytest.raises(SystemExit) as end:
        cli_main(["simulate", *trace, "--profile", str(tmp_path / "profile.json"), "--devices", "8",
                  "--horizon", "2000", *flags])
    return end.value.code, capsys.readouterr().err, path


# (trace lines, extra flags, what stderr must say: the place, then the problem and its fix)
CASES = {
    "not JSON": ([job(), '{"name": "j1", "arrival": 1'], [], [":2: ", "not a JSON object", "one JSON object per line"]),
    "a list, not an object": ([json.dumps(["j0", 0.0])], [], [":1: ", "a JSON list", '{"name":']),
    "one-item batch_range": ([job(batch_range=[64])], [], [":1: ", "batch_range [64]", "[min, max]"]),
    "duplicate name": ([job(), job(arrival=5.0)], [], [":2: ", "'j0'", "line 1", "rename"]),
    "negative work": ([job(work=-1.0)], [], [":1: ", "work -1.0", "> 0"]),
    "negative arrival": ([job(arrival=-3.0)], [], [":1: ", "arrival -3.0", ">= 0"]),
    "base_batch outside its range": ([job(base_batch=2048)], [],
                                     [":1: ", "base_batch 2048", "[64, 1024]", "give a base_batch"]),
    "negative --devices": ([job()], ["--devices", "-4"], ["--devices -4", "at least"]),
    "empty file": ([], [], ["trace.jsonl: ", "no jobs", "one JSON object per line"]),
    "max_ranks below --nproc-per-node": ([job(max_ranks=2)], ["--devices", "8", "--nproc-per-node", "4"],
                                         [":1: ", "max_ranks 2", "--nproc-per-node 4", "raise max_ranks"]),
    "base_batch no node count divides": ([job(base_batch=100)], ["--nproc-per-node", "8"],
                                         [":1: ", "base_batch 100", "fixed policy", "a multiple of 8"]),
    "generated trace, --nproc-per-node above its max_ranks": (
        None, ["--trace", "synthetic", "--jobs", "3", "--nproc-per-node", "16", "--devices", "16"],
        ["--nproc-per-node 16: ", "3 job(s) of the synthetic trace", "use --nproc-per-node 8 or less"]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_exits_2_with_place_and_fix(tmp_path, capsys, case):
    lines, flags, expected = CASES[case]
    code, err, path = simulate(tmp_path, capsys, lines, *flags)
    assert code == 2, err
    assert "Traceback" not in err
    message = err.strip().splitlines()
    assert len(message) == 1, err  # one problem, one line
    where = str(path) if expected[0].startswith((":", "trace.jsonl")) else ""
    assert message[0].startswith(where + expected[0].replace("trace.jsonl", "")), err
    for text in expected[1:]:
        assert text in message[0], err


def test_every_problem_of_the_file_is_listed_once(tmp_path, capsys):
    lines = [job(), "not json", job(name="j2", work=0, max_ranks=-1), job(), "", job(name="j5", base_batch="big"),
             job(name="j6", max_rank=4)]
    code, err, path = simulate(tmp_path, capsys, lines, "--horizon", "-1")
    assert code == 2 and "Traceback" not in err
    places = [line.split(": ", 1)[0] for line in err.strip().splitlines()]
    assert places == [f"{path}:2", f"{path}:3", f"{path}:3", f"{path}:4", f"{path}:6", f"{path}:7", "--horizon -1"]
    assert "did you mean 'max_ranks'" in err  # an unknown field is a typo, not silently a default


def test_missing_trace_file_is_exit_2(tmp_path, capsys):
    code, err, _ = simulate(tmp_path, capsys, None, "--trace", str(tmp_path / "nowhere.jsonl"))
    assert code == 2 and "nowhere.jsonl" in err and "synthetic" in err


def test_console_entry_exits_2_without_traceback(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(job() + "\n" + json.dumps([1, 2]) + "\n" + job() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "lightning_dlrover", "simulate", "--trace", str(path),
                           "--devices", "-4"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert [line.split(": ", 1)[0] for line in done.stderr.strip().splitlines()] == [
        f"{path}:2", f"{path}:3", "--devices -4"]


def test_torchrun_line_carries_the_allocators_rank_count(tmp_path, capsys):
    from lightning_dlrover.elastic.profile import Profile
    from lightning_dlrover.elastic.simulator import simulate as run_policy
    from lightning_dlrover.elastic.trace import load_trace

    lines = [job(name=f"j{i}", arrival=20.0 * i, work=0.5, max_ranks=8) for i in range(4)]
    out = tmp_path / "decisions.jsonl"
    code, err, path = simulate(tmp_path, capsys, lines, "--nproc-per-node", "2", "--policies", "goodput",
                               "--decisions", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    decided = run_policy(load_trace(path), Profile.load(tmp_path / "profile.json"), "goodput", 8, 2000,
                         nproc_per_node=2).decisions
    assert [(r["time"], r["job"], r["ranks"], r["global_batch"]) for r in rows] == [
        (d.time, d.job, d.ranks, d.global_batch) for d in decided]
    assert {r["ranks"] for r in rows} - {0}, "the trace should make the allocator run jobs"
    for row in rows:
        if not row["ranks"]:
            assert row["torchrun"] is None  # a job that waits is not launched
            continue
        nnodes = int(re.search(r"--nnodes (\S+)", row["torchrun"]).group(1))
        nproc = int(re.search(r"--nproc-per-node (\d+)", row["torchrun"]).group(1))
        assert (nproc, nnodes * nproc) == (2, row["ranks"]), row["torchrun"]
        assert f"--data.global_batch_size {row['global_batch']}" in row["torchrun"]
        assert row["pytorchjob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == nnodes


def test_plot_marks_node_losses(tmp_path):
    from lightning_dlrover.cli.simulate import plot, plot_data
    from lightning_dlrover.elastic.profile import Profile
    from lightning_dlrover.elastic.simulator import simulate as run_policy
    from lightning_dlrover.elastic.simulator import synthetic_trace

    prof = Profile({16: 0.02, 128: 0.025, 1024: 0.06}, 0.002,
                   {64: 3e4, 128: 3.4e4, 256: 4.5e4, 512: 7e4, 1024: 1.2e5}, 128, {})
    losses = [(100.0, -2), (150.0, -2), (400.0, 2), (450.0, 2), (5000.0, -2)]  # the last is past the horizon
    results = [run_policy(synthetic_trace(6, seed=1, interarrival_s=50), prof, policy, 8, 1000, node_losses=losses,
                          nproc_per_node=2) for policy in ("fixed", "goodput")]
    data = plot_data(results)
    assert data.node_losses == [100.0, 150.0] and data.node_returns == [400.0, 450.0]
    assert data.down == [(100.0, 450.0)] and data.devices == 8  # shaded while the cluster is short of devices
    for r in results:
        xs, ys = data.curves[r.policy]
        assert xs == [0.0, *sorted(f for _, _, f in r.completions)] and ys == list(range(len(xs)))
    plot(results, str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_simulate_refuses_what_it_cannot_run():
    """The library refuses too (a duplicate name used to make a job vanish; a job with too few ranks crashed)."""
    from lightning_dlrover.elastic.profile import Profile
    from lightning_dlrover.elastic.simulator import TraceJob
    from lightning_dlrover.elastic.simulator import simulate as run_policy
    from lightning_dlrover.elastic.trace import TraceError

    prof = Profile({16: 0.02, 128: 0.025}, 0.002, {64: 3e4, 128: 3.4e4, 1024: 1.2e5}, 128, {})
    twice = [TraceJob("a", 0.0, 1.0, (64, 1024), 128, 8), TraceJob("a", 5.0, 1.0, (64, 1024), 128, 8)]
    with pytest.raises(TraceError, match="job 'a': job name 'a' is used twice; names must be unique"):
        run_policy(twice, prof, "goodput", 8, 100)
    with pytest.raises(TraceError, match="max_ranks 2 is below --nproc-per-node 4"):
        run_policy([TraceJob("b", 0.0, 1.0, (64, 1024), 128, 2)], prof, "goodput", 8, 100, nproc_per_node=4)
