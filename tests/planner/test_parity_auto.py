"""``parity: auto``: a real 2-rank ``lightning-dlrover fit`` trains with the planner's pick, and what cannot be planned
is refused before any rank starts."""

from __future__ import annotations

import pytest
import yaml

from lightning_dlrover.advisor.history import JobHistory, resolve_url
from lightning_dlrover.fault import ParityConfig
from lightning_dlrover.monitor.events import read_events
from lightning_dlrover.planner.job import OPTIMIZER_BYTES_PER_ROW, STEP_S_PER_RANK_SAMPLE, PlannedJob
from tests.conftest import run

ROWS, DIM, BATCH = [100] * 26, 8, 64


def _config(tmp_path, devices: int, parity="auto", rows=ROWS) -> str:
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": devices, "max_steps": 6, "limit_val_batches": 0, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "run"),
                    "strategy": {"class_path": "lightning_dlrover.DLRoverStrategy",
                                 "init_args": {"sharding_types": ["table_wise"], "parity": parity,
                                               "print_digest": False}}},
        "model": {"num_embeddings_per_feature": rows, "embedding_dim": DIM, "dense_arch_layer_sizes": [16, DIM],
                  "over_arch_layer_sizes": [16, 1]},
        "data": {"global_batch_size": BATCH, "train_batches": 100, "val_batches": 0},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_parity_auto_trains_two_ranks_with_the_planners_pick(tmp_path):
    # An earlier run of this job recorded slow checkpoints (30 s a save, 10 s a restore) in the job history, and the
    # job fails every 3 minutes: parity pays for itself. (Its own tiny state saves in no time: checkpoints would win.)
    history = tmp_path / "history.sqlite"
    db = JobHistory(resolve_url(history))
    db.add_costs(PlannedJob(tuple((r, DIM) for r in ROWS), 2, 1, BATCH).key(), {"save_s": 30.0, "load_s": 10.0})
    db.close()
    env = {"LIGHTNING_DLROVER_MTBF_HOURS": "0.05", "LIGHTNING_DLROVER_HISTORY": str(history)}
    out = run(["-m", "lightning_dlrover", "fit", "--config", _config(tmp_path, 2)], tmp_path, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:]
    expected = ParityConfig.auto(2, sum(ROWS) * (DIM * 4 + OPTIMIZER_BYTES_PER_ROW), STEP_S_PER_RANK_SAMPLE * BATCH / 2,
                                 ranks_per_machine=2, mtbf_hours=0.05, measured={"save_s": 30.0, "load_s": 10.0})
    assert expected is not None
    assert ParityConfig.auto(2, sum(ROWS) * (DIM * 4 + OPTIMIZER_BYTES_PER_ROW), STEP_S_PER_RANK_SAMPLE * BATCH / 2,
                             ranks_per_machine=2, mtbf_hours=0.05) is None  # without the history's costs
    events = read_events([tmp_path / "run" / "dlrover_events.jsonl"])
    [planned] = [e for e in events if e.kind == "parity_planned"]
    assert planned["parity"] == {"k": expected.k, "r": expected.r, "commit_every_n_steps": expected.commit_every_n_steps}
    assert planned["world_size"] == 2
    assert "parity: auto picked" in out.stdout
    # the job trained with that parity (the fault manager's report of the coded state it set up)
    n = expected.commit_every_n_steps
    point = "every step" if n == 1 else f"every {n} steps"
    assert f"DLRoverStrategy parity k={expected.k} r={expected.r}: rank 0 codes" in out.stdout, out.stdout[-4000:]
    assert f"the recovery point is committed {point}" in out.stdout


def test_parity_auto_is_refused_before_ranks_start(tmp_path):
    one = run(["-m", "lightning_dlrover", "fit", "--config", _config(tmp_path, 1)], tmp_path, check=False, timeout=120)
    assert one.returncode == 2 and "Traceback" not in one.stdout, one.stdout[-3000:]
    assert "lightning-dlrover fit: error: strategy.parity: auto at world size 1: parity needs at least 2 ranks" in one.stdout, one.stdout[-3000:]
    assert "MEMBER" not in one.stdout and "Initializing distributed" not in one.stdout  # no rank started
    bad = run(["-m", "lightning_dlrover", "fit", "--config", _config(tmp_path, 2)], tmp_path, check=False, timeout=120,
              env={"LIGHTNING_DLROVER_MTBF_HOURS": "-3"})
    assert bad.returncode == 2 and "Traceback" not in bad.stdout, bad.stdout[-3000:]
    assert "LIGHTNING_DLROVER_MTBF_HOURS=-3.0: the job's mean time between failures must be > 0 hours" in bad.stdout
    assert "Initializing distributed" not in bad.stdout, bad.stdout[-3000:]


def test_a_restarted_incarnation_keeps_the_parity_its_run_planned(tmp_path):
    """``torchrun`` restarts both ranks after rank 1 dies at step 8. Between the two incarnations the job history
    changed (here: checkpoints became cheap, so a fresh plan would pick checkpoints only): the restarted incarnation
    keeps the parity the first one planned and recorded, and decodes rank 1's state from the spills written with it."""
    import sys
    import threading
    import time

    from lightning_dlrover.cli.chaos import STORE_ENV
    from lightning_dlrover.fault.injector import FAULT_ENV
    from tests.conftest import REPO, start
    from tests.fault.test_in_process import free_port

    tables = tuple((300, 8) for _ in range(4))  # tests/scripts/user_model.py's; no data module: the 4096 default batch
    key = PlannedJob(tables, 2, 1, 4096).key()
    history = tmp_path / "history.sqlite"
    db = JobHistory(resolve_url(history))
    db.add_costs(key, {"save_s": 30.0, "load_s": 10.0})  # slow checkpoints: parity pays at one failure in 3 minutes
    db.close()
    events = tmp_path / "events.jsonl"
    env = {"LIGHTNING_DLROVER_MTBF_HOURS": "0.05", "LIGHTNING_DLROVER_HISTORY": str(history),
           "LIGHTNING_DLROVER_EVENTS": str(events), "LIGHTNING_DLROVER_SPILL_DIR": str(tmp_path / "spills"),
           FAULT_ENV: "rank=1,step=8,phase=after_optimizer", **STORE_ENV}
    proc = start([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
                  "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                  "--rdzv-id=keeps-parity", str(REPO / "tests" / "scripts" / "user_model.py"), "--steps", "12",
                  "--root", str(tmp_path / "run"), "--parity", "auto"], tmp_path, env)

    def cheapen_checkpoints() -> None:  # once the first incarnation planned, before it fails at step 8
        while proc.poll() is None:
            if events.is_file() and any(e.kind == "parity_planned" for e in read_events([events])):
                db = JobHistory(resolve_url(history))
                db.add_costs(key, {"save_s": 1e-4, "load_s": 1e-4})
                db.close()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=cheapen_checkpoints)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
        watcher.join()
    assert proc.returncode == 0, out[-4000:]
    state = sum(r * (d * 4 + OPTIMIZER_BYTES_PER_ROW) for r, d in tables)
    step_s = STEP_S_PER_RANK_SAMPLE * 4096 / 2
    first = ParityConfig.auto(2, state, step_s, ranks_per_machine=2, mtbf_hours=0.05,
                              measured={"save_s": 30.0, "load_s": 10.0})
    assert first is not None
    assert ParityConfig.auto(2, state, step_s, ranks_per_machine=2, mtbf_hours=0.05,
                             measured={"save_s": 1e-4, "load_s": 1e-4}) is None  # what a fresh plan picks now
    found = read_events([events])
    planned = [(e["parity"], e["source"]) for e in found if e.kind == "parity_planned"]
    fields = {"k": first.k, "r": first.r, "commit_every_n_steps": first.commit_every_n_steps}
    assert planned == [(fields, "planned"), (fields, "recorded")], planned
    restored = [e.fields["lost_ranks"] for e in found if e.kind == "restored"]
    assert restored == [[1]], [e.kind for e in found]
    assert "parity: auto kept the pick its run recorded" in out


def test_an_in_process_replacement_codes_with_the_runs_recorded_parity(tmp_path):
    """Under ``lightning-dlrover launch`` a hot spare takes rank 1 in process: it reads the pick the run recorded (the
    survivors are in ``fit``, no collective to plan with) and the job ends."""
    from tests.fault.test_in_process import launch

    tables = tuple((300, 8) for _ in range(4))
    history = tmp_path / "history.sqlite"
    db = JobHistory(resolve_url(history))
    db.add_costs(PlannedJob(tables, 2, 1, 4096).key(), {"save_s": 30.0, "load_s": 10.0})
    db.close()
    env = {"LIGHTNING_DLROVER_MTBF_HOURS": "0.05", "LIGHTNING_DLROVER_HISTORY": str(history),
           "LIGHTNING_DLROVER_SPILL_DIR": str(tmp_path / "spills")}
    _, found, out = launch(tmp_path, "auto", "--spares", "1", "--run-id", "auto-in-process",
                           fault="rank=1,step=5,phase=after_optimizer", script_args=["--parity", "auto"], env=env)
    planned = [(e.rank, e["parity"], e["source"]) for e in found if e.kind == "parity_planned"]
    fields = {"k": 1, "r": 1, "commit_every_n_steps": 1}
    assert planned == [(0, fields, "planned"), (1, fields, "recorded")], planned
    assert {e.rank for e in found if e.kind == "recovered_in_process"} == {0, 1}, [e.kind for e in found]
    assert "this replacement kept the pick its run recorded" in out


def test_parity_auto_measures_the_job_and_the_next_run_plans_with_it(tmp_path):
    """With a job history and nothing measured in it, ``parity: auto`` plans from the defaults, times the run's first
    steps and records them; the next run of the same job plans with its own step time."""
    history = tmp_path / "history.sqlite"
    env = {"LIGHTNING_DLROVER_MTBF_HOURS": "0.05", "LIGHTNING_DLROVER_HISTORY": str(history)}
    config = yaml.safe_load(open(_config(tmp_path, 2)))
    config["trainer"]["max_steps"] = 10
    path = tmp_path / "job10.yaml"
    path.write_text(yaml.safe_dump(config))
    key = PlannedJob(tuple((r, DIM) for r in ROWS), 2, 1, BATCH).key()
    runs, recorded = [], []
    for _ in range(2):
        out = run(["-m", "lightning_dlrover", "fit", "--config", str(path)], tmp_path, env=env, timeout=240)
        assert out.returncode == 0, out.stdout[-4000:]
        runs.append(read_events([tmp_path / "run" / "dlrover_events.jsonl"]))
        (tmp_path / "run" / "dlrover_events.jsonl").unlink()
        db = JobHistory(resolve_url(history))
        recorded.append(db.costs(key))
        db.close()
    first, second = ([e for e in events if e.kind == "parity_planned"] for events in runs)
    assert first[0]["measured"] == {}  # nothing recorded yet: the defaults
    [measured] = [e for e in runs[0] if e.kind == "costs_measured"]
    assert measured["job_key"] == key
    parity = first[0]["parity"]
    name = "step_s" if parity is None else "step_s_k{k}r{r}n{commit_every_n_steps}".format(**parity)
    assert set(measured["costs"]) == {name, name.replace("step_s", "cpu_s")}
    assert all(v > 0 for v in measured["costs"].values())
    from lightning_dlrover.planner.records import costs_from_records

    assert recorded[0] == pytest.approx(measured["costs"], abs=1e-6)
    assert second[0]["measured"] == pytest.approx(costs_from_records(recorded[0]))
    assert second[0]["measured"]["step_s"] > 0  # the second run's plan used the job's own step time


def _checkpointed_config(tmp_path, mine_every: int, asynchronous: bool = False) -> str:
    """The 2-rank job with two ``ModelCheckpoint``s: ``planned/`` given no interval, ``mine/`` every ``mine_every``
    steps (the user's)."""
    config = yaml.safe_load(open(_config(tmp_path, 2)))
    config["trainer"]["strategy"]["init_args"]["async_checkpoint"] = asynchronous
    config["trainer"].update(max_steps=12, enable_checkpointing=True, callbacks=[
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp_path / "planned"), "filename": "{step}", "save_top_k": -1}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp_path / "mine"), "filename": "{step}", "save_top_k": -1,
                       "every_n_train_steps": mine_every}}])
    path = tmp_path / "checkpointed.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _saved_steps(directory) -> list[int]:
    return sorted(int(p.name[len("step="):-len(".ckpt")]) for p in directory.glob("step=*.ckpt"))


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_parity_auto_sets_the_planned_checkpoint_interval_and_keeps_the_users(tmp_path, mode):
    """The plan's checkpoint interval (Young/Daly at the time the job's saves of its mode blocked training, as an
    earlier run recorded it) goes to the ``ModelCheckpoint`` given none; the one whose interval the user set keeps it.
    The run measures its own saves for the next run's plan (an async save's commit from its ``checkpoint_saved``)."""
    from lightning_dlrover.planner.inputs import Pick, plan_inputs

    history = tmp_path / "history.sqlite"
    job = PlannedJob(tuple((r, DIM) for r in ROWS), 2, 1, BATCH, save_mode=mode)
    db = JobHistory(resolve_url(history))  # a second a step, 20 ms blocked per save: checkpoints every few steps
    db.add_costs(job.key(), {"step_s": 1.0, f"save_s.{mode}": 0.02, f"save_lag_s.{mode}": 0.0,
                             "save_s.blocking" if mode != "blocking" else "save_s.async": 30.0})  # the other mode's
    db.close()
    pick = Pick.of(plan_inputs(job, 2, 2, str(history), 0.05).plan().best)
    every = pick.checkpoint_every_steps
    assert every is not None and 1 < every <= 6, every
    mine = 7 if every != 7 else 5
    env = {"LIGHTNING_DLROVER_MTBF_HOURS": "0.05", "LIGHTNING_DLROVER_HISTORY": str(history)}
    out = run(["-m", "lightning_dlrover", "fit", "--config", _checkpointed_config(tmp_path, mine, mode == "async")],
              tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
    # every planned step, and the save at the end of training (the epoch's end, Lightning's default: kept)
    assert _saved_steps(tmp_path / "planned") == sorted({*range(every, 13, every), 12}), out.stdout[-3000:]
    assert _saved_steps(tmp_path / "mine") == list(range(mine, 13, mine))  # the user's interval, untouched
    events = read_events([tmp_path / "run" / "dlrover_events.jsonl"])
    [planned] = [e for e in events if e.kind == "checkpoint_interval_planned"]
    assert planned["every_n_train_steps"] == every and planned["applied"] is True
    assert planned["save_mode"] == mode and planned["save_s"] == pytest.approx(0.02)
    assert f"parity: auto set the checkpoint interval: every {every} training steps" in out.stdout
    assert "kept the interval of 1 the user set" in out.stdout
    # the job's own saves, measured and recorded: the next run's interval comes from them
    saves = [e for e in events if e.kind == "costs_measured" and f"save_s.{mode}" in e["costs"]]
    assert saves and all(e["costs"][f"save_s.{mode}"] > 0 for e in saves)
    db = JobHistory(resolve_url(history))
    recorded = db.costs(job.key())
    db.close()
    assert recorded[f"save_s.{mode}"] == pytest.approx(saves[-1]["costs"][f"save_s.{mode}"], abs=1e-6)
    if mode == "async":  # committed after it stopped blocking: from the saves' checkpoint_saved events
        committed = [e for e in events if e.kind == "checkpoint_saved" and e.rank == 0]
        assert committed and recorded["save_lag_s.async"] > 0
        assert recorded["save_lag_s.async"] <= max(e["write_s"] for e in committed)


def test_launch_spares_auto_starts_the_plans_spares(tmp_path):
    """``launch --spares auto`` plans before any rank starts, from the program's config (and the job history and MTBF
    in its environment): with the published failure rates this job is best off with checkpoints only, so no hot spare
    starts."""
    from tests.fault.test_in_process import free_port

    config = yaml.safe_load(open(_config(tmp_path, 2, parity=None)))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    events = tmp_path / "events.jsonl"
    out = run(["-m", "lightning_dlrover", "launch", "--nproc-per-node", "2", "--spares", "auto", "--master",
               f"127.0.0.1:{free_port()}", "--", "-m", "lightning_dlrover", "fit", "--config", str(path)], tmp_path,
              env={"LIGHTNING_DLROVER_EVENTS": str(events)}, timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "--spares auto: the plan for" in out.stdout and "picks checkpoint" in out.stdout
    assert "0 hot spare(s) on this machine (the pick does not recover in process)" in out.stdout
    found = read_events([events])
    assert [e for e in found if e.kind == "spares_started"] == [], [e.kind for e in found]
