"""warpforge's settings: every environment variable it reads is read here, once, and checked.

    from warpforge import settings
    settings.current().autotune        # "on", "off" or "retune"
    settings.cache_dir()               # the directory, created

``docs/settings.md`` is the table of them. The environment is read at the first :func:`current` call and
kept; :func:`reload` reads it again (a process that changes ``os.environ`` after warpforge has started, and
the test suite, call it). A value that cannot be parsed is a ValueError naming the variable, the values it
takes and the value given. A ``WARPFORGE_*`` variable that is not a setting (a switch of an experiment
that has ended, a typo) is named in a warning, once, so it is not silently believed to act.

This module is the bottom of the layering: standard library only, importable from ``warpforge.kernels``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")
AUTOTUNE_MODES = ("on", "off", "cold", "retune")

# Experiment switches that ended: the measured winner is plain code now (benchmarks/notes/optimize.md, the
# experiment switches entry, lists each one's figure).
REMOVED = {
    "WARPFORGE_INT8_FOLD": "the folded int8-out epilogue always runs",
    "WARPFORGE_INT8_ALU_CVT": "int8 conversions always go through integer and float adds",
    "WARPFORGE_TUNE_NARROW": "narrow convs are always tuned on their own list",
    "WARPFORGE_TUNE_RESIDUAL": "1x1 convs with a residual are always tuned on their own list",
    "WARPFORGE_DW_FP32_WEIGHTS": "depthwise convs read an fp32 weight copy for int8 output only",
    "WARPFORGE_PATCH_GEMM": "patch embeddings always run as one gather and a GEMM",
    "WARPFORGE_STEM_S2D": "image stems always run through space-to-depth",
    "WARPFORGE_CONV_TMA_EPI": "the pointwise conv epilogue uses TMA wherever the tensors allow it",
    "WARPFORGE_CONV_RES_PREFETCH": "removed (no gain measured)",
    "WARPFORGE_CONV_RES_DOT": "the residual tuner picks res_dot per tiling",
    "WARPFORGE_FUSE_NORM": "the float pipeline always runs the fuse_norm pass",
    "WARPFORGE_INT8_RESIDUAL": "on; quantize_model(int8_residual=False) turns it off",
    "WARPFORGE_INT8_BIAS_CORRECTION": "the int8 fallback always tries bias correction on its kept layers",
    "WARPFORGE_INT8_EQUALIZE": "removed (no accuracy gain measured)",
    "WARPFORGE_INT8_STEM": "removed (image stems stay float)",
    "WARPFORGE_INT8_DW_INPUT": "removed (depthwise convs read float input)",
    "WARPFORGE_GGUF": "use WARPFORGE_GEMMA3_270M",
    "WARPFORGE_AUTOTUNE_SHIPPED": "use WARPFORGE_AUTOTUNE=cold",
}
# Read by a command-line option (click's envvar), not here: listed so that setting them is not warned about.
CLI_VARIABLES = ("WARPFORGE_API_KEY",)


def _env(name: str) -> str | None:
    v = os.environ.get(name, "").strip()
    return v or None


def _flag(name: str, default: bool) -> bool:
    v = _env(name)
    if v is None:
        return default
    if v.lower() not in _TRUE + _FALSE:
        raise ValueError(f"{name}: expected 1/on/true/yes or 0/off/false/no, got {v!r}")
    return v.lower() in _TRUE


def _path(name: str) -> Path | None:
    v = _env(name)
    return None if v is None else Path(v).expanduser()


def _autotune() -> str:
    v = _env("WARPFORGE_AUTOTUNE")
    if v is None or v.lower() in _TRUE:
        return "on"
    if v.lower() in _FALSE:
        return "off"
    if v.lower() in ("cold", "retune"):
        return v.lower()
    raise ValueError(f"WARPFORGE_AUTOTUNE: expected 1/on, 0/off, cold or retune, got {v!r}")


def _seconds(name: str) -> float | None:
    v = _env(name)
    if v is None:
        return None
    try:
        s = float(v)
    except ValueError:
        s = float("nan")
    if not s > 0 or s == float("inf"):
        raise ValueError(f"{name}: expected a number of seconds > 0, got {v!r}")
    return s


@dataclass(frozen=True)
class Settings:
    """The settings in effect (None: the default the docstring names). Each field's variable is
    ``WARPFORGE_`` + its name in capitals (``VARIABLES``)."""

    cache_dir: Path | None  # re-creatable data: probe results, autotune winners (default: XDG cache)
    data_dir: Path | None  # data a user keeps: the results store (default: XDG data)
    store: str | None  # the results store: an SQLAlchemy URL (default: SQLite in data_dir)
    # "on": tune on a miss of the cache and of the winners shipped for known GPUs; "off": each kernel's default
    # config; "cold": as on, without the shipped winners; "retune": tune on every call, overwrite the cache
    autotune: str
    autotune_verbose: bool  # print each candidate's time while tuning
    gemma3_270m: Path | None  # where the bundled Gemma 3 270M GGUF is assembled (default: in cache_dir)
    git: str | None  # the revision records name, where the code runs from a copy without .git
    bench_max_autotune: bool  # bench vision runs its torch.compile max-autotune peers (latency rows, wall time)
    bench_wall_limit_s: float | None  # bench vision's wall-time case: each side's time limit
    # Experiments awaiting their GPU A/B (benchmarks/notes/llm.md); the EngineConfig field wins.
    pdl: bool  # programmatic dependent launch in the LLM engine's decode graphs
    fused_norm: bool  # the LLM engine's RMSNorms computed inside the next projection's GEMV
    # the variables set, as given (name, value): what a bench record names
    given: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_env(cls) -> Settings:
        """Read and check the environment now."""
        _warn_unknown()
        return cls(cache_dir=_path("WARPFORGE_CACHE_DIR"), data_dir=_path("WARPFORGE_DATA_DIR"),
                   store=_env("WARPFORGE_STORE"), autotune=_autotune(),
                   autotune_verbose=_flag("WARPFORGE_AUTOTUNE_VERBOSE", False),
                   gemma3_270m=_path("WARPFORGE_GEMMA3_270M"), git=_env("WARPFORGE_GIT"),
                   bench_max_autotune=_flag("WARPFORGE_BENCH_MAX_AUTOTUNE", True),
                   bench_wall_limit_s=_seconds("WARPFORGE_BENCH_WALL_LIMIT_S"),
                   pdl=_flag("WARPFORGE_PDL", False), fused_norm=_flag("WARPFORGE_FUSED_NORM", False),
                   given=tuple((k, v) for k in VARIABLES if (v := _env(k)) is not None))


VARIABLES = tuple(f"WARPFORGE_{f.name.upper()}" for f in fields(Settings) if f.name != "given")
# Where results go and which revision ran: they do not change what a benchmark measures.
NOT_KNOBS = ("WARPFORGE_CACHE_DIR", "WARPFORGE_DATA_DIR", "WARPFORGE_STORE", "WARPFORGE_GIT",
             "WARPFORGE_GEMMA3_270M")
_WARNED: set[str] = set()


def _warn_unknown() -> None:
    known = VARIABLES + CLI_VARIABLES
    for name in sorted(k for k in os.environ if k.startswith("WARPFORGE_") and k not in known):
        if name in _WARNED:
            continue
        _WARNED.add(name)
        why = REMOVED.get(name)
        warnings.warn(f"{name} is not read by warpforge any more: {why}" if why else
                      f"{name} is not a warpforge setting; they are: {', '.join(known)} (docs/settings.md)",
                      stacklevel=2)


_current: Settings | None = None


def current() -> Settings:
    """The settings, read from the environment at the first call."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def reload() -> Settings:
    """Read the environment again (after ``os.environ`` changed)."""
    global _current
    _current = None
    return current()


def knobs() -> dict[str, str]:
    """The settings set in the environment that change what a benchmark measures (autotuning, the
    pending experiments, ...), as given: a bench record names them."""
    return {k: v for k, v in current().given if k not in NOT_KNOBS}


def cache_dir() -> Path:
    """Re-creatable data (probe results per device, autotune winners, assembled models), created."""
    s = current()
    base = s.cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "warpforge"
    base.mkdir(parents=True, exist_ok=True)
    return base


def data_dir() -> Path:
    """Data a user keeps (the results store), created."""
    s = current()
    base = s.data_dir or Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "warpforge"
    base.mkdir(parents=True, exist_ok=True)
    return base


def default_store_url() -> str:
    """``WARPFORGE_STORE`` or an SQLite file in the data directory."""
    return current().store or f"sqlite:///{data_dir() / 'results.sqlite'}"


__all__ = ["AUTOTUNE_MODES", "CLI_VARIABLES", "Settings", "VARIABLES", "cache_dir", "current", "data_dir",
           "default_store_url", "knobs", "reload"]
