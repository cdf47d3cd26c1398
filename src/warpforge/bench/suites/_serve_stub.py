"""warpforge serve with the model step stubbed out, so that a load test times only the server path.

``python -m warpforge.bench.suites._serve_stub CHECKPOINT --stats FILE [--max-num-seqs N] [--step-ms MS]``
runs the real server (``warpforge.serve``: HTTP, JSON, tokenization, the engine process, scheduling,
detokenization, SSE) over a real engine whose runner is replaced by :class:`InstantStep` (installed in
the engine process): every sequence that samples gets one fixed token, with no forward pass. It listens
on 127.0.0.1 at a port the OS picks and says where on stderr, as ``warpforge serve`` does. When the
engine process stops it writes the stub's own time (steps, seconds) to FILE, so the measurement can
take it out. The engine runs on the CPU: no device is touched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

STUB_TEXT = " the"  # the token every step returns: a common word, so the detokenizer and SSE carry text


class InstantStep:
    """Stands in for ``ModelRunner.launch``: a step whose ``result()`` is one fixed token per sampling
    sequence. It counts its calls and the time spent inside them.

    ``step_ms`` > 0 gives every step a fixed device time: steps queue on a pretend device one after the
    other, and ``result()`` sleeps until its step is done. The sleep holds no GIL, as a CUDA sync does not,
    so the engine's own Python (schedule, postprocess, detokenize) competes with the server's event loop
    exactly as it does beside a GPU; with ``step_ms`` 0 the step is free and only the server's cost is left."""

    def __init__(self, token_id: int, step_ms: float = 0.0) -> None:
        self.token_id = token_id
        self.step_s = step_ms / 1e3
        self.steps = 0
        self.seconds = 0.0
        self._device_free = 0.0  # when the pretend device finishes the last queued step

    def launch(self, batch, ids_from=None) -> InstantStep._Pending:
        t0 = time.perf_counter()
        self._device_free = max(t0, self._device_free) + self.step_s
        pending = InstantStep._Pending([self.token_id] * len(batch.sampling_seqs), self._device_free)
        self.steps += 1
        self.seconds += time.perf_counter() - t0
        return pending

    class _Pending:
        def __init__(self, ids: list[int], done_at: float) -> None:
            self.ids, self.token_ids, self.done_at = ids, None, done_at

        def result(self) -> tuple[list[int], list[None]]:
            wait = self.done_at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return self.ids, [None] * len(self.ids)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"steps": self.steps, "seconds": self.seconds, "token_id": self.token_id,
                                          "step_ms": 1e3 * self.step_s}))

    @classmethod
    def install(cls, engine, step_ms: float = 0.0) -> InstantStep:
        """Replace ``engine.runner.launch``; the token is the tokenizer's first id of STUB_TEXT."""
        if not (step_ms >= 0 and step_ms < 1e4):
            raise ValueError(f"step_ms: expected milliseconds in [0, 10000), got {step_ms}")
        ids = engine.tokenizer.encode(STUB_TEXT, add_special_tokens=False)
        stub = cls(ids[0] if ids else 0, step_ms)
        engine.runner.launch = stub.launch
        return stub


def setup(engine, *, step_ms: float, stats: str):
    """The engine process's setup hook (EngineSpec.setup): install the stub; its stats are written at the
    process's end."""
    stub = InstantStep.install(engine, step_ms)
    return lambda: stub.write(stats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m warpforge.bench.suites._serve_stub", description=__doc__)
    ap.add_argument("checkpoint", help="an HF checkpoint directory (its tokenizer and config are used)")
    ap.add_argument("--stats", required=True, help="JSON file written at exit: the stub's steps and seconds")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-queue", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="device time of every step (a GIL-free wait); 0: the step is free")
    args = ap.parse_args(argv)
    if not 0 <= args.step_ms < 1e4:
        ap.error(f"--step-ms: expected milliseconds in [0, 10000), got {args.step_ms}")

    from warpforge.serve.config import ServeConfig
    from warpforge.serve.server import bind, build_llm, serve

    config = ServeConfig(model=args.checkpoint, served_model_name="stub", host="127.0.0.1", port=0,
                         max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
                         dtype="fp32", shutdown_grace_s=2.0)
    sock = bind(config.host, config.port)
    llm = build_llm(config, device="cpu", setup="warpforge.bench.suites._serve_stub:setup",
                    setup_args={"step_ms": args.step_ms, "stats": str(Path(args.stats).resolve())})
    return serve(config, llm=llm, sock=sock)


if __name__ == "__main__":
    sys.exit(main())
