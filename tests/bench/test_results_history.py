"""`warpforge results history` and `warpforge results check`: a case over runs, and the regression gate.

Both run against SQLite (the default store) and against a PostgreSQL server this module starts itself in a
temporary directory (Debian's postgresql package, on a Unix socket, as an unprivileged user; stopped and
removed at the end), through psycopg. Where PostgreSQL cannot be installed the PostgreSQL cases skip with the
reason; each case prints which database it ran against.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from warpforge.results.history import (FLOOR, committed_records, find_case, gate, history, noise_band, regressions,
                                       spread, store_records)
from warpforge.results.record import write_jsonl
from warpforge.results.store import Store
from warpforge.cli import main

from .conftest import fake_record

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results" / "h200"


# ---- a PostgreSQL server of our own ------------------------------------------------------------------

def _pg_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    return Path(dirs[-1]) if dirs else None


def _install_postgres() -> None:
    if os.geteuid() == 0 and shutil.which("apt-get"):
        try:  # an offline machine fails here (or times out): the PostgreSQL cases then skip
            subprocess.run("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql", shell=True,
                           timeout=300, capture_output=True)
        except subprocess.TimeoutExpired:
            pass


class PostgresServer:
    """initdb + pg_ctl in a temporary directory, listening on a Unix socket only."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="wf-pg-"))  # short: a socket path must stay under 107 bytes
        # initdb refuses to run as root: the server runs as an unprivileged user that owns the directory
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "nobody", "nogroup")
            self.as_user = ["runuser", "-u", "nobody", "--"]
        self.data = self.dir / "data"

    def _run(self, *args: str, timeout: float = 60) -> None:
        r = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{Path(args[0]).name} failed: {(r.stderr or r.stdout).strip()[-500:]}")

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "wf", "-E", "UTF8",
                  "--no-sync")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "30",
                  "-o", f"-k {self.dir} -c listen_addresses='' -F", "start")

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop",
                          timeout=30)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def version(self) -> str:
        r = subprocess.run([str(self.bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=10)
        return r.stdout.strip()

    def new_database(self) -> str:
        """A fresh database per test, as an SQLAlchemy URL over the socket."""
        import sqlalchemy as sa

        name = "wf_" + uuid.uuid4().hex[:12]
        admin = sa.create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        admin.dispose()
        return self.url(name)

    def url(self, db: str) -> str:
        return f"postgresql+psycopg://wf@/{db}?host={self.dir}"


@pytest.fixture(scope="module")
def postgres():
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'warpforge[postgres]'): the SQLite cases cover this")
    if _pg_bin() is None:
        _install_postgres()
    bindir = _pg_bin()
    if bindir is None or not (bindir / "initdb").exists():
        pytest.skip("PostgreSQL is not installed and cannot be installed here (apt-get install postgresql): "
                    "the SQLite cases cover this")
    server = PostgresServer(bindir)
    try:
        server.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        server.stop()
        pytest.skip(f"PostgreSQL did not start here ({e}): the SQLite cases cover this")
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path, capsys):
    if request.param == "sqlite":
        url, said = f"sqlite:///{tmp_path / 'results.sqlite'}", "SQLite (file)"
    else:
        server = request.getfixturevalue("postgres")
        url, said = server.new_database(), f"{server.version()} (a server this test started)"
    with capsys.disabled():
        print(f"\n  [results store: {said}]", end=" ")
    return url


# ---- synthetic runs ------------------------------------------------------------------------------------

def _rec(case: str, ms: float, time: str, iqr: float = 0.02, ok: bool = True) -> dict:
    r = fake_record(case, ms=ms, iqr=iqr, ok=ok, suite="kernels")
    r.update(time=time, git=f"{abs(hash((case, time))):x}"[:7])
    return r


def _runs(store: Store, slow: float) -> tuple[int, int, int]:
    """A baseline, a run within the noise, and a run where case "b" is ``slow`` times slower."""
    base = store.add_run("kernels", [_rec("a", 1.0, "2026-01-01T00:00:00+00:00"),
                                     _rec("b", 2.0, "2026-01-01T00:00:00+00:00", iqr=0.04)])
    noise = store.add_run("kernels", [_rec("a", 1.015, "2026-01-02T00:00:00+00:00"),
                                      _rec("b", 1.97, "2026-01-02T00:00:00+00:00", iqr=0.04)])
    worse = store.add_run("kernels", [_rec("a", 0.99, "2026-01-03T00:00:00+00:00"),
                                      _rec("b", 2.0 * slow, "2026-01-03T00:00:00+00:00", iqr=0.04)])
    return base, noise, worse


def test_noise_band_from_the_records_spread():
    a, b = _rec("a", 1.0, "t1", iqr=0.1), _rec("a", 1.0, "t2", iqr=0.02)
    assert spread(a) == pytest.approx(1.05 / 0.95 - 1)
    assert noise_band(a, b) == pytest.approx(1.05 / 0.95 - 1 + FLOOR)
    single = _rec("a", 1.0, "t3", iqr=0.0)  # one repeat: no spread of its own
    assert spread(single) is None and noise_band(single, single) == pytest.approx(0.10 + FLOOR)


def test_history_and_gate_in_the_store(store_url):
    with Store(store_url) as s:
        base, noise, worse = _runs(s, slow=1.25)
        items = store_records(s, case="b")
        assert [x.source for x in items] == [f"store run {base}", f"store run {noise}", f"store run {worse}"]
        pts = history(store_records(s), "b", "kernels")
        assert [p.ms for p in pts] == pytest.approx([2.0, 1.97, 2.5])
        assert [p.flag for p in pts] == ["", "", "slower"]
        assert pts[2].change == pytest.approx(2.5 / 1.97) and pts[2].band < 0.1  # against the point before
        assert pts[2].ratio == {"torch": pytest.approx(2.0 / 2.5)}
        got = {r.case: r.flag for r in gate(s.get_run(base)["records"], s.get_run(noise)["records"])}
        assert got == {"a": "", "b": ""}  # noise passes
        bad = regressions(gate(s.get_run(base)["records"], s.get_run(worse)["records"]))
        assert [(r.case, r.flag) for r in bad] == [("b", "slower")]  # a synthetic regression fails


def test_gate_flags_a_failed_check_and_a_missing_case_and_never_compares_other_setups():
    base = [_rec("a", 1.0, "t1"), _rec("b", 1.0, "t1"), _rec("d", 1.0, "t1"), _rec("e", 1.0, "t1")]
    other_gpu, knob = _rec("d", 9.0, "t2"), _rec("e", 9.0, "t2")
    other_gpu["device"] = {**other_gpu["device"], "name": "NVIDIA H100"}
    knob["device"] = {**knob["device"], "knobs": {"WARPFORGE_AUTOTUNE": "0"}}
    now = [_rec("a", 0.5, "t2", ok=False), _rec("c", 1.0, "t2"), other_gpu, knob]
    rows = {r.case: r.flag for r in gate(base, now)}
    assert rows == {"a": "check failed", "b": "missing", "c": "new", "d": "other device", "e": "other settings"}
    assert [r.case for r in regressions(gate(base, now))] == ["a"]


def test_check_cli_exit_codes(store_url, tmp_path):
    runner = CliRunner()
    with Store(store_url) as s:
        base, noise, worse = _runs(s, slow=1.25)
    ok = runner.invoke(main, ["results", "check", "--baseline", str(base), "--run", str(noise), "--store", store_url])
    assert ok.exit_code == 0 and "no regression in 2 case(s)" in ok.output, ok.output
    bad = runner.invoke(main, ["results", "check", "--baseline", str(base), "--store", store_url])  # --run latest
    assert bad.exit_code == 1 and "1 of 2 case(s) regressed" in bad.output and "b (slower)" in bad.output
    js = runner.invoke(main, ["results", "check", "--baseline", str(base), "--store", store_url, "--json"])
    assert js.exit_code == 1 and '"regressed": 1' in js.stdout
    # a baseline from committed-style JSON lines against a stored run
    t0 = "2025-12-31T00:00:00+00:00"
    write_jsonl(tmp_path / "kernels.jsonl", [_rec("a", 1.0, t0), _rec("b", 2.0, t0, iqr=0.04)])
    mixed = runner.invoke(main, ["results", "check", "--baseline", str(tmp_path), "--run", str(noise),
                                 "--store", store_url])
    assert mixed.exit_code == 0, mixed.output
    nope = runner.invoke(main, ["results", "check", "--baseline", "999", "--store", store_url])
    assert nope.exit_code == 2 and "no run 999" in nope.output


def test_history_cli(store_url):
    with Store(store_url) as s:
        _runs(s, slow=1.25)
    runner = CliRunner()
    out = runner.invoke(main, ["results", "history", "b", "--store", store_url, "--no-git",
                               "--records", str(COMMITTED / "memory.jsonl")])
    assert out.exit_code == 0, out.output
    assert out.output.count("store run") == 3 and "slower +26.9%" in out.output, out.output
    js = runner.invoke(main, ["results", "history", "b", "--store", store_url, "--json", "--no-git",
                              "--records", str(COMMITTED / "memory.jsonl")])
    assert js.exit_code == 0 and '"flag": "slower"' in js.stdout
    out = runner.invoke(main, ["results", "history", "zzz", "--store", store_url, "--no-git",
                               "--records", str(COMMITTED / "memory.jsonl")])
    assert out.exit_code == 2 and "no case named 'zzz'" in out.output


def test_committed_records_history_and_gate():
    """The committed records with their git history: every case found, and they pass the gate against
    themselves (a gate that fails on identical runs would be useless in CI)."""
    items = committed_records(COMMITTED)
    assert find_case(items, "resnet50 batch 32 int8") == ("vision", "resnet50 batch 32 int8")
    with pytest.raises(LookupError, match="matches .* cases"):
        find_case(items, "batch 32")
    pts = history(items, "mobilenet_v2 batch 32 real weights", "vision")
    assert len(pts) >= 4 and pts == sorted(pts, key=lambda p: p.time)
    runner = CliRunner()
    out = runner.invoke(main, ["results", "check", "--baseline", str(COMMITTED), "--run", str(COMMITTED)])
    assert out.exit_code == 0 and "no regression" in out.output, out.output
