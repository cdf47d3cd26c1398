"""warpforge.settings: every WARPFORGE_* variable read in one place, checked, documented in docs/settings.md."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

from warpforge import settings
from warpforge.settings import current as CACHED_CURRENT  # before conftest re-reads on every call

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "warpforge"


@pytest.fixture
def clean_env(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("WARPFORGE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(settings, "_WARNED", set())
    return monkeypatch


def test_defaults(clean_env):
    s = settings.Settings.from_env()
    assert (s.cache_dir, s.data_dir, s.store, s.gemma3_270m, s.git, s.bench_wall_limit_s) == (None,) * 6
    assert s.autotune == "on" and not s.autotune_verbose and s.bench_max_autotune
    assert not s.pdl and not s.fused_norm and s.given == ()
    assert settings.knobs() == {}


def test_values_are_parsed(clean_env, tmp_path):
    for k, v in {"WARPFORGE_CACHE_DIR": str(tmp_path / "c"), "WARPFORGE_STORE": "postgresql://db/wf",
                 "WARPFORGE_AUTOTUNE": "Cold", "WARPFORGE_AUTOTUNE_VERBOSE": "yes", "WARPFORGE_GIT": "abc1234",
                 "WARPFORGE_BENCH_MAX_AUTOTUNE": "off", "WARPFORGE_BENCH_WALL_LIMIT_S": "90.5",
                 "WARPFORGE_PDL": "1"}.items():
        clean_env.setenv(k, v)
    s = settings.Settings.from_env()
    assert s.cache_dir == tmp_path / "c" and settings.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    assert s.store == "postgresql://db/wf" == settings.default_store_url()
    assert s.autotune == "cold" and s.autotune_verbose and s.git == "abc1234"
    assert not s.bench_max_autotune and s.bench_wall_limit_s == 90.5 and s.pdl
    # where results go and which revision ran are not knobs of what is measured
    assert settings.knobs() == {"WARPFORGE_AUTOTUNE": "Cold", "WARPFORGE_AUTOTUNE_VERBOSE": "yes",
                                "WARPFORGE_BENCH_MAX_AUTOTUNE": "off", "WARPFORGE_BENCH_WALL_LIMIT_S": "90.5",
                                "WARPFORGE_PDL": "1"}
    clean_env.setenv("WARPFORGE_AUTOTUNE", "0")
    assert settings.Settings.from_env().autotune == "off"
    clean_env.delenv("WARPFORGE_STORE")
    clean_env.setenv("WARPFORGE_DATA_DIR", str(tmp_path / "d"))
    assert settings.default_store_url() == f"sqlite:///{tmp_path / 'd' / 'results.sqlite'}"


@pytest.mark.parametrize("name, value, expected", [
    ("WARPFORGE_AUTOTUNE", "sometimes", "1/on, 0/off, cold or retune"),
    ("WARPFORGE_AUTOTUNE_VERBOSE", "2", "1/on/true/yes or 0/off/false/no"),
    ("WARPFORGE_PDL", "late", "1/on/true/yes or 0/off/false/no"),
    ("WARPFORGE_FUSED_NORM", "maybe", "1/on/true/yes or 0/off/false/no"),
    ("WARPFORGE_BENCH_WALL_LIMIT_S", "-3", "a number of seconds > 0"),
    ("WARPFORGE_BENCH_WALL_LIMIT_S", "ten", "a number of seconds > 0"),
])
def test_a_bad_value_names_the_variable_what_it_takes_and_what_it_got(clean_env, name, value, expected):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name}: expected {re.escape(expected)}, got {value!r}$"):
        settings.Settings.from_env()


def test_read_once_until_reload(clean_env):
    clean_env.setattr(settings, "current", CACHED_CURRENT)
    clean_env.setattr(settings, "_current", None)
    first = settings.current()
    clean_env.setenv("WARPFORGE_AUTOTUNE", "off")
    assert settings.current() is first and first.autotune == "on"
    assert settings.reload().autotune == "off" and settings.current().autotune == "off"


def test_unknown_variables_are_named_once(clean_env):
    clean_env.setenv("WARPFORGE_INT8_FOLD", "0")  # an experiment switch that ended
    clean_env.setenv("WARPFORGE_AUTOTUEN", "0")  # a typo
    clean_env.setenv("WARPFORGE_API_KEY", "secret")  # read by the server's --api-key option
    with pytest.warns(UserWarning) as caught:
        settings.Settings.from_env()
    msgs = sorted(str(w.message) for w in caught)
    assert len(msgs) == 2
    assert msgs[0].startswith("WARPFORGE_AUTOTUEN is not a warpforge setting; they are: WARPFORGE_CACHE_DIR")
    assert msgs[1] == "WARPFORGE_INT8_FOLD is not read by warpforge any more: the folded int8-out epilogue always runs"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings.Settings.from_env()  # said once per process


def _environment_reads(path: Path) -> list[str]:
    """``os.environ.get("WARPFORGE_...")``, ``os.getenv(...)``, ``os.environ["WARPFORGE_..."]`` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        arg = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("get", "getenv", "pop", "setdefault"):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("WARPFORGE_"):
            found.append(f"{path.relative_to(SRC)}:{node.lineno} {arg.value}")
    return found


def test_only_the_settings_module_reads_warpforge_variables():
    reads = [r for p in sorted(SRC.rglob("*.py")) if p.name != "settings.py" for r in _environment_reads(p)]
    assert reads == []


def test_docs_table_lists_every_setting():
    doc = (ROOT / "docs" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(WARPFORGE_[A-Z0-9_]+)`", doc, flags=re.M))
    assert documented == set(settings.VARIABLES + settings.CLI_VARIABLES)
