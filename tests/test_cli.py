"""The CLI's shape: every part has a sub-command."""

from __future__ import annotations

from click.testing import CliRunner

from warpforge.cli import main

COMMANDS = ["probe", "bench", "results", "profile", "optimize", "generate", "serve", "splat", "demo"]


def test_help_lists_every_part():
    out = CliRunner().invoke(main, ["--help"])
    assert out.exit_code == 0
    for name in COMMANDS:
        assert name in out.output


def test_version():
    import warpforge

    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and warpforge.__version__ in out.output


def test_public_api_imports():
    import importlib

    for mod in ["warpforge", "warpforge.kernels", "warpforge.bench", "warpforge.results", "warpforge.hw"]:
        m = importlib.import_module(mod)
        for name in m.__all__:
            assert hasattr(m, name), f"{mod}.{name} is exported but missing"
