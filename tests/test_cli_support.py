"""How every command fails and where its output goes: errors one line on stderr (exit 2 bad input, 1
otherwise), other libraries' noise in the log file unless --verbose, tables whole when piped."""

from __future__ import annotations

import io
import os
import sys

import click
import pytest
from click.testing import CliRunner

from warpforge import _cli_support as cs
from warpforge.cli import main


NOISY = """
import logging, os, sys, warnings
import click
from warpforge import _cli_support as cs

@click.group(cls=cs.WarpforgeGroup)
@click.option("--verbose", is_flag=True)
def g(verbose):
    pass

@g.command()
def noisy():
    warnings.warn_explicit("torchvision is not installed", FutureWarning, "/site-packages/tv/x.py", 1)
    warnings.warn_explicit("WARPFORGE_X is not a setting", UserWarning, os.path.join(cs.PACKAGE_DIR, "s.py"), 1)
    third = logging.getLogger("thirdparty.export")
    third.propagate = False
    third.addHandler(logging.StreamHandler())  # bound to sys.stderr now, as torch binds its handler at import
    third.warning("graph():\\n  %x = placeholder")
    import tqdm
    for _ in tqdm.tqdm(range(2), file=sys.stderr, desc="Writing model shards"):
        pass
    with cs.native_output_to_log():
        os.write(2, b"USDT: probe enabled\\n")
    click.echo("result")
    click.echo("ours on stderr", err=True)

g()
"""


def _run_noisy(tmp_path, *args):
    import subprocess

    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    env = {**os.environ, "WARPFORGE_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=60)
    logs = sorted((tmp_path / "cache" / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime)
    return r, logs[-1].read_text()


def test_each_process_writes_its_own_log(tmp_path):
    """Two commands of one user at once (a bench and a serve, say) must not write into one file."""
    pytest.importorskip("tqdm")
    import re
    import subprocess

    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    env = {**os.environ, "WARPFORGE_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, str(script), "noisy"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    logs = sorted((tmp_path / "cache" / "logs").glob("*.log"))
    assert len(logs) == 2, logs
    assert {int(re.fullmatch(r"\d{8}-\d{6}-(\d+)", p.stem).group(1)) for p in logs} == {p.pid for p in procs}
    for log in logs:  # each whole: its command line once, its noise once
        text = log.read_text()
        assert text.count("warpforge noisy") == 1 and text.count("torchvision is not installed") == 1, text


def test_old_logs_are_pruned(tmp_path):
    for i in range(cs.KEEP_LOGS + 5):
        old = tmp_path / f"20200101-0000{i:02d}-{i}.log"
        old.write_text("x")
        os.utime(old, (1_600_000_000 + i, 1_600_000_000 + i))
    cs._prune_logs(tmp_path)
    left = sorted(tmp_path.glob("*.log"))
    assert len(left) == cs.KEEP_LOGS and (tmp_path / "20200101-000000-0.log") not in left


def test_third_party_noise_goes_to_the_log_file(tmp_path):
    pytest.importorskip("tqdm")
    r, log = _run_noisy(tmp_path, "noisy")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "result\n"
    assert "WARPFORGE_X is not a setting" in r.stderr and "ours on stderr" in r.stderr
    for noise in ("torchvision", "placeholder", "Writing model shards", "USDT"):
        assert noise not in r.stderr
        assert noise in log


def test_verbose_shows_the_noise_and_is_taken_anywhere(tmp_path):
    pytest.importorskip("tqdm")
    r, log = _run_noisy(tmp_path, "noisy", "--verbose")
    assert r.returncode == 0, r.stderr
    for noise in ("torchvision", "placeholder", "Writing model shards", "USDT: probe enabled"):
        assert noise in r.stderr


def _group():
    @click.group(cls=cs.WarpforgeGroup)
    @click.option("--verbose", is_flag=True)
    def g(verbose):
        pass

    @g.command()
    @click.argument("kind")
    def fails(kind):
        if kind == "value":
            raise ValueError("--size: expected WIDTHxHEIGHT, got '12'")
        raise KeyError("boom")

    return g


def test_unhandled_errors_are_one_line():
    bad = CliRunner().invoke(_group(), ["fails", "value"])
    assert bad.exit_code == 2 and bad.stderr == "warpforge fails: --size: expected WIDTHxHEIGHT, got '12'\n"
    assert bad.stdout == ""
    crash = CliRunner().invoke(_group(), ["fails", "crash"])
    assert crash.exit_code == 1 and crash.stderr.count("\n") == 1
    assert crash.stderr.startswith("warpforge fails: internal error: KeyError: 'boom'; the traceback is in")
    log = crash.stderr.rstrip().split("the traceback is in ")[1].split(" (--verbose")[0]
    assert log == str(cs.log_path()) and "Traceback" in cs.log_path().read_text()
    loud = CliRunner().invoke(_group(), ["--verbose", "fails", "crash"])
    assert loud.exit_code == 1 and "Traceback (most recent call last)" in loud.stderr


def test_tables_keep_their_width_when_stdout_is_not_a_terminal(monkeypatch):
    from rich.table import Table

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    t = Table()
    for i in range(12):
        t.add_column(f"column number {i}")
    t.add_row(*[f"value {i} that is long" for i in range(12)])
    cs.make_console().print(t)
    text = sys.stdout.getvalue()
    assert "…" not in text and "value 11 that is long" in text and max(map(len, text.splitlines())) > 200


def test_rules_are_not_wider_than_a_window_when_stdout_is_not_a_terminal(monkeypatch):
    """Off a terminal the console is WIDE (whole table rows), but a section rule fills the width it is given:
    1,000 dashes in a log file. Every command's console comes from make_console, so the rule is in one place."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    console = cs.make_console()
    console.rule("1/6  a step")
    console.print("x " * 300)  # text is not cut or wrapped at the rule's width either
    rule, text = sys.stdout.getvalue().splitlines()[:2]
    assert len(rule) == cs.RULE_WIDTH and "1/6  a step" in rule
    assert len(text.rstrip()) == 599
    monkeypatch.setenv("COLUMNS", "70")  # a width the user set is every line's
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    cs.make_console().rule("t")
    assert len(sys.stdout.getvalue().rstrip("\n")) == 70


def test_every_console_comes_from_make_console():
    """A bare rich Console off a terminal is 80 columns: its tables would wrap where make_console's do not."""
    import re
    from pathlib import Path

    src = Path(cs.PACKAGE_DIR)
    bare = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*.py")) if p.name != "_cli_support.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bConsole\(", line)]
    assert not bare, bare


def test_dtype_spellings_are_both_accepted():
    choice = cs.AliasChoice(["auto", "fp32", "fp16", "bf16"], {"float16": "fp16", "bfloat16": "bf16"})
    assert choice.convert("float16", None, None) == "fp16" and choice.convert("bf16", None, None) == "bf16"
    with pytest.raises(click.BadParameter):
        choice.convert("int3", None, None)


def test_main_help_lists_verbose():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "--verbose" in r.output
