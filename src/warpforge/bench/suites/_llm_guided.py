"""Suite ``llm``, structured-outputs row: what a JSON-schema constraint costs a decode step.

Batch 64, greedy: every request constrained to a JSON schema, against the same requests free. The
schema's open string never completes on its own, so both runs decode exactly ``new`` tokens per request
(ignore_eos) and the ratio divides times of the same number of steps; the difference is the token
bitmask (filled on the host by xgrammar while the forward runs, applied to the logits before
sampling). Both runs count the model's work (``generation_work`` over the tokens each request ran), so
the row reports MBU and MFU as every decode row does: the mask changes which token is picked, not what a
step reads or computes (a bitmask of vocab/8 bytes and one masked fill of the logits a row are noise
beside the weights). Row ``guided-json-b64`` targets a step time at most 1.10x the free one (tok/s ratio
>= 0.91).
The full run uses Gemma 3 270M (its 262k-token vocabulary is what the mask is filled over); ``--quick``
runs the tiny random Llama on the CPU, which only proves the path works.
"""

from __future__ import annotations

from typing import Any

import torch

from warpforge.bench.e2e import peak_allocated_gb, release_memory, timed_wall
from warpforge.bench.suite import EndToEndCase, Run
from warpforge.bench.suites._llm_models import checkpoint, run_dtype
from warpforge.bench.suites._llm_work import _shape, generation_work

# An object whose one string never closes on a model that does not want it to: a full-length decode.
SCHEMA = {"type": "object", "properties": {"reply": {"type": "string"}}, "required": ["reply"]}


def guided_run(model: str, n_req: int, new: int, constrained: bool, **engine: Any):
    """``n_req`` greedy requests at once, ``new`` tokens each, with the JSON schema or free; each rep times
    the whole batch by wall clock (the device synchronized) and reports the mean step time."""
    def fn(device: torch.device, rep: int) -> list[Run]:
        from warpforge.llm import LLM, SamplingParams, StructuredOutputsParams

        dtype = run_dtype(device)
        llm = LLM(str(checkpoint(model, dtype)), dtype=dtype, device=device, max_num_seqs=n_req, **engine)
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained else None
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, structured_outputs=so)
        prompts = [f"Request {i}: answer in JSON. To be, or not to be" for i in range(n_req)]
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so))  # warm-up
        shape, elt = _shape(model), torch.empty((), dtype=dtype).element_size()
        runs = []
        for _ in range(rep):
            outs, wall = timed_wall(device, llm.generate, prompts, params)
            ids = [list(o.token_ids) for o in outs]
            cached = [o.metrics.num_cached_tokens if o.metrics else 0 for o in outs]
            work = generation_work(shape, elt, [len(o.prompt_token_ids) for o in outs], [len(x) for x in ids],
                                   cached=cached)
            ttft = [o.metrics.ttft * 1e3 for o in outs if o.metrics and o.metrics.ttft is not None]
            runs.append(Run(ms=wall, tokens=sum(map(len, ids)),
                            output={"ids": ids, "want": [new] * n_req, "constrained": constrained},
                            extra={"wall_ms": wall, "step_ms": wall / new, "batch": n_req,
                                   "constrained_rows": n_req if constrained else 0,
                                   "ttft_ms": sum(ttft) / len(ttft) if ttft else None,
                                   "peak_mem_GB": peak_allocated_gb(device)},
                            work=work,
                            ran={"requests": n_req, "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                                 "output_tokens": sum(map(len, ids))}))
        del llm
        release_memory(device)
        return runs
    return fn


def guided_check(ours: dict, peer: dict) -> dict[str, Any]:
    """Same work: every request of both runs decoded ``new`` tokens (the ratio is then per step)."""
    short = sum(len(x) != n for run in (ours, peer) for x, n in zip(run["ids"], run["want"]))
    total = len(ours["want"]) + len(peer["want"])
    return {"ok": short == 0, "rel_err": short / max(1, total), "tol": 0.0, "against": "free"}


def guided_cases(quick: bool) -> list[EndToEndCase]:
    model = "llama-tiny" if quick else "gemma3-270m"
    n_req, new = (8, 8) if quick else (64, 128)
    engine = dict(max_model_len=256 if quick else 1024)
    return [EndToEndCase(
        name=f"structured outputs JSON schema batch {n_req} {model} + {new}",
        params={"row": "guided-json-b64", "preset": model, "requests": n_req, "new": new, "batch": n_req,
                "schema": SCHEMA, "backend": "xgrammar"},
        ours=guided_run(model, n_req, new, True, **engine),
        peers={"free": guided_run(model, n_req, new, False, **engine)},
        check=guided_check, check_against="free", dtype=torch.bfloat16, rep=1 if quick else 3,
        baseline="the same requests unconstrained (same decode steps)", target={"ratio": {"free": 0.91}})]
