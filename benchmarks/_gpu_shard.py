"""pytest plugin for benchmarks/gpu_tests.py: run exactly the node ids listed in $GPU_TESTS_SHARD_IDS (matched
against the collected items, so ids with spaces or brackets need no quoting), and print a failure's traceback
the moment it happens: a shard stopped at the deadline never reaches pytest's end-of-run report."""
import os

import pytest


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("GPU_TESTS_SHARD_IDS")
    if not path:
        return
    with open(path) as f:
        wanted = {line.rstrip("\n") for line in f if line.strip()}
    keep = [i for i in items if i.nodeid in wanted]
    drop = [i for i in items if i.nodeid not in wanted]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.failed:
        text = str(report.longrepr).splitlines()
        print(f"\n--- failure {report.nodeid} ({report.when})", flush=True)
        print("\n".join(text[-40:]), flush=True)
        print("--- end failure", flush=True)
