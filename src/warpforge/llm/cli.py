"""``warpforge generate``: one prompt through the engine, streamed, with prefill/decode rates and TTFT."""

from __future__ import annotations

import click

from warpforge.llm.loader import GEMMA3_270M, resolve_model


def cli_generate(model: str, prompt: str, *, max_tokens: int, temperature: float, top_p: float, top_k: int,
                 seed: int | None, chat: bool, dtype: str, max_model_len: int | None,
                 tensor_parallel_size: int = 1, speculative: dict | None = None,
                 gguf_blocks: bool = False, quantization: str | None = None) -> int:
    """Run the command; -> exit status (2: bad input, said in one line on stderr).

    Loading prints a line on stderr (and a spinner on a terminal), then one with the load time; the stats
    line after the text reports the load apart from TTFT, which counts from the request's arrival."""
    import time

    from warpforge._cli_support import make_console

    err = make_console(stderr=True)

    def fail(msg: str) -> int:
        click.echo(f"warpforge generate: {msg}", err=True)
        return 2

    engine = None
    try:
        from warpforge.llm.engine import LLMEngine
        from warpforge.llm.engine_config import EngineConfig
        from warpforge.llm.sampling import SamplingParams

        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens)
        config = EngineConfig(max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                              speculative=speculative, quantization=quantization)
        if not prompt:
            return fail("PROMPT: empty prompt (give the text to continue)")
        t0 = time.perf_counter()
        tp = f" on {tensor_parallel_size} ranks" if tensor_parallel_size > 1 else ""
        loading = f"loading {model}{tp}" + (" (assembling the GGUF on first use)" if model == GEMMA3_270M else "")
        # A line first, as `warpforge serve` prints one: the spinner shows only on a terminal, and a load
        # can take a minute (the GGUF assembled, a large checkpoint read) that a log would show as silence.
        err.print(f"{loading} ...", highlight=False, markup=False, soft_wrap=True)
        with err.status(loading, spinner="dots"):
            path = resolve_model(model)
            if gguf_blocks and not str(path).endswith(".gguf"):
                return fail(f"--gguf-blocks: needs a .gguf model, got {model}")
            engine = LLMEngine(path, config, dtype=dtype, gguf_blocks=gguf_blocks)
        load_s = time.perf_counter() - t0
        err.print(f"loaded {model} in {load_s:.1f} s ({engine.model_config.architecture}, "
                  f"{str(engine.model_config.dtype).replace('torch.', '')}, {engine.device}{tp})"
                  + (f"; {engine.quantization_report}" if engine.quantization_report else ""),
                  highlight=False, markup=False, soft_wrap=True)
        if gguf_blocks:
            from warpforge.llm.gguf_blocks import projection_bytes_per_token

            err.print(f"GGUF blocks: {projection_bytes_per_token(engine.model) / 1e6:,.1f} MB of projection weights "
                      f"read per decoded token", highlight=False, markup=False, soft_wrap=True)
        if chat:
            note = getattr(engine.tokenizer, "chat_template_note", None)
            if note:
                err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            text = prompt
        req = engine.make_request(text, params, stream=True, add_special_tokens=not chat)
    except ModuleNotFoundError as e:
        return fail(f"{e.name} is missing: install the llm extra (pip install 'warpforge[llm]')")
    except (ValueError, FileNotFoundError) as e:
        if engine is not None:
            engine.shutdown()
        return fail(str(e))
    try:
        return _stream(engine, req, load_s, model)
    finally:
        engine.shutdown()  # tensor-parallel workers end with the command, whatever happened


def _stream(engine, req, load_s: float, model: str) -> int:
    import torch

    from warpforge.llm.sampling import SamplingParams

    if engine.device.type == "cuda":
        # Compile (and tune) the kernels for this prompt's shapes first so the rates measure the
        # engine, not Triton's JIT; the reversed prompt shares no prefix pages with the real one.
        ids = req.seq.prompt_token_ids
        engine.add_request(ids[::-1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
    engine.add(req)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            click.echo(out.delta_text, nl=False)
            last = out
    click.echo()
    assert last is not None  # an added request yields at least its final output
    m = last.metrics
    prefill = f"{m.prefill_tokens_per_s:,.1f} tok/s" if m.prefill_tokens_per_s else "n/a"
    decode = f"{m.decode_tokens_per_s:,.1f} tok/s" if m.decode_tokens_per_s else "n/a (one token)"
    spec = ""
    if engine.spec is not None:
        s = engine.spec.stats
        spec = (f" | speculative {engine.spec.config.method}: {s.num_accepted_tokens}/{s.num_draft_tokens} drafts "
                f"accepted ({s.acceptance_rate:.0%})")
    click.echo(f"prefill: {m.num_prompt_tokens} tokens, {prefill} | decode: {m.num_output_tokens} tokens, {decode} | "
               f"TTFT {m.ttft * 1e3:,.1f} ms | load {load_s:.1f} s | finish: {last.finish_reason} | "
               f"{engine.device.type} {engine.model_config.dtype}{spec}".replace("torch.", ""))
    return 0
