"""A profile on a busy machine says so, and an overhead below the noise is never printed as a figure."""

from __future__ import annotations

import dataclasses
import os

import torch
from rich.console import Console
from torch import nn

from warpforge.profile.api import below_noise, profile
from warpforge.profile.cli import print_summary
from warpforge.profile.report import render_html


def _profile(monkeypatch, load: float):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.manual_seed(0)
    return profile(nn.Linear(8, 8), torch.randn(4, 8), iters=3, warmup=1)


def _printed(d: dict) -> str:
    console = Console(record=True, width=200)
    print_summary(d, console)
    return console.export_text()


def test_negative_overhead_is_a_warning_not_a_figure(monkeypatch):
    """"profiler overhead -73.3%": the profiled window was faster than the plain runs around it."""
    p = dataclasses.replace(_profile(monkeypatch, 0.1), window_ms=0.267, plain_ms=1.0)
    assert p.overhead < 0  # the raw quotient, for whoever asks the Profile
    d = p.as_dict()
    assert d["timing"]["overhead"] is None and "not measurable" in d["timing"]["overhead_note"]
    text = _printed(d)
    assert "-73.3%" not in text and "%" not in text.split("per iteration")[1].split("\n")[0]
    assert "warning: not measurable: the profiled window (0.267 ms) ran faster than the plain runs (1.000 ms)" in text
    html = render_html(d)
    assert "-73" not in html and "below noise" in html and "not measurable" in html


def test_overhead_parts_below_noise_are_hidden_too():
    t = {"window_ms": 1.0, "plain_ms": 1.0, "overhead": 0.05, "overhead_parts": {"cpu": -0.2, "cuda": 0.03}}
    below_noise(t)
    assert t["overhead"] == 0.05 and t["overhead_parts"] == {"cpu": None, "cuda": 0.03}
    assert "noise" in t["overhead_note"]


def test_a_busy_machine_is_said_and_kept_in_meta(monkeypatch):
    d = _profile(monkeypatch, 9.0).as_dict()
    assert d["meta"]["host"]["busy"] is True and d["meta"]["host"]["load1"] == 9.0
    assert any(n.startswith("busy machine: load average 9.0 on 2 cores") for n in d["notes"])
    assert "warning: busy machine: load average 9.0 on 2 cores" in _printed(d)
    quiet = _profile(monkeypatch, 0.2).as_dict()
    assert quiet["meta"]["host"]["busy"] is False and "busy machine" not in _printed(quiet)
