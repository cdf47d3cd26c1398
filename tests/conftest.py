"""Test set-up: GPU tests skip without CUDA; on CPU, Triton kernels run through the interpreter."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit decorates a function (warpforge.kernels does the same).
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers share the cores: one intra-op pool each, sized to its share, instead of every worker
    # starting a pool as wide as the machine.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_configure(config):
    # pytest-xdist's --dist loadfile hands out whole files, by default in the order of their number of tests,
    # most first: a file of one or two slow tests (the real MobileNetV2, the demo, Gemma 3 270M) went last,
    # and the other worker sat idle while it ran alone. The files go in the order set below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _slow_files_first(items) -> None:
    """Under pytest-xdist: the files holding a `slow` test first (collection order among them), then the rest by
    number of tests, most first (xdist's own order): the long files start while many short ones are left to
    fill both workers at the end. Each file's tests keep their order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = {f for f, its in files.items() if any("slow" in item.keywords for item in its)}
    order = sorted(files, key=lambda f: (f not in slow, 0 if f in slow else -len(files[f])))
    items[:] = [item for f in order for item in files[f]]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _slow_files_first(items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_host(monkeypatch):
    """The busy-host check reads the load average, which other tests on the same cores push up: records and
    reports under test would carry a warning that depends on the neighbours. Tests of the check set their own."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    # Tables wrap at the terminal's width, which depends on how pytest was started (a terminal, a pipe, an
    # xdist worker); tests read whole cells. Tests of the width logic set or clear it themselves.
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Keep every test's cache and results store out of the user's home."""
    root = tmp_path_factory.mktemp("wf")
    monkeypatch.setenv("WARPFORGE_CACHE_DIR", str(root / "cache"))
    monkeypatch.setenv("WARPFORGE_DATA_DIR", str(root / "data"))
    monkeypatch.delenv("WARPFORGE_STORE", raising=False)
    # `gemma3-270m` resolves to one assembled GGUF shared by all tests (253 MB, ~18 s to assemble).
    monkeypatch.setenv("WARPFORGE_GEMMA3_270M", os.environ.get(
        "WARPFORGE_GEMMA3_270M", str(Path.home() / ".cache" / "warpforge-test" / "gemma-3-270m-q4_k_m.gguf")))
    # Tests check every tuning candidate explicitly (the *_every_candidate tests); tuning itself only
    # times, and would spend minutes of GPU time per shape. Tests of the tuner set this themselves.
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", os.environ.get("WARPFORGE_AUTOTUNE", "0"))
    # A process reads its settings once; tests change the environment between calls (monkeypatch.setenv),
    # so here every read sees the environment as it is (tests/test_settings.py checks the caching itself).
    from warpforge import settings

    monkeypatch.setattr(settings, "current", settings.Settings.from_env)


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: the GPU when present, else CPU through the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def triton_on_cpu():
    """Force the Triton path for CPU tensors (interpreter) so the kernel's own code is tested."""
    from warpforge.kernels import force_triton

    with force_triton():
        yield


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium (Debian's ``chromium`` package) for the browser tests: the report pages and the splat
    viewer. Installed when missing and allowed (root with apt-get), else the tests that ask for it skip."""
    exe = find_chromium()
    if exe is None and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        # Parallel workers each come here: the lock timeout makes the second wait for the first's install
        # instead of failing on dpkg's lock. An offline machine fails (or times out): the tests then skip.
        apt = "apt-get -o DPkg::Lock::Timeout=600"
        try:
            subprocess.run(f"{apt} update -qq && DEBIAN_FRONTEND=noninteractive {apt} install -y -qq chromium",
                           shell=True, check=False, timeout=900, capture_output=True)
        except subprocess.TimeoutExpired:
            pass
        exe = find_chromium()
    if exe is None:
        pytest.skip("headless Chromium is not installed and cannot be installed here "
                    "(needs root and apt-get: apt-get install chromium)")
    return exe
