"""The results store: round trip, concurrent writers, refusal of files that are not ours, compare."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

import pytest

from warpforge.results.store import SCHEMA_VERSION, Store, StoreError, StoreMissing, compare_records, to_url

from .conftest import fake_record


def test_round_trip(tmp_path, make_record):
    path = tmp_path / "r.sqlite"
    with Store(path) as s:
        recs = [make_record("a", ms=1.0), make_record("b", ms=2.0, ok=False)]
        rid = s.add_run("s", recs, {"argv": ["warpforge", "bench", "s"], "started": "2026-01-01T00:00:00+00:00"})
        rid2 = s.add_run("other", [make_record("a", suite="other")])
    with Store(str(path), create=False) as s:
        runs = s.list_runs()
        assert [r["id"] for r in runs] == [rid2, rid]
        assert [r["id"] for r in s.list_runs(suite="s")] == [rid]
        assert len(s.list_runs(limit=1)) == 1
        got = s.get_run(rid)
        assert got["records"] == recs
        meta = got["run"]
        assert meta["suite"] == "s" and meta["n_records"] == 2 and meta["n_failed"] == 1
        assert meta["argv"] == ["warpforge", "bench", "s"] and meta["device"] == "cpu"
        assert meta["schema_version"] == SCHEMA_VERSION
        assert s.get_run("latest")["run"]["id"] == rid2
        assert s.get_run(str(rid))["run"]["id"] == rid
        with pytest.raises(StoreError, match="no run 999"):
            s.get_run(999)
        with pytest.raises(StoreError, match="run id"):
            s.get_run("yesterday")
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_add_run_validates_records(tmp_path, make_record):
    with Store(tmp_path / "r.sqlite") as s:
        bad = make_record("a")
        bad["ours"]["ms"] = float("nan")
        with pytest.raises(ValueError):
            s.add_run("s", [bad])
        with pytest.raises(ValueError, match="from suite"):
            s.add_run("t", [make_record("a", suite="s")])
        assert s.list_runs() == []  # nothing half-written


def _append_runs(path: str, worker: int, n_runs: int, barrier) -> None:
    barrier.wait()  # both writers start together so their transactions really overlap
    with Store(path) as s:
        for i in range(n_runs):
            s.add_run("s", [fake_record(f"case {j}", ms=1.0 + worker + i / 10) for j in range(4)],
                      {"argv": [f"w{worker}", str(i)]})


def test_concurrent_appends_from_two_processes(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_append_runs, args=(path, w, 8, barrier)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    with Store(path, create=False) as s:
        runs = s.list_runs(limit=100)
        assert len(runs) == 16
        assert sorted(tuple(r["argv"]) for r in runs) == sorted((f"w{w}", str(i)) for w in range(2) for i in range(8))
        assert all(len(s.get_run(r["id"])["records"]) == 4 for r in runs)
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("SELECT count(*) FROM records").fetchone()[0] == 64


def test_garbage_file_is_refused_untouched(tmp_path):
    p = tmp_path / "results.sqlite"
    content = b"this is a CSV, not a database\n" * 200
    p.write_bytes(content)
    with pytest.raises(StoreError, match=r"results.sqlite is not an SQLite database") as e:
        Store(p)
    assert "\n" not in str(e.value)
    assert p.read_bytes() == content


def test_foreign_sqlite_is_refused_untouched(tmp_path):
    p = tmp_path / "app.db"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    con.execute("INSERT INTO users VALUES (1, 'ada')")
    con.commit()
    con.close()
    before = p.read_bytes()
    with pytest.raises(StoreError, match=r"app.db is not a warpforge results store \(it holds tables: users\)"):
        Store(p)
    assert p.read_bytes() == before


def test_foreign_tables_named_like_ours_are_refused(tmp_path):
    p = tmp_path / "x.db"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE runs (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="not a warpforge results store"):
        Store(p)


def test_newer_schema_is_refused(tmp_path):
    p = tmp_path / "r.sqlite"
    Store(p).close()
    con = sqlite3.connect(p)
    con.execute("UPDATE warpforge_meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="newer warpforge"):
        Store(p)


def test_missing_store_for_readers_and_paths(tmp_path):
    with pytest.raises(StoreMissing, match="no results store"):
        Store(tmp_path / "none.sqlite", create=False)
    assert not (tmp_path / "none.sqlite").exists()
    with pytest.raises(StoreError, match="directory"):
        Store(tmp_path)
    assert to_url("sqlite:///x.db") == "sqlite:///x.db"
    assert to_url(tmp_path / "a.db") == f"sqlite:///{tmp_path / 'a.db'}"
    with pytest.raises(StoreError, match="driver not installed|postgresql"):
        Store("postgresql+nosuchdriver://u:secret@localhost/db")


def test_sqlalchemy_url_in_memory(make_record):
    with Store("sqlite://") as s:
        rid = s.add_run("s", [make_record("a")])
        assert s.get_run(rid)["records"][0]["case"] == "a"


def test_compare_flags_a_2x_change_not_a_1pct_change(tmp_path, make_record):
    with Store(tmp_path / "r.sqlite") as s:
        a = s.add_run("s", [make_record("same", ms=1.00, iqr=0.01), make_record("sped", ms=2.0, iqr=0.02),
                            make_record("slowed", ms=1.0, iqr=0.01), make_record("gone", ms=1.0)])
        b = s.add_run("s", [make_record("same", ms=1.01, iqr=0.01), make_record("sped", ms=1.0, iqr=0.01),
                            make_record("slowed", ms=2.0, iqr=0.02), make_record("new", ms=1.0)])
        rows = {r["case"]: r for r in s.compare(a, b)}
    assert rows["same"]["flag"] == "" and rows["same"]["ratio"] == pytest.approx(1 / 1.01)
    assert rows["sped"]["flag"] == "faster" and rows["sped"]["ratio"] == pytest.approx(2.0)
    assert rows["slowed"]["flag"] == "slower" and rows["slowed"]["ratio"] == pytest.approx(0.5)
    assert rows["gone"]["flag"] == "only in A" and rows["new"]["flag"] == "only in B"
    assert rows["same"]["a_spread"] == pytest.approx(0.01)


def test_compare_respects_a_noisy_run(make_record):
    # A 20% change inside a run whose spread is 30% is not a change.
    rows = compare_records([make_record("c", ms=1.0, iqr=0.3)], [make_record("c", ms=0.8, iqr=0.01)])
    assert rows[0]["flag"] == "" and rows[0]["threshold"] == pytest.approx(0.32)
