"""Job history: round trip, schema upgrade from version 1, newer schemas refused, bad URLs, concurrent writers
(real processes)."""

import multiprocessing as mp
import sqlite3

import pytest

from lightning_dlrover.advisor.history import SCHEMA_VERSION, JobHistory, resolve_url


def _job(history: JobHistory, run: str, sps: float = 100.0) -> int:
    job = history.start_job(run, {"model": "M"}, "key", {"nodes": 1, "ranks_per_node": 2, "threads_per_rank": 1,
                                                         "data_workers": 0, "batch_per_rank": 64})
    history.add_measurements(job, [dict(nodes=1, ranks_per_node=2, threads_per_rank=t, data_workers=0, batch_per_rank=64,
                                        steps=4, step_s=0.01 * t, data_wait_s=0.001, rss_bytes=10**8, cores_available=2.0)
                                   for t in (1, 2)])
    history.finish_job(job, "finished", sps, 0.01, 10**8, recommendation={"threads_per_rank": 1}, model={"a": 1})
    return job


def test_round_trip(tmp_path):
    history = JobHistory(resolve_url(tmp_path / "h.sqlite"))
    assert history.schema_version == SCHEMA_VERSION
    job = _job(history, "run-1")
    [record] = history.jobs()
    assert record.id == job and record.outcome == "finished" and record.samples_per_sec == 100.0
    assert record.recommendation == {"threads_per_rank": 1} and record.model == {"a": 1}
    assert [m["threads_per_rank"] for m in history.measurements([job])] == [1, 2]
    with pytest.raises(ValueError, match="outcome 'exploded'"):
        history.finish_job(job, "exploded")


def test_version_1_database_is_upgraded_in_place_and_keeps_its_jobs(tmp_path):
    url = resolve_url(tmp_path / "old.sqlite")
    old = JobHistory(url, upgrade_to=1)  # what the first release wrote
    assert old.schema_version == 1
    with sqlite3.connect(tmp_path / "old.sqlite") as conn:
        assert "recommendation" not in [r[1] for r in conn.execute("PRAGMA table_info(dlrover_jobs)")]
        conn.execute("INSERT INTO dlrover_jobs (run_id, started_at, updated_at, signature_key, signature, resources, "
                     "outcome, samples_per_sec) VALUES ('old-run', 1, 2, 'k', '{}', '{\"nodes\": 1}', 'finished', 42.0)")
    old.close()
    new = JobHistory(url)
    assert new.schema_version == SCHEMA_VERSION
    [record] = new.jobs()
    assert (record.run_id, record.samples_per_sec, record.recommendation) == ("old-run", 42.0, None)
    _job(new, "new-run")
    assert len(new.jobs()) == 2 and len(new.measurements()) == 2


def test_newer_schema_is_refused(tmp_path):
    url = resolve_url(tmp_path / "h.sqlite")
    JobHistory(url).close()
    with sqlite3.connect(tmp_path / "h.sqlite") as conn:
        conn.execute("UPDATE dlrover_schema SET version = 99")
    with pytest.raises(ValueError, match="schema version 99, newer than this lightning-dlrover's"):
        JobHistory(url)


def test_bad_urls_fail_with_a_clear_message(tmp_path):
    with pytest.raises(ValueError, match="not a database URL SQLAlchemy can open"):
        JobHistory("nosuchdb://host/db")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="cannot be opened"):
        JobHistory(resolve_url(tmp_path / "a-file" / "h.sqlite"))


def test_resolve_url(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DLROVER_HISTORY", str(tmp_path / "env.sqlite"))
    assert resolve_url("user") == f"sqlite:///{tmp_path}/env.sqlite"
    assert resolve_url("run", tmp_path / "run") == f"sqlite:///{tmp_path}/run/dlrover_history.sqlite"
    assert resolve_url("postgresql://u@h/db") == "postgresql://u@h/db"


def _writer(url: str, worker: int, jobs: int, barrier) -> None:
    barrier.wait()  # every process opens (and races to create) the database at once
    history = JobHistory(url)
    for i in range(jobs):
        _job(history, f"w{worker}-{i}", sps=worker * 1000 + i)
    history.close()


@pytest.mark.slow
def test_concurrent_writers_in_separate_processes(tmp_path):
    url = resolve_url(tmp_path / "shared.sqlite")
    # Each child opens its own engine. Spawned, not forked: a child forked from this multi-threaded process (torch
    # and gloo threads of earlier tests) can inherit a lock another thread held. Once, under load, one forked writer
    # never finished its first transaction and the three others timed out after 60 s on "database is locked".
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_writer, args=(url, w, 40, barrier)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    history = JobHistory(url)
    records = history.jobs()
    assert len(records) == 160 and len({r.id for r in records}) == 160
    assert {r.run_id for r in records} == {f"w{w}-{i}" for w in range(4) for i in range(40)}
    assert all(r.outcome == "finished" for r in records)
    assert len(history.measurements()) == 320
    assert history.schema_version == SCHEMA_VERSION
