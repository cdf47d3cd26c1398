"""The results store: every bench run appended to a database (SQLite by default, any SQLAlchemy URL).

Two tables: ``runs`` (one row per ``warpforge bench`` invocation) and ``records`` (one row per case,
the full record as JSON text plus ``ours_ms`` for quick queries), and a small ``warpforge_meta``
table that marks a database as ours and carries the schema version.

SQLite details, because two bench processes may append at once:
* every connection gets a busy timeout, so a writer waits for the other instead of failing;
* write transactions start with BEGIN IMMEDIATE (take the write lock up front: a deferred
  transaction that read first can fail to upgrade without waiting);
* the file is switched to WAL journaling once it is known to be ours, so readers never block writers.
A file that is not SQLite, a database with someone else's tables, or one written by a newer
warpforge is refused with a one-line ``StoreError`` naming it; nothing is ever deleted or rewritten.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url

from warpforge.results.record import dumps, now_iso, validate_record

SCHEMA_VERSION = 1
APP_MARK = "warpforge-results"
BUSY_TIMEOUT_MS = 60_000
# Below this relative change two runs are "the same" even when both spreads are tiny (clock jitter).
FLAG_FLOOR = 0.02

_md = sa.MetaData()
meta_table = sa.Table(
    "warpforge_meta", _md,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
)
runs_table = sa.Table(
    "runs", _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("suite", sa.String(128), nullable=False, index=True),
    sa.Column("started", sa.String(40), nullable=False),  # ISO 8601 UTC
    sa.Column("finished", sa.String(40), nullable=False),
    sa.Column("git", sa.String(64)),
    sa.Column("device", sa.String(256), nullable=False),
    sa.Column("host", sa.String(256)),
    sa.Column("argv", sa.Text),  # JSON list
    sa.Column("n_records", sa.Integer, nullable=False),
    sa.Column("n_failed", sa.Integer, nullable=False),  # records whose correctness check failed
    sa.Column("warpforge_version", sa.String(32)),
    sa.Column("schema_version", sa.Integer, nullable=False),
)
records_table = sa.Table(
    "records", _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False, index=True),
    sa.Column("case", sa.String(256), nullable=False),
    sa.Column("ours_ms", sa.Float),  # null when ours failed
    sa.Column("record", sa.Text, nullable=False),  # the full record, JSON
)


class StoreError(RuntimeError):
    """The store cannot be used (not a database, not ours, too new, unreachable, no such run)."""


class StoreMissing(StoreError):
    """Opened for reading, but there is no store there yet."""


def to_url(url_or_path: str | Path) -> str:
    """An SQLAlchemy URL as given, or ``sqlite:///`` + the absolute path for a plain path."""
    s = str(url_or_path)
    return s if "://" in s else f"sqlite:///{Path(s).expanduser().resolve()}"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # Our own BEGIN (below) instead of the driver's implicit, deferred one.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cur.close()


def _sqlite_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("wf_write") else "BEGIN")


class Store:
    """A results database. ``create=False`` (readers) refuses to create one where none exists."""

    def __init__(self, url_or_path: str | Path, *, create: bool = True) -> None:
        self.url = to_url(url_or_path)
        try:
            parsed = make_url(self.url)
        except sa.exc.ArgumentError as e:
            raise StoreError(f"results store: not a valid SQLAlchemy URL or path: {url_or_path!s} ({e})") from None
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        db = parsed.database or ""
        file_db = self.is_sqlite and db not in ("", ":memory:")
        self.where = db if file_db else parsed.render_as_string(hide_password=True)
        if self.is_sqlite and db not in ("", ":memory:"):
            path = Path(db)
            if not path.exists():
                if not create:
                    raise StoreMissing(f"no results store at {path} (`warpforge bench SUITE` creates it)")
                path.parent.mkdir(parents=True, exist_ok=True)
            elif path.is_dir():
                raise StoreError(f"results store {path} is a directory, expected an SQLite file")
        try:
            self.engine: Engine = sa.create_engine(self.url)
        except ImportError as e:
            raise StoreError(f"results store {self.where}: database driver not installed ({e.name or e})") from None
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"results store {self.where}: {e}") from None
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
            event.listen(self.engine, "begin", _sqlite_begin)
        self._writer = self.engine.execution_options(wf_write=True)
        try:
            self._init_schema()
        except StoreError:
            self.engine.dispose()
            raise

    # ---- plumbing ------------------------------------------------------------------------------

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Database errors become one-line StoreErrors that name the store."""
        try:
            yield
        except sa.exc.SQLAlchemyError as e:
            orig = getattr(e, "orig", None)
            msg = str(orig if orig is not None else e).splitlines()[0]
            if self.is_sqlite and "file is not a database" in msg:
                raise StoreError(f"{self.where} is not an SQLite database (file is not a database)") from None
            raise StoreError(f"results store {self.where}: {msg}") from None

    def _init_schema(self) -> None:
        with self._errors(), self._writer.begin() as conn:
            tables = set(sa.inspect(conn).get_table_names())
            if meta_table.name not in tables:
                mine = tables & {runs_table.name, records_table.name}
                if mine or (self.is_sqlite and tables):
                    shown = ", ".join(sorted(tables)[:6]) + (", ..." if len(tables) > 6 else "")
                    raise StoreError(f"{self.where} is not a warpforge results store (it holds tables: {shown})")
                _md.create_all(conn)
                conn.execute(sa.insert(meta_table), [{"key": "app", "value": APP_MARK},
                                                     {"key": "schema_version", "value": str(SCHEMA_VERSION)}])
            else:
                self._check_ours(conn, tables)
        if self.is_sqlite:
            self._enable_wal()

    def _check_ours(self, conn: Connection, tables: set[str]) -> None:
        meta = {k: v for k, v in conn.execute(sa.select(meta_table.c.key, meta_table.c.value))}
        if meta.get("app") != APP_MARK:
            raise StoreError(f"{self.where} is not a warpforge results store (foreign warpforge_meta table)")
        try:
            version = int(meta.get("schema_version", ""))
        except ValueError:
            raise StoreError(f"{self.where}: unreadable schema version {meta.get('schema_version')!r}") from None
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.where} was written by a newer warpforge (store schema {version}, this "
                             f"warpforge reads up to {SCHEMA_VERSION}); upgrade warpforge to use it")
        insp = sa.inspect(conn)
        for table in (runs_table, records_table):
            if table.name not in tables:
                raise StoreError(f"{self.where}: warpforge results store is missing its {table.name!r} table")
            have = {c["name"] for c in insp.get_columns(table.name)}
            missing = [c.name for c in table.columns if c.name not in have]
            if missing:
                raise StoreError(f"{self.where}: table {table.name!r} lacks columns {missing}: not our schema")

    def _enable_wal(self) -> None:
        # Persistent in the file; outside any transaction (SQLite refuses the switch inside one). If
        # another process holds the file the switch may be refused: rollback journaling stays correct.
        raw = self.engine.raw_connection()
        try:
            cur = raw.cursor()
            cur.execute("PRAGMA journal_mode = WAL")
            cur.close()
        except Exception:  # noqa: BLE001 - best effort; the busy timeout alone keeps writers safe
            pass
        finally:
            raw.close()

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- writing -------------------------------------------------------------------------------

    def add_run(self, suite: str, records: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None) -> int:
        """Append one run and its records in one transaction; returns the run id.

        ``meta`` may give started, finished, git, device, host, argv; missing ones are filled in.
        """
        records = list(records)
        for r in records:
            validate_record(r)
            if r["suite"] != suite:
                raise ValueError(f"record {r['case']!r} is from suite {r['suite']!r}, not {suite!r}")
        meta = dict(meta or {})
        first = records[0] if records else {}
        from warpforge import __version__

        row = {
            "suite": suite,
            "started": meta.get("started") or now_iso(),
            "finished": meta.get("finished") or now_iso(),
            "git": meta.get("git", first.get("git")),
            "device": meta.get("device") or first.get("device", {}).get("name") or "unknown",
            "host": meta.get("host") or socket.gethostname(),
            "argv": json.dumps(list(meta.get("argv", sys.argv))),
            "n_records": len(records),
            "n_failed": sum(1 for r in records if not r["correct"]["ok"]),
            "warpforge_version": __version__,
            "schema_version": SCHEMA_VERSION,
        }
        with self._errors(), self._writer.begin() as conn:
            run_id = int(conn.execute(sa.insert(runs_table).values(**row)).inserted_primary_key[0])
            if records:
                conn.execute(sa.insert(records_table), [
                    {"run_id": run_id, "case": r["case"], "ours_ms": r["ours"].get("ms"), "record": dumps(r)}
                    for r in records])
        return run_id

    # ---- reading -------------------------------------------------------------------------------

    @staticmethod
    def _run_dict(row: Any) -> dict[str, Any]:
        d = dict(row._mapping)
        try:
            d["argv"] = json.loads(d["argv"]) if d.get("argv") else []
        except json.JSONDecodeError:
            pass  # shown as stored
        return d

    def list_runs(self, suite: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """Runs, newest first."""
        q = sa.select(runs_table).order_by(runs_table.c.id.desc()).limit(max(int(limit), 0))
        if suite:
            q = q.where(runs_table.c.suite == suite)
        with self._errors(), self.engine.connect() as conn:
            return [self._run_dict(r) for r in conn.execute(q)]

    def resolve(self, run: int | str) -> int:
        """A run id from an id, a numeric string, or "latest"."""
        if isinstance(run, str) and run.strip().lower() == "latest":
            with self._errors(), self.engine.connect() as conn:
                rid = conn.execute(sa.select(sa.func.max(runs_table.c.id))).scalar()
            if rid is None:
                raise StoreError(f"{self.where} holds no runs yet")
            return int(rid)
        try:
            return int(run)
        except (TypeError, ValueError):
            raise StoreError(f"run must be a run id (see `warpforge results list`) or 'latest', got {run!r}") from None

    def get_run(self, run: int | str) -> dict[str, Any]:
        """{"run": the runs row, "records": [record, ...]} in the order they were run."""
        rid = self.resolve(run)
        with self._errors(), self.engine.connect() as conn:
            row = conn.execute(sa.select(runs_table).where(runs_table.c.id == rid)).first()
            if row is None:
                raise StoreError(f"no run {rid} in {self.where} (see `warpforge results list`)")
            recs = conn.execute(sa.select(records_table.c.record).where(records_table.c.run_id == rid)
                                .order_by(records_table.c.id)).scalars().all()
        try:
            records = [json.loads(r) for r in recs]
        except json.JSONDecodeError as e:
            raise StoreError(f"{self.where}: run {rid} has an unreadable record ({e})") from None
        return {"run": self._run_dict(row), "records": records}

    def case_records(self, case: str | None = None,
                     suite: str | None = None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(run row, record) of every stored record of ``case`` and/or ``suite`` (all when None), oldest run
        first: a case's history in one query."""
        q = (sa.select(runs_table, records_table.c.record)
             .join(records_table, records_table.c.run_id == runs_table.c.id)
             .order_by(runs_table.c.id, records_table.c.id))
        if case is not None:
            q = q.where(records_table.c.case == case)
        if suite is not None:
            q = q.where(runs_table.c.suite == suite)
        with self._errors(), self.engine.connect() as conn:
            rows = conn.execute(q).all()
        out = []
        for row in rows:
            d = self._run_dict(row)
            text = d.pop("record")
            try:
                out.append((d, json.loads(text)))
            except json.JSONDecodeError as e:
                raise StoreError(f"{self.where}: run {d['id']} has an unreadable record ({e})") from None
        return out

    def compare(self, a: int | str, b: int | str) -> list[dict[str, Any]]:
        """Per-case rows of run B against run A (see ``compare_records``)."""
        return compare_records(self.get_run(a)["records"], self.get_run(b)["records"])


def _rel_spread(rec: dict[str, Any]) -> float | None:
    ours = rec.get("ours", {})
    ms, iqr = ours.get("ms"), ours.get("iqr_ms")
    return iqr / ms if ms and iqr is not None else None


def compare_records(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]],
                    floor: float = FLAG_FLOOR) -> list[dict[str, Any]]:
    """One row per case in either run: a_ms, b_ms, ratio = a_ms / b_ms (above 1: B is faster), each
    side's p20/p80 and relative spread (IQR / median), and a flag "faster"/"slower" when the change
    exceeds both runs' relative spread plus ``floor``; "only in A"/"only in B" for unmatched cases."""
    by_a = {r["case"]: r for r in a}
    by_b = {r["case"]: r for r in b}
    names = list(by_a) + [n for n in by_b if n not in by_a]
    rows = []
    for name in names:
        ra, rb = by_a.get(name), by_b.get(name)
        oa = (ra or {}).get("ours", {})
        ob = (rb or {}).get("ours", {})
        row = {"case": name, "a_ms": oa.get("ms"), "b_ms": ob.get("ms"),
               "a_p20_ms": oa.get("p20_ms"), "a_p80_ms": oa.get("p80_ms"),
               "b_p20_ms": ob.get("p20_ms"), "b_p80_ms": ob.get("p80_ms"),
               "a_spread": _rel_spread(ra) if ra else None, "b_spread": _rel_spread(rb) if rb else None,
               "ratio": None, "threshold": None, "flag": ""}
        if ra is None or rb is None:
            row["flag"] = "only in B" if ra is None else "only in A"
        elif row["a_ms"] and row["b_ms"]:
            ratio = row["a_ms"] / row["b_ms"]
            thr = max(row["a_spread"] or 0.0, row["b_spread"] or 0.0) + floor
            row["ratio"], row["threshold"] = ratio, thr
            row["flag"] = "faster" if ratio - 1 > thr else "slower" if 1 / ratio - 1 > thr else ""
        rows.append(row)
    return rows
