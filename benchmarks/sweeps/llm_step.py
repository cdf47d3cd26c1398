"""Where a batch-1 decode step of warpforge.llm spends its time (H200 diagnosis for issue 5's MBU rows).

    python benchmarks/sweeps/llm_step.py --preset llama-1b --out step.json

Measures on one engine: (a) wall time per generated token of a 256-token greedy generation (what the
`llm` suite's decode case times), (b) the decode CUDA graph's replay alone (CUDA events around 50
back-to-back replays: the forward's GPU time), (c) LM head + sampler alone, (d) the kernels of one
step by name from torch.profiler (GPU time per kernel class), (e) the host's top functions (cProfile)
over a generation. Host overhead = (a) - (b) - (c) when the GPU waits on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


def events_ms(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from warpforge.llm import LLM, SamplingParams
    from warpforge.llm.random_weights import cached_checkpoint

    dev = torch.device("cuda")
    t0 = time.perf_counter()
    path = cached_checkpoint(args.preset, dtype=torch.bfloat16)
    llm = LLM(str(path), dtype=torch.bfloat16, device=dev, max_model_len=128 + args.new + 16,
              max_num_seqs=max(8, args.batch))
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(16, 100000, (128,), generator=g).tolist() for _ in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    res: dict = {"preset": args.preset, "batch": args.batch, "build_s": build_s}
    walls = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    res["wall_ms"] = sorted(walls)[1]
    res["decode_tok_s"] = outs[0].metrics.decode_tokens_per_s
    res["ms_per_token_wall"] = res["wall_ms"] / args.new
    eng = llm.engine
    runner = eng.runner
    graphs = runner.graphs
    bs = graphs.padded_size(args.batch)
    # a plausible decode input: every row at position 200 in pages 0..
    ps = runner.page_size
    n_pages = (200 + ps) // ps
    h = {"input_ids": [17] * bs, "positions": [200] * bs, "slot_mapping": [i * n_pages * ps + 200 for i in range(bs)],
         "seq_lens": [201] * bs, "block_tables": [list(range(i * n_pages, (i + 1) * n_pages)) for i in range(bs)]}
    with torch.inference_mode():
        res["graph_replay_ms"] = events_ms(lambda: graphs.replay(bs, h), 50)
        graph = graphs.graphs[bs]
        res["graph_replay_only_ms"] = events_ms(graph.replay, 50)
        hidden = graphs.outputs[bs][:args.batch]
        res["lm_head_ms"] = events_ms(lambda: eng.model.compute_logits(hidden), 50)
        from warpforge.llm.sampler import SamplingTensors
        logits = eng.model.compute_logits(hidden)
        st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * args.batch, [[1]] * args.batch,
                                         [[1]] * args.batch, logits.shape[-1], dev)
        res["sampler_ms"] = events_ms(lambda: runner.sampler(logits, st), 50)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * args.batch, [[1]] * args.batch,
                                             [[1]] * args.batch, logits.shape[-1], dev)
            runner.sampler(logits, st).to_lists(st.num_logprobs)
        res["sample_host_roundtrip_ms"] = (time.perf_counter() - t) * 1e3 / 50
    # kernels of a few steps
    from torch.profiler import ProfilerActivity, profile
    short = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, short)
        torch.cuda.synchronize()
        res["profiled_wall_ms_32"] = (time.perf_counter() - t) * 1e3
    rows = []
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dt and e.device_type.name == "CUDA":
            rows.append({"name": e.key[:90], "calls": e.count, "gpu_us_total": dt})
    rows.sort(key=lambda r: -r["gpu_us_total"])
    res["kernels_32_steps"] = rows[:40]
    res["gpu_us_total_32"] = sum(r["gpu_us_total"] for r in rows)
    # host
    pr = cProfile.Profile()
    pr.enable()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    res["host_profile_64_tokens"] = s.getvalue()[-6000:]
    long_parts = ("kernels_32_steps", "host_profile_64_tokens")
    print(json.dumps({k: v for k, v in res.items() if k not in long_parts}, indent=1))
    for r in rows[:25]:
        print(f"{r['gpu_us_total'] / 32:9.1f} us/step {r['calls'] // 32:4d}x  {r['name']}")
    print(res["host_profile_64_tokens"][:3500])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
