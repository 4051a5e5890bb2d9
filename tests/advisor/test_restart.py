"""Restart decisions: what is printed and recorded for changes a running job cannot make, and the ``stop`` path in
real processes (a checkpoint at the step of the decision, the fit stopped, the job resumed from it on fewer ranks)."""

import json
import re

import pytest

from lightning_dlrover.advisor.resources import ResourceConfig
from lightning_dlrover.advisor.restart import decide_restart
from lightning_dlrover.monitor import read_events
from tests.conftest import REPO, run

JOB = REPO / "tests" / "scripts" / "advisor_job.py"
CURRENT = ResourceConfig(nodes=3, ranks_per_node=2, threads_per_rank=1, data_workers=0, batch_per_rank=128)


def test_live_changes_need_no_restart():
    assert decide_restart(CURRENT, CURRENT.with_(threads_per_rank=2), [], ["train.py"]) is None


def test_world_size_change_prints_command_config_and_kubernetes():
    target = CURRENT.with_(ranks_per_node=1)
    d = decide_restart(CURRENT, target, [], ["train.py", "--lr", "0.1"])
    assert d.how == "instructions" and d.pending == ("ranks_per_node",) and not d.launcher_honours
    assert d.command == ("OMP_NUM_THREADS=1 torchrun --nnodes 3 --nproc-per-node 1 --rdzv-backend c10d "
                         "--rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID train.py --lr 0.1")
    assert d.config == {"trainer.devices": 1, "data.global_batch_size": 384}
    assert 'nprocPerNode: "1"' in d.kubernetes and "worker: {replicas: 3}" in d.kubernetes
    assert "Restart needed for: ranks_per_node" in d.text() and "--ckpt_path" not in d.text()
    json.dumps(d.event_fields())  # a structured record


def test_shrink_within_the_elastic_node_range_is_honoured_by_the_launcher():
    d = decide_restart(CURRENT, CURRENT.with_(nodes=2), [], ["train.py"], node_range=(1, 3))
    assert d.launcher_honours and d.stop_nodes == (2,) and "--nnodes 2:3" in d.command
    assert not decide_restart(CURRENT, CURRENT.with_(nodes=2), [], ["t.py"], node_range=(3, 3)).launcher_honours
    grow = decide_restart(CURRENT.with_(nodes=2), CURRENT, [], ["t.py"], node_range=(1, 3))
    assert not grow.launcher_honours and "Worker: {replicas: 3}" in grow.kubernetes  # new nodes need a scheduler


def test_stop_mode_resumes_from_the_checkpoint():
    d = decide_restart(CURRENT, CURRENT.with_(nodes=1), [], ["train.py"], mode="stop", checkpoint="/r/x.ckpt")
    assert d.how == "checkpoint" and d.command.endswith("train.py --ckpt_path=/r/x.ckpt")
    with pytest.raises(ValueError, match="must be 'print' or 'stop'"):
        decide_restart(CURRENT, CURRENT, [], [], mode="apply")


@pytest.mark.slow
def test_job_stops_at_a_checkpoint_and_resumes_from_it_on_fewer_ranks(tmp_path):
    # The cost objective at a throughput every configuration reaches picks the fewest cores: 1 rank, 1 thread.
    root = tmp_path / "run"
    first = run([str(JOB), "--root", str(root), "--devices", "2", "--advisor", "--profile-steps", "8",
                 "--probe-steps", "4", "--steps", "60", "--batch", "64", "--restart", "stop", "--objective", "cost",
                 "--target", "1", "--cost-per-node", "0", "--cost-per-core", "1", "--extrapolate"], tmp_path, timeout=300)
    events = read_events([root / "dlrover_events.jsonl"])
    restart = [e for e in events if e.kind == "restart"]
    assert len(restart) == 1, first.stdout[-3000:]
    r = restart[0]
    assert r["how"] == "checkpoint" and "ranks_per_node" in r["pending"] and r["recommended"]["ranks_per_node"] == 1
    stopped = int(re.search(r"FINAL_STEP (\d+) world_size 2", first.stdout).group(1))
    assert r.step == 8 and stopped == r.step  # decided after step 8, saved and stopped there: no step trained twice
    assert f"--ckpt_path={r['checkpoint']}" in r["command"] and "--nproc-per-node 1" in r["command"]
    second = run([str(JOB), "--root", str(tmp_path / "resumed"), "--devices", "1", "--steps", "12", "--batch", "128",
                  "--ckpt_path", r["checkpoint"]], tmp_path, timeout=300)
    assert "Restored all states from the checkpoint" in second.stdout, second.stdout[-3000:]
    assert "FINAL_STEP 12 world_size 1" in second.stdout


def _parsed(command: str, capsys, monkeypatch) -> dict:
    """The config ``lightning-dlrover fit`` parses from the printed command's arguments (its ``--print_config``)."""
    import shlex

    import yaml

    from lightning_dlrover.cli import main

    argv = shlex.split(command)
    args = argv[argv.index("lightning_dlrover") + 1:]
    monkeypatch.setattr("sys.argv", ["lightning-dlrover", *args, "--print_config"])  # as that process sees it
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_resume_command_carries_the_recommended_global_batch_through_the_cli(capsys, monkeypatch):
    config = str(REPO / "configs" / "demo.yaml")  # devices: 3, data.global_batch_size: 768
    current = ResourceConfig(1, 3, 1, 0, 256)
    target = ResourceConfig(1, 2, 2, 0, 64)  # fewer ranks and a smaller batch: global batch 128
    program = ["-m", "lightning_dlrover", "fit", "--config", config, "--data.global_batch_size=768",
               "--ckpt_path", "/r/older.ckpt"]  # a job resumed once already, its batch given on the command line
    d = decide_restart(current, target, [], program, mode="stop", checkpoint="/r/x.ckpt")
    assert d.command.startswith("OMP_NUM_THREADS=2 torchrun --nnodes 1 --nproc-per-node 2")
    parsed = _parsed(d.command, capsys, monkeypatch)
    assert parsed["data"]["global_batch_size"] == target.global_batch == 128
    assert int(parsed["trainer"]["devices"]) == 2 and parsed["ckpt_path"] == "/r/x.ckpt"
    printed = decide_restart(current, target, [], program[:5])  # restart: print carries them too
    assert _parsed(printed.command, capsys, monkeypatch)["data"]["global_batch_size"] == 128
    # a program that is not a LightningCLI gets only --ckpt_path (its own flags are its own)
    plain = decide_restart(current, target, [], ["train.py", "--batch", "256"], mode="stop", checkpoint="/r/x.ckpt")
    assert plain.command.endswith("train.py --batch 256 --ckpt_path=/r/x.ckpt")


def test_more_machines_for_a_job_with_room_to_join_are_a_command_per_machine_not_a_restart():
    """Under ``lightning-dlrover launch --max-nnodes 4`` (the room the launcher tells its workers): the advice for more
    machines is the launch command to run on each new machine, never a stop, in either mode; beyond the room, or
    with another change pending, the restart advice stays."""
    room = {"max_nnodes": 4, "nproc_per_node": 2, "master": "10.0.0.1:29500"}
    two = CURRENT.with_(nodes=2)
    for mode in ("print", "stop"):
        d = decide_restart(two, CURRENT, [], ["train.py", "--config", "job.yaml"], mode=mode, checkpoint="/r/x.ckpt",
                           join_room=room)
        assert d.how == "join" and d.pending == ("nodes",) and d.checkpoint is None
        assert d.command == ("lightning-dlrover launch --max-nnodes 4 --nproc-per-node 2 --master 10.0.0.1:29500 "
                             "--node-rank 2 -- train.py --config job.yaml")
        assert "no restart; run on each new machine" in d.text() and "Resume" not in d.text()
    assert decide_restart(CURRENT.with_(nodes=1), CURRENT, [], ["t.py"], join_room=room).command.count("--node-rank") == 2
    assert decide_restart(two, CURRENT.with_(nodes=5), [], ["t.py"], join_room=room).how == "instructions"  # no room
    assert decide_restart(two, CURRENT.with_(ranks_per_node=1), [], ["t.py"], join_room=room).how == "instructions"
    assert decide_restart(CURRENT, two, [], ["t.py"], join_room=room).how == "instructions"  # fewer machines
