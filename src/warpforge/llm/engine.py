"""LLMEngine (requests in, one step at a time, outputs out) and LLM (the batch-generation API).

The hot path is ``LLMEngine.step``: schedule -> run -> postprocess, then text for the sequences
that got a token. ``LLM.generate`` adds every prompt and steps until all are done; the async
engine (:mod:`warpforge.llm.async_engine`) steps the same engine from an asyncio task.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from warpforge.llm.block_manager import BlockManager
from warpforge.llm.engine_config import EngineConfig
from warpforge.llm.loader import GEMMA3_270M, load, resolve_model
from warpforge.llm.outputs import Detokenizer, RequestMetrics, RequestOutput, now
from warpforge.llm.runner import ModelRunner
from warpforge.llm.sampling import SamplingParams
from warpforge.llm.scheduler import ScheduledBatch, Scheduler
from warpforge.llm.sequence import Sequence
from warpforge.llm.spec_step import SpecDecoder, draft_page_bytes

Prompt = str | list[int]


@dataclass
class Request:
    """The engine's state of one request next to its Sequence (what the scheduler sees)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # one copy shared by every output of the request (do not mutate)
    seq: Sequence
    detok: Detokenizer
    metrics: RequestMetrics
    stream: bool  # emit an output every step (else only when finished)
    detok_tokens: int = 0  # output tokens already fed to the detokenizer
    sent_tokens: int = 0  # output tokens already handed out
    sent_chars: int = 0  # output text already handed out


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a torch.device (None: CUDA when available, else the CPU), or a ValueError naming
    what cannot run here (torch's own answer to a missing CUDA is a bare AssertionError later)."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but CUDA is not available on this machine "
                             f"(torch {torch.__version__}); use device='cpu' or leave device unset")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} requested but this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


class LLMEngine:
    """``LLMEngine(path | Loaded, engine_config, *, dtype, device)``.

    ``path``: an HF checkpoint directory or a .gguf file (loaded with :func:`warpforge.llm.loader.load`);
    or an already loaded ``(model, tokenizer, config)``. dtype None: bfloat16 on CUDA, float32 on CPU.
    ``gguf_blocks``: run a GGUF's quantized projections from the file's blocks (llm/gguf_blocks.py).
    """

    def __init__(self, model, engine_config: EngineConfig | None = None, *,
                 dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                 gguf_blocks: bool = False):
        from warpforge.llm.config import to_dtype

        engine_config = engine_config or EngineConfig()
        tp_size, runner, self.workers = engine_config.tensor_parallel_size, None, None
        if isinstance(model, (str, Path)):
            from warpforge.llm.quantize import is_quantized_dir, load_quantized

            self.device = check_device(device)
            dtype = to_dtype(dtype, torch.bfloat16 if self.device.type == "cuda" else torch.float32)
            if str(model) == GEMMA3_270M:  # the name the CLI takes: the bundled GGUF, assembled once
                model = resolve_model(GEMMA3_270M)
            if gguf_blocks and engine_config.quantization is not None:
                raise ValueError(f"quantization: {engine_config.quantization!r} with gguf_blocks: the blocks are "
                                 "the file's own quantization; drop one of them")
            if tp_size > 1 and gguf_blocks:
                raise ValueError("gguf_blocks: not available with tensor_parallel_size > 1 (each rank keeps a "
                                 "dense shard); drop one of them")
            if tp_size > 1 and is_quantized_dir(model):
                raise ValueError("tensor_parallel_size: a quantized checkpoint runs on one rank; load it with "
                                 "tensor_parallel_size=1")
            self.model_path: Path | None = Path(model)  # what save_quantized copies the config and tokenizer from
            if tp_size > 1:  # every rank loads the checkpoint and keeps its shard (llm/parallel.py)
                from warpforge.llm.distributed_worker import start_driver

                model, runner, self.workers = start_driver(model, engine_config, dtype, self.device)
                self.device = runner.device
            else:
                model = (load_quantized(model, dtype=dtype, device=self.device) if is_quantized_dir(model)
                         else load(model, dtype=dtype, device=self.device, gguf_blocks=gguf_blocks))
        elif tp_size > 1:
            raise ValueError("tensor_parallel_size: each rank loads its own shard, so the model must be given "
                             "as a checkpoint path, got a loaded model")
        else:  # already loaded: it runs where its weights are
            self.model_path = None
            if gguf_blocks:
                raise ValueError("gguf_blocks: applies when the engine loads a .gguf path, got an already loaded model "
                                 "(load it with warpforge.llm.loader.load(path, gguf_blocks=True))")
            self.device = next(model[0].parameters()).device
            want = torch.device(device) if device is not None else None
            if want is not None and (want.type != self.device.type or want.index not in (None, self.device.index)):
                raise ValueError(f"device: the loaded model is on {self.device}, got {device}")
        self.model, self.tokenizer, self.model_config = model
        ec = engine_config.for_model(self.model_config.max_position_embeddings)
        self.quantization_report = None
        if ec.quantization is not None or getattr(self.model, "quantization", None) is not None:
            from warpforge.llm.quantize import quantize_model

            self.quantization_report = quantize_model(self.model, ec.quantization or self.model.quantization,
                                                      tokenizer=self.tokenizer)
        self.config = ec
        # The draft model before the KV cache is sized: its cache takes the same page ids.
        draft = SpecDecoder.load_draft(ec.speculative, self, resolve_model)
        self.runner = runner or ModelRunner(self.model, self.model_config, ec, self.device,
                                            extra_page_bytes=draft_page_bytes(draft, ec.page_size))
        self.block_manager = BlockManager(self.runner.num_pages, ec.page_size, ec.enable_prefix_caching)
        eos = self.model_config.eos_token_ids or list(getattr(self.tokenizer, "eos_token_ids", []) or [])
        self.scheduler = Scheduler(ec, self.block_manager, eos)
        # Speculative decoding (EngineConfig.speculative): drafts verified k + 1 tokens per forward.
        self.spec = SpecDecoder(self, ec.speculative, draft) if ec.speculative is not None else None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.lookahead_steps = 0  # steps queued by async scheduling (stats and tests)
        # (batch, PendingStep): a lookahead step queued on the device, not yet postprocessed
        self._ahead: tuple[ScheduledBatch, Any] | None = None

    @functools.cached_property
    def grammars(self):
        """Structured outputs' compiler over this model's vocabulary (built on the first such request)."""
        from warpforge.llm.structured import GrammarBackend

        return GrammarBackend(self.tokenizer, self.model_config.vocab_size, sorted(self.scheduler.eos_token_ids))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done at interpreter exit); a no-op on one rank."""
        if self.workers is not None:
            self.workers.shutdown()

    # ---- requests ------------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                     stream: bool = False, add_special_tokens: bool = True) -> Request:
        """Tokenize and check one request without queuing it (ValueError naming the problem)."""
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {rid}: params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, (self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if prompt else [])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"request {rid}: prompt token ids must be in [0, {self.model_config.vocab_size}), "
                                 f"got {bad[:4]}")
        else:
            raise ValueError(f"request {rid}: prompt: expected a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"request {rid}: empty prompt")
        limit = self.scheduler.max_model_len  # the config's, resolved
        if len(ids) + 1 > limit:
            raise ValueError(f"request {rid}: prompt of {len(ids)} tokens leaves no room for a new token "
                             f"within max_model_len {limit}")
        if rid in self.requests:
            raise ValueError(f"request {rid}: a request with this id is still running")
        t = now()
        seq = Sequence(ids, params, seq_id=rid)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        return Request(rid, text, ids, seq, Detokenizer(self.tokenizer, ids),
                       RequestMetrics(t, num_prompt_tokens=len(ids)), stream)

    def add(self, req: Request) -> None:
        """Queue a request built by :meth:`make_request` (the scheduler's checks may still refuse it)."""
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id}: a request with this id is still running")
        self.scheduler.add(req.seq)
        self.requests[req.request_id] = req

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    stream: bool = False, add_special_tokens: bool = True) -> str:
        """Queue one request; -> its id. A bad request raises ValueError and leaves the others running."""
        req = self.make_request(prompt, params, request_id=request_id, stream=stream,
                                add_special_tokens=add_special_tokens)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; -> its last output (None: unknown or finished)."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return None
        self.scheduler.abort(req.request_id)
        req.seq.output_text = req.detok.add(req.seq.output_token_ids[req.detok_tokens:], final=True)
        return self._output(req, now())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._live_ahead() is not None

    def _live_ahead(self):
        """The queued lookahead step, unless every sequence in it has ended since (aborted): then it is
        dropped unread (its pages are free already; later steps queue behind it on the device)."""
        if self._ahead is not None and all(s.is_finished for s in self._ahead[0].seqs):
            self._ahead = None
        return self._ahead

    # ---- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step for every scheduled request; -> outputs of the finished ones and, for streamed
        requests, of every one that got a token.

        Async scheduling (``EngineConfig.async_scheduling``): once a decode step is queued on the
        device, the next one is formed and queued too (``Scheduler.lookahead``) before this step's
        tokens are read back, so the host's work for step n + 1 overlaps the device's step n and
        the device never waits for Python between decode steps."""
        ahead, self._ahead = self._live_ahead(), None
        if ahead is not None:
            batch, pending = ahead
        else:
            batch = self.scheduler.schedule()
            if self.spec is not None and not batch.is_empty:
                seqs = self.spec.step(batch)  # None: nothing drafted this step, run it plainly
                if seqs is not None:
                    return self._outputs(seqs + batch.finished)
            pending = self.runner.launch(batch) if not batch.is_empty else None
        if pending is not None and self.config.async_scheduling and (self.spec is None or self.spec.plain_next(batch)):
            nxt = self.scheduler.lookahead(batch)
            if nxt is not None:
                try:
                    self._ahead = (nxt, self.runner.launch(nxt, ids_from=pending))
                except BaseException:
                    self.scheduler.cancel_lookahead(nxt)  # no placeholder may outlive a failed launch
                    raise
                self.lookahead_steps += 1
        ids, logprobs = pending.result() if pending is not None else ([], [])
        seqs = self.scheduler.postprocess(batch, ids, logprobs)
        return self._outputs(seqs + batch.finished)

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        t = now()
        outs = []
        for seq in seqs:
            req = self.requests.get(seq.seq_id)
            if req is None:  # aborted during the step
                continue
            if req.metrics.first_token_time is None and seq.num_output_tokens:
                req.metrics.first_token_time = t
            # Text only where someone reads it now: streams and stop strings every step, else once at the end.
            if seq.params.stop and seq.num_output_tokens - req.detok_tokens > 1:
                self._stop_by_token(req)  # several tokens this step (speculative): as if one per step
            elif req.stream or seq.params.stop or seq.is_finished:
                text = req.detok.add(seq.output_token_ids[req.detok_tokens:], final=seq.is_finished)
                req.detok_tokens = seq.num_output_tokens
                if seq.check_stop(text) or seq.is_finished:
                    self.scheduler.finish(seq)  # frees the pages now (a no-op when postprocess already did)
            if req.stream or seq.is_finished:
                outs.append(self._output(req, t))
        return outs

    def _stop_by_token(self, req: Request) -> None:
        """Stop strings over a step that added several tokens: the text grows one token at a time, as in
        plain decoding, and a match drops the tokens after the one that completed it."""
        seq = req.seq
        new = seq.output_token_ids[req.detok_tokens:]
        for i, tok in enumerate(new):
            last = i == len(new) - 1
            text = req.detok.add([tok], final=last and seq.is_finished)
            req.detok_tokens += 1
            if seq.check_stop(text):
                if not last:
                    del seq.token_ids[seq.num_prompt_tokens + req.detok_tokens:]
                break
        if seq.is_finished:
            self.scheduler.finish(seq)

    def _output(self, req: Request, t: float) -> RequestOutput:
        seq, m = req.seq, req.metrics
        finished = seq.is_finished
        if finished:
            m.finish_time = t
            self.requests.pop(req.request_id, None)
        m.num_output_tokens, m.num_cached_tokens = seq.num_output_tokens, seq.num_cached_tokens
        text = seq.output_text
        # A stop string may still be forming at the end of an unfinished stream: hold those chars back.
        hold = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
        end = max(req.sent_chars, len(text) - hold)
        out_ids = seq.output_token_ids
        out = RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            text=text[:end], token_ids=out_ids, delta_text=text[req.sent_chars:end],
            delta_token_ids=out_ids[req.sent_tokens:], finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None, metrics=m)
        req.sent_chars, req.sent_tokens = end, len(out_ids)
        return out


class LLM:
    """Offline generation: ``LLM(path, dtype=..., max_model_len=..., gguf_blocks=..., **EngineConfig fields)``.

    ``path``: an HF checkpoint directory, a .gguf file, or ``"gemma3-270m"`` (the bundled Gemma 3 270M).

    >>> llm = LLM("gemma3-270m")
    >>> llm.generate(["To be, or not"], SamplingParams(max_tokens=32))[0].text
    """

    def __init__(self, model, *, dtype: torch.dtype | str | None = None, max_model_len: int | None = None,
                 device: torch.device | str | None = None, gguf_blocks: bool = False, **engine_kwargs):
        config = EngineConfig(max_model_len=max_model_len, **engine_kwargs)
        self.engine = LLMEngine(model, config, dtype=dtype, device=device, gguf_blocks=gguf_blocks)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False, add_special_tokens: bool = True) -> list[RequestOutput]:
        """One output per prompt, in order. A single prompt with bad input raises ValueError; in a
        list, a bad prompt gets an output with finish_reason "error" (and ``error``) and the
        others run."""
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError(f"prompts: expected a string, a list of token ids or a list of those, "
                             f"got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts)
                                              and all(isinstance(t, int) for t in prompts))
        prompt_list: list[Any] = [prompts] if single else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"sampling_params: expected one per prompt ({len(prompt_list)}), got {len(params)}")
        engine = self.engine
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        index: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params)):
                try:
                    index[engine.add_request(prompt, p, add_special_tokens=add_special_tokens)] = i
                except ValueError as e:
                    if single:
                        raise
                    results[i] = RequestOutput(request_id=f"error-{i}",
                                               prompt=prompt if isinstance(prompt, str) else None,
                                               prompt_token_ids=[], finish_reason="error", error=str(e))
            with _progress(use_tqdm, len(index)) as advance:
                while engine.has_unfinished():
                    for out in engine.step():
                        if out.finished and out.request_id in index:
                            results[index.pop(out.request_id)] = out
                            advance()
        finally:
            for rid in list(index):  # interrupted (or a failing step): do not leave requests behind
                engine.abort(rid)
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...], or a list of them)
        through the tokenizer's chat template."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages: expected a list of {{'role': ..., 'content': ...}} dicts (or a list of "
                             f"such lists), got {messages!r:.60}")
        single = isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in convs]
        # The template writes the special tokens (BOS) itself: do not add them twice.
        return self.generate(prompts[0] if single else prompts, sampling_params, use_tqdm=use_tqdm,
                             add_special_tokens=False)


class _progress:
    """A rich progress bar over finished requests (or nothing); yields the advance callback."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._bar: Any = None  # a rich Progress while entered

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress

        self._bar = Progress(transient=True)
        self._bar.start()
        task = self._bar.add_task("generating", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
