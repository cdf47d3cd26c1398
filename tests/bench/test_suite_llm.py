"""Suite ``llm`` and the end-to-end case path of bench, on the CPU.

The --quick run executes every case at toy shapes through warpforge.llm and HF transformers; the full
case list is only built (never run here) to check that every row of the table is there at its size.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from warpforge.bench.e2e import mbu, mfu, run_end_to_end
from warpforge.results.record import validate_record
from warpforge.bench.suite import EndToEndCase, Run
from warpforge.bench.suites import llm as llm_suite

ROWS = {"decode-b1-8b", "decode-b1-1b", "offline-1b", "offline-8b", "offline-1b-vs-hf", "offline-8b-vs-hf",
        "throughput-8b-1000", "throughput-8b-1000-kv-fp8", "prefix-cache", "long-prompt", "gemma3-270m-b1",
        "gemma3-270m-b64", "gemma3-270m-gguf-blocks-b1", "spec-ngram-b1", "spec-self-b1", "spec-draft-b1"} | {
        "decode-b1-8b-int8", "decode-b1-8b-int4", "offline-256-8b-fp8"} | {  # quantized rows
        "guided-json-b64"}  # structured outputs: constrained vs free decode steps
SPEC_ROWS = {"spec-ngram-b1", "spec-self-b1", "spec-draft-b1"}  # checked in test_suite_llm_spec.py
CPU = {"name": "cpu", "torch": torch.__version__}


def _suite():
    from warpforge.bench.runner import load_suite

    return load_suite("llm")


def test_full_case_list_has_every_row_of_the_table():
    cases = {c.params["row"]: c for c in _suite().build(quick=False)}
    assert set(cases) == ROWS
    p = {k: c.params for k, c in cases.items()}
    b8 = p["decode-b1-8b"]
    assert (b8["preset"], b8["prompt"], b8["new"]) == ("llama-8b", 128, 256)
    assert p["decode-b1-1b"]["preset"] == "llama-1b" and cases["decode-b1-1b"].target == {"mbu": 0.70}
    assert cases["decode-b1-8b"].target == {"mbu": 0.85}
    for row, preset in (("offline-1b", "llama-1b"), ("offline-8b", "llama-8b")):
        assert (p[row]["preset"], p[row]["requests"], p[row]["in"], p[row]["out"]) == (preset, 256, [100, 1024],
                                                                                         [100, 1024])
        assert cases[row].peers == {} and "on the first 64" in cases[row].baseline  # ours alone: 256 requests
        vs = f"{row}-vs-hf"  # the ratio: ours and HF on the same first 64 of those requests
        assert (p[vs]["preset"], p[vs]["requests"], p[vs]["of"]) == (preset, 64, 256)
        assert cases[vs].target == {"ratio": {"hf": 10.0}} and "hf" in cases[vs].peers
    assert (p["throughput-8b-1000"]["requests"], p["throughput-8b-1000"]["in"]) == (1024, 1000)
    assert cases["throughput-8b-1000"].target["tok/s"] == 10000.0 and "17,744" in cases["throughput-8b-1000"].baseline
    # the fp8-KV twin is reported beside it, never judged against the bf16 target
    assert p["throughput-8b-1000-kv-fp8"]["kv_cache_dtype"] == "fp8"
    assert "tok/s" not in cases["throughput-8b-1000-kv-fp8"].target
    pc = cases["prefix-cache"]
    pp = p["prefix-cache"]
    assert (pp["system"], pp["question"], pp["requests"]) == (2000, 100, 256)
    assert pc.metric == "ms" and pc.target == {"ratio": {"no-prefix-cache": 3.0}}
    assert p["long-prompt"]["prompt"] == 100_000 and p["long-prompt"]["new"] == 128
    assert p["gemma3-270m-b64"]["batch"] == 64 and "hf" in cases["gemma3-270m-b1"].peers
    gb = cases["gemma3-270m-gguf-blocks-b1"]
    assert gb.target == {"ratio": {"dequantized": 1.5}} and set(gb.peers) == {"dequantized"}
    assert gb.check is llm_suite.perplexity_check and p["gemma3-270m-gguf-blocks-b1"]["batch"] == 1


def test_perplexity_check_holds_the_gguf_row_to_one_percent():
    check = llm_suite.perplexity_check
    assert check({"ppl": 30.2}, {"ppl": 30.0})["ok"]  # 0.67%
    bad = check({"ppl": 30.4}, {"ppl": 30.0})  # 1.33%
    assert not bad["ok"] and abs(bad["rel_err"] - 0.4 / 30) < 1e-12 and bad["tol"] == 0.01
    assert not check({"ppl": float("nan")}, {"ppl": 30.0})["ok"] and not check({}, {"ppl": 30.0})["ok"]


@pytest.mark.slow  # ~25 s of CI's 2 cores (tests/conftest.py starts files with a slow test first)
def test_quick_run_on_cpu_produces_valid_records_with_the_metrics():
    pytest.importorskip("transformers")
    from warpforge.bench.runner import run_suite

    records = run_suite(_suite(), quick=True, device="cpu")
    by_row = {r["params"]["row"]: r for r in records}
    assert set(by_row) == ROWS - {"gemma3-270m-b1", "gemma3-270m-b64", "gemma3-270m-gguf-blocks-b1",
                                  "throughput-8b-1000-kv-fp8"}
    for r in records:
        validate_record(r)
        assert r["correct"]["ok"], (r["case"], r["correct"])
        if r["params"]["row"] in SPEC_ROWS | {"guided-json-b64"}:  # checked in their own test files
            continue
        ours = r["ours"]
        assert "error" not in ours, ours
        assert ours["tokens"] > 0 and {"mbu", "mfu", "peak_mem_GB", "ttft_ms"} <= set(ours)
        assert ours["engine"]["pdl"] is False and ours["engine"]["async_scheduling"] is True  # the settings timed
        assert r["work"]["bytes"] > 0 and r["work"]["flops"] > 0
        for name, peer in r["peers"].items():
            assert "error" not in peer, (r["case"], name, peer)
            assert r["ratio"][name] > 0
    for row in ("decode-b1-8b", "decode-b1-1b", "offline-1b-vs-hf"):
        r = by_row[row]
        assert r["metric"] == "tok/s" and "ratio_null" not in r  # the same requests on both sides
        assert r["peers"]["hf"]["tokens"] == r["ours"]["tokens"] and "ran" not in r["peers"]["hf"]
        assert math.isclose(r["ratio"]["hf"], r["ours"]["tok/s"] / r["peers"]["hf"]["tok/s"])  # inverted: ours/peer
        assert r["correct"]["match"] == r["correct"]["compared"] > 0  # fp32: HF's greedy ids exactly
    pc = by_row["prefix-cache"]
    assert pc["ours"]["cached_tokens"] > 0 and pc["peers"]["no-prefix-cache"]["cached_tokens"] == 0
    assert math.isclose(pc["ratio"]["no-prefix-cache"], pc["peers"]["no-prefix-cache"]["ms"] / pc["ours"]["ms"])
    lp = by_row["long-prompt"]
    assert lp["ours"]["tokens"] == lp["params"]["new"] and lp["ours"]["decode_tok_s"] > 0 and lp["ours"]["ttft_ms"] > 0


def test_generation_work_and_mbu_on_a_known_example():
    from warpforge.bench.suites._llm_work import _shape, generation_work, kv_bytes_per_token, weight_bytes

    s = _shape("llama-8b")
    # Llama-3.1-8B: 7.50B params multiply per token (the input embedding is a row lookup), + norms.
    assert weight_bytes(s, 2) == 2 * (7_504_658_432 + 65 * 4096)
    assert kv_bytes_per_token(s, 2) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token
    p, n = 128, 256
    w = generation_work(s, 2, [p], [n])
    ctx = sum(p + t for t in range(1, n))
    assert w["bytes"] == n * weight_bytes(s, 2) + ctx * kv_bytes_per_token(s, 2)
    # MBU = tokens/s x bytes per token / bandwidth: 256 tokens in 1 s at the bytes above on 4.8 TB/s.
    per_token = w["bytes"] / n
    assert math.isclose(mbu(w["bytes"], 1000.0, 4800.0), n * per_token / 4.8e12)
    assert math.isclose(mbu(16e9, 4.0, 4000.0), 1.0)  # 16 GB in 4 ms is 4 TB/s
    assert math.isclose(mfu(2e12, 10.0, 200.0), 1.0)
    with pytest.raises(ValueError):
        mbu(1.0, 0.0, 1.0)


def _runs(ms: list[float], tokens: int, ids: list[int]) -> callable:
    def fn(device, rep):
        return [Run(ms=m, tokens=tokens, output={"ids": [ids], "exact": True, "want": [tokens]},
                    work={"flops": 1e9, "bytes": 2e9}, extra={"ttft_ms": 1.5}) for m in ms[:rep]]
    return fn


def _case(**kw) -> EndToEndCase:
    from warpforge.bench.suites.llm import prefix_check

    base = dict(name="c", params={"row": "x"}, ours=_runs([10.0, 12.0, 11.0], 100, [1, 2, 3]),
                peers={"hf": _runs([40.0, 40.0, 40.0], 100, [1, 2, 3])}, check=prefix_check, check_against="hf",
                dtype=torch.bfloat16, rep=3, baseline="HF")
    return EndToEndCase(**{**base, **kw})


def test_end_to_end_record_inverts_the_throughput_ratio_and_reports_mbu():
    ceil = SimpleNamespace(hbm_GBps=1000.0, tflops={"bf16": 100.0, "fp32": 50.0, "fp16": 100.0}, source="datasheet")
    rec = run_end_to_end(_case(), suite="llm", device=torch.device("cpu"), env_device=CPU, git=None, ceil=ceil)
    assert rec["ours"]["ms"] == 11.0 and math.isclose(rec["ours"]["tok/s"], 100 / 0.011)
    assert math.isclose(rec["ratio"]["hf"], 40.0 / 11.0)  # ours/peer tok/s with the same tokens
    assert math.isclose(rec["ours"]["mbu"], 2e9 / 0.011 / 1e12) and math.isclose(rec["ours"]["mfu"], 1e9 / 0.011 / 1e14)
    assert rec["correct"]["ok"] and rec["correct"]["match"] == 3 and rec["ours"]["ttft_ms"] == 1.5
    assert rec["roofline"]["bound"] == "memory"


def test_end_to_end_failures_are_recorded_not_raised():
    def boom(device, rep):
        raise RuntimeError("no transformers here")

    rec = run_end_to_end(_case(peers={"hf": boom}), suite="llm", device=torch.device("cpu"), env_device=CPU, git=None)
    assert rec["peers"]["hf"] == {"error": "RuntimeError: no transformers here"} and rec["ratio"] == {}
    assert not rec["correct"]["ok"]  # nothing to check against is not a pass
    rec = run_end_to_end(_case(ours=boom), suite="llm", device=torch.device("cpu"), env_device=CPU, git=None)
    assert "error" in rec["ours"] and not rec["correct"]["ok"] and rec["ratio"] == {}
    wrong = _case(ours=_runs([10.0] * 3, 100, [1, 9, 3]))
    rec = run_end_to_end(wrong, suite="llm", device=torch.device("cpu"), env_device=CPU, git=None)
    assert not rec["correct"]["ok"] and rec["correct"]["match"] == 1  # fp32-exact runs must match every token


def test_end_to_end_case_validates_itself():
    with pytest.raises(ValueError, match="baseline"):
        _case(peers={}, check_against=None, baseline="")
    with pytest.raises(ValueError, match="check_against"):
        _case(check_against="vllm")
    with pytest.raises(ValueError, match="metric"):
        _case(metric="GBps")
    with pytest.raises(ValueError, match="rep"):
        _case(rep=0)


def test_targets_are_judged_where_the_figure_is_known():
    from warpforge.bench.e2e import meets_target

    ours = {"tok/s": 12000.0, "mbu": None}
    got = meets_target({"tok/s": 10000.0, "mbu": 0.85, "ratio": {"hf": 10.0, "x": 2.0}, "published": {"a": 1.0}},
                       ours, {"hf": 9.5})
    assert got == {"tok/s": True, "mbu": None, "ratio.hf": False, "ratio.x": None}
    assert meets_target({"completes": True}, {"error": "boom"}, {}) == {"completes": False}


@pytest.mark.gpu
def test_quick_run_on_the_gpu_reports_mbu_and_memory():
    """On the H200: the toy shapes in bf16 through the Triton kernels, with ceilings for MBU/MFU."""
    pytest.importorskip("transformers")
    from warpforge.bench.runner import run_suite

    records = run_suite(_suite(), quick=True)
    for r in records:
        validate_record(r)
        assert "error" not in r["ours"], (r["case"], r["ours"])
        assert r["correct"]["ok"], (r["case"], r["correct"])
        assert r["ours"]["peak_mem_GB"] > 0
        if "speculative" not in r["params"]:  # speculative rows time chats against plain decoding: no work count
            assert r["ours"]["mbu"] is not None and r["ours"]["mfu"] is not None, (r["case"], r["ours"])


def test_bf16_check_scores_ours_teacher_forced_not_by_prefix():
    from warpforge.bench.suites.llm import NEAR_TIE_SD, prefix_check, teacher_forced

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    top = logits.argmax(1).tolist()
    tf = teacher_forced(logits, top)
    assert tf == {"agree": 1.0, "max_gap_sd": 0.0, "positions": 4}
    # a near tie: ours picks a token 0.05 sd under the top at position 2
    near = logits.clone()
    alt = int(near[2].argsort()[-2])
    near[2, alt] = near[2].max() - 0.05 * near[2].std()
    tf_near = teacher_forced(near, top[:2] + [alt] + top[3:])
    assert tf_near["agree"] == 0.75 and 0.04 < tf_near["max_gap_sd"] < 0.06
    bf16 = {"ids": [[1, 2, 3, 4]], "exact": False}
    ok = prefix_check(bf16, {"ids": [[1, 9, 9, 9]], "exact": False, "teacher_forced": tf_near})
    assert ok["ok"] and ok["match"] == 1 and ok["tol"] == NEAR_TIE_SD
    # a real disagreement: ours' token is 2 sd under the top
    far = logits.clone()
    far[2, alt] = far[2].max() - 2.0 * far[2].std()
    bad = prefix_check(bf16, {"ids": [[1, 2, 3, 4]], "exact": False,
                              "teacher_forced": teacher_forced(far, top[:2] + [alt] + top[3:])})
    assert not bad["ok"] and bad["rel_err"] > 1.9
    # no score from the peer: not a pass, whatever the prefix
    assert not prefix_check(bf16, {"ids": [[1, 2, 3, 4]], "exact": False})["ok"]
    # fp32: the whole prefix must match
    assert not prefix_check({"ids": [[1, 2, 3]], "exact": True}, {"ids": [[1, 2, 4]], "exact": True})["ok"]
