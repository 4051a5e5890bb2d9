"""Job history: every job's signature, resources, measurements and outcome, in a database many jobs share.

Any SQLAlchemy URL works (``postgresql://...`` for a team); the default is an SQLite file. The schema is
versioned (table ``dlrover_schema``): opening a database applies the missing migrations of
:data:`MIGRATIONS` in order, inside one locked transaction, so a database written by an older version is
upgraded in place and two jobs opening a new database at once create it once. A database written by a newer
version is refused.

Concurrent writers: SQLite runs in WAL mode (readers never block) and every transaction starts with
``BEGIN IMMEDIATE`` with a 60 s busy timeout, so writers queue instead of failing; PostgreSQL serialises the
schema upgrade with an advisory lock. (SQLite's locking needs a local file system, not NFS.)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

#: Environment variable naming the history database (a path or an SQLAlchemy URL); wins over the default.
HISTORY_ENV = "LIGHTNING_DLROVER_HISTORY"
OUTCOMES = ("running", "finished", "failed", "recovered", "oom")
_LOCK_ID = 0x0D1A0EA  # PostgreSQL advisory lock of the schema upgrade


def default_history_path() -> Path:
    """The user-wide database: ``$XDG_CACHE_HOME/lightning_dlrover/history.sqlite`` (``~/.cache`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "lightning_dlrover" / "history.sqlite"


def resolve_url(history: str | os.PathLike, run_dir: str | os.PathLike | None = None) -> str:
    """An SQLAlchemy URL for ``history``: ``"user"`` (``$LIGHTNING_DLROVER_HISTORY``, else
    :func:`default_history_path`), ``"run"`` (``<run_dir>/dlrover_history.sqlite``), a URL, or a file path."""
    text = str(history)
    if text == "user":
        text = os.environ.get(HISTORY_ENV) or str(default_history_path())
    elif text == "run":
        text = str(Path(run_dir or ".") / "dlrover_history.sqlite")
    if "://" in text:
        return text
    return f"sqlite:///{Path(text).expanduser().resolve()}"


# ------------------------------------------------------------------------------------------------ schema
metadata = sa.MetaData()
schema_table = sa.Table("dlrover_schema", metadata, sa.Column("version", sa.Integer, nullable=False))


def _job_columns(version: int) -> list[sa.Column]:
    """Columns of the job table at schema ``version`` (JSON columns are text)."""
    columns = [
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(200), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("signature_key", sa.String(64), nullable=False, index=True),
        sa.Column("signature", sa.Text, nullable=False),  # JSON JobSignature
        sa.Column("resources", sa.Text, nullable=False),  # JSON ResourceConfig
        sa.Column("outcome", sa.String(20), nullable=False),
        sa.Column("samples_per_sec", sa.Float),
        sa.Column("step_s", sa.Float),
        sa.Column("peak_rss_bytes", sa.BigInteger),
    ]
    if version >= 2:
        columns += [sa.Column(name, sa.Text) for name in ("recommendation", "model", "note")]  # JSON, JSON, text
    return columns


jobs = sa.Table("dlrover_jobs", metadata, *_job_columns(2))
measurements = sa.Table(
    "dlrover_measurements", metadata,  # version 2
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("dlrover_jobs.id"), nullable=False, index=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("nodes", sa.Integer, nullable=False),
    sa.Column("ranks_per_node", sa.Integer, nullable=False),
    sa.Column("threads_per_rank", sa.Integer, nullable=False),
    sa.Column("data_workers", sa.Integer, nullable=False),
    sa.Column("batch_per_rank", sa.Integer, nullable=False),
    sa.Column("steps", sa.Integer, nullable=False),
    sa.Column("step_s", sa.Float, nullable=False),
    sa.Column("data_wait_s", sa.Float, nullable=False),
    sa.Column("rss_bytes", sa.BigInteger),
    sa.Column("cores_available", sa.Float),  # cores per node not taken by other programs while measured
)

failures = sa.Table(
    "dlrover_failures", metadata,  # version 3: failures a job observed (its fault events), for the planner
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("dlrover_jobs.id"), nullable=False, index=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("kind", sa.String(40), nullable=False),  # the fault event: restored, recovered_in_process, fallback
    sa.Column("world_size", sa.Integer, nullable=False),
    sa.Column("lost_ranks", sa.Integer, nullable=False),
    sa.Column("recovery_s", sa.Float),
)
costs = sa.Table(
    "dlrover_costs", metadata,  # version 3: fault-tolerance costs measured on a job, by the planner's job key
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_key", sa.String(64), nullable=False, index=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("name", sa.String(40), nullable=False),
    sa.Column("value", sa.Float, nullable=False),
)


def _migrate_1(conn: Connection) -> None:
    """Version 1: jobs with signature, resources, outcome and end-of-run measurements."""
    sa.Table("dlrover_jobs", sa.MetaData(), *_job_columns(1)).create(conn, checkfirst=True)


def _migrate_2(conn: Connection) -> None:
    """Version 2: per-configuration measurements (profiled points) and each job's recommendation and model."""
    for column in ("recommendation", "model", "note"):
        conn.exec_driver_sql(f"ALTER TABLE dlrover_jobs ADD COLUMN {column} TEXT")
    measurements.create(conn, checkfirst=True)


def _migrate_3(conn: Connection) -> None:
    """Version 3: observed failures and measured fault-tolerance costs (the planner's inputs)."""
    failures.create(conn, checkfirst=True)
    costs.create(conn, checkfirst=True)


#: Migrations from version ``i`` to ``i + 1`` are ``MIGRATIONS[i]``; the schema version is ``len(MIGRATIONS)``.
MIGRATIONS: list[Callable[[Connection], None]] = [_migrate_1, _migrate_2, _migrate_3]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class JobRecord:
    """One row of the job table (JSON columns decoded)."""

    id: int
    run_id: str
    started_at: float
    updated_at: float
    signature_key: str
    signature: dict[str, Any]
    resources: dict[str, int]
    outcome: str
    samples_per_sec: float | None
    step_s: float | None
    peak_rss_bytes: int | None
    recommendation: dict[str, int] | None
    model: dict[str, Any] | None
    note: str | None


def _decode(text: str | None) -> Any:
    return json.loads(text) if text else None


class JobHistory:
    """The job-history database at ``url`` (see the module docstring); created or upgraded on open.

    Raises:
        ValueError: ``url`` is not a database SQLAlchemy can open, or its schema is newer than this code's.
    """

    def __init__(self, url: str, upgrade_to: int = SCHEMA_VERSION) -> None:
        self.url = url
        self.engine = _engine(url)
        self._upgrade(upgrade_to)

    def _upgrade(self, target: int) -> None:
        with self.engine.begin() as conn:  # BEGIN IMMEDIATE on SQLite: one opener at a time
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _LOCK_ID})
            schema_table.create(conn, checkfirst=True)
            version = conn.execute(sa.select(schema_table.c.version)).scalar()
            if version is None:
                version = 0
                conn.execute(schema_table.insert().values(version=0))
            if version > SCHEMA_VERSION:
                raise ValueError(
                    f"job history {self.url} has schema version {version}, newer than this lightning-dlrover's "
                    f"{SCHEMA_VERSION}: upgrade lightning-dlrover, or use another database (ResourceAdvisor(history=...))."
                )
            for step in range(version, target):
                MIGRATIONS[step](conn)
            if target > version:
                conn.execute(schema_table.update().values(version=target))

    @property
    def schema_version(self) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(sa.select(schema_table.c.version)).scalar_one())

    def start_job(self, run_id: str, signature: dict[str, Any], signature_key: str, resources: dict[str, int],
                  note: str | None = None) -> int:
        """Records a job that has started (outcome ``running``); returns its id."""
        now = time.time()
        with self.engine.begin() as conn:
            result = conn.execute(jobs.insert().values(
                run_id=run_id, started_at=now, updated_at=now, signature_key=signature_key,
                signature=json.dumps(signature), resources=json.dumps(resources), outcome="running", note=note))
            return int(result.inserted_primary_key[0])

    def add_measurements(self, job_id: int, rows: Iterable[dict[str, Any]]) -> None:
        """Adds measured configurations of a job (keys: the measurement table's columns but ``id``/``job_id``;
        ``time`` defaults to now)."""
        rows = [{"time": time.time(), **row, "job_id": job_id} for row in rows]
        if rows:
            with self.engine.begin() as conn:
                conn.execute(measurements.insert(), rows)

    def finish_job(self, job_id: int, outcome: str, samples_per_sec: float | None = None, step_s: float | None = None,
                   peak_rss_bytes: int | None = None, recommendation: dict[str, int] | None = None,
                   model: dict[str, Any] | None = None, resources: dict[str, int] | None = None) -> None:
        """Records a job's outcome (one of :data:`OUTCOMES`) and final measurements."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
        values: dict[str, Any] = {"outcome": outcome, "updated_at": time.time()}
        for key, value in (("samples_per_sec", samples_per_sec), ("step_s", step_s), ("peak_rss_bytes", peak_rss_bytes)):
            if value is not None:
                values[key] = value
        for key, value in (("recommendation", recommendation), ("model", model), ("resources", resources)):
            if value is not None:
                values[key] = json.dumps(value)
        with self.engine.begin() as conn:
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**values))

    def jobs(self, limit: int | None = None) -> list[JobRecord]:
        """Jobs, newest first."""
        query = sa.select(jobs).order_by(jobs.c.id.desc())
        if limit is not None:
            query = query.limit(limit)
        with self.engine.begin() as conn:
            rows = conn.execute(query).mappings().all()
        return [JobRecord(**{**row, **{k: _decode(row[k]) for k in ("signature", "resources", "recommendation", "model")}})
                for row in rows]

    def measurements(self, job_ids: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """Measured configurations (of ``job_ids``, default all), oldest first."""
        query = sa.select(measurements).order_by(measurements.c.id)
        if job_ids is not None:
            query = query.where(measurements.c.job_id.in_(list(job_ids)))
        with self.engine.begin() as conn:
            return [dict(row) for row in conn.execute(query).mappings().all()]

    def add_failures(self, job_id: int, rows: Iterable[dict[str, Any]]) -> None:
        """Records failures a job observed (keys: ``time``, ``kind``, ``world_size``, ``lost_ranks``, ``recovery_s``)."""
        rows = [{**row, "job_id": job_id} for row in rows]
        if rows:
            with self.engine.begin() as conn:
                conn.execute(failures.insert(), rows)

    def failures(self) -> list[dict[str, Any]]:
        """Every recorded failure, oldest first."""
        with self.engine.begin() as conn:
            return [dict(r) for r in conn.execute(sa.select(failures).order_by(failures.c.id)).mappings().all()]

    def rank_hours(self) -> float:
        """Hours every recorded job's ranks ran (start to last update, times its ranks): the failures' exposure."""
        total = 0.0
        for job in self.jobs():
            ranks = int(job.resources.get("nodes", 1)) * int(job.resources.get("ranks_per_node", 1))
            total += max(job.updated_at - job.started_at, 0.0) / 3600.0 * ranks
        return total

    def add_costs(self, job_key: str, values: dict[str, float]) -> None:
        """Records fault-tolerance costs measured on a job (name -> value, as :class:`~lightning_dlrover.planner.JobCosts`
        names them)."""
        now = time.time()
        if values:
            with self.engine.begin() as conn:
                conn.execute(costs.insert(), [{"job_key": job_key, "time": now, "name": name, "value": float(value)}
                                              for name, value in values.items()])

    def costs(self, job_key: str) -> dict[str, float]:
        """The newest recorded value of each cost of ``job_key``."""
        query = sa.select(costs).where(costs.c.job_key == job_key).order_by(costs.c.id)
        with self.engine.begin() as conn:
            return {row["name"]: row["value"] for row in conn.execute(query).mappings().all()}

    def close(self) -> None:
        self.engine.dispose()


def _engine(url: str) -> Engine:
    try:
        parsed = sa.engine.make_url(url)
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            engine = sa.create_engine(parsed, connect_args={"timeout": 60})
            _sqlite_locking(engine)
        else:
            engine = sa.create_engine(parsed, pool_pre_ping=True)
        with engine.connect():
            pass
        return engine
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as err:
        raise ValueError(
            f"job history {url!r} is not a database URL SQLAlchemy can open ({err}). Use a file path, "
            "sqlite:///path/to/history.sqlite, or e.g. postgresql://user@host/db (with its driver installed)."
        ) from err
    except sa.exc.OperationalError as err:
        raise ValueError(f"job history {url!r} cannot be opened: {err.orig}. Check the path/host and permissions.") from err
    except OSError as err:
        raise ValueError(f"job history {url!r} cannot be opened: {err}. Check the path and permissions.") from err


def _set_wal(cursor: Any, wait_s: float = 60.0) -> None:
    """Puts the database in WAL mode (kept in the file: the first opener sets it, the others find it). Switching the
    mode takes an exclusive lock and SQLite answers ``database is locked`` at once, without its busy timeout, while
    another process holds the file: ranks opening one new history together failed on it (CI). So it waits here."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")  # (an in-memory database answers "memory" and stays so)
            return
        except Exception as err:  # noqa: BLE001 - sqlite3.OperationalError; anything else is raised below
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sqlite_locking(engine: Engine) -> None:
    """WAL, a busy timeout and ``BEGIN IMMEDIATE`` (SQLAlchemy's recipe for pysqlite's transaction handling)."""

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # pysqlite must not emit its own BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout = 60000")
        _set_wal(cursor)
        cursor.execute("PRAGMA synchronous = NORMAL")  # WAL stays consistent; a power cut may drop the last commits
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
