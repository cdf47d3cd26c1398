"""warpforge serve with the model step stubbed out, so that a load test times only the server path.

``python -m warpforge.bench.suites._serve_stub CHECKPOINT --stats FILE [--max-num-seqs N]`` runs the real
server (``warpforge.serve``: HTTP, JSON, tokenization, scheduling, detokenization, SSE) over a real
engine whose runner is replaced by :class:`InstantStep`: every sequence that samples gets one fixed
token at once, with no forward pass. It listens on 127.0.0.1 at a port the OS picks and says where on
stderr, as ``warpforge serve`` does. At exit it writes the stub's own time (steps, seconds) to FILE, so
the measurement can take it out. The engine runs on the CPU: no device is touched.
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
    sequence. It counts its calls and the time spent inside them."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id
        self.steps = 0
        self.seconds = 0.0

    def launch(self, batch, ids_from=None) -> InstantStep._Pending:
        t0 = time.perf_counter()
        pending = InstantStep._Pending([self.token_id] * len(batch.sampling_seqs))
        self.steps += 1
        self.seconds += time.perf_counter() - t0
        return pending

    class _Pending:
        def __init__(self, ids: list[int]) -> None:
            self.ids, self.token_ids = ids, None

        def result(self) -> tuple[list[int], list[None]]:
            return self.ids, [None] * len(self.ids)

    @classmethod
    def install(cls, engine) -> InstantStep:
        """Replace ``engine.runner.launch``; the token is the tokenizer's first id of STUB_TEXT."""
        ids = engine.tokenizer.encode(STUB_TEXT, add_special_tokens=False)
        stub = cls(ids[0] if ids else 0)
        engine.runner.launch = stub.launch
        return stub


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m warpforge.bench.suites._serve_stub", description=__doc__)
    ap.add_argument("checkpoint", help="an HF checkpoint directory (its tokenizer and config are used)")
    ap.add_argument("--stats", required=True, help="JSON file written at exit: the stub's steps and seconds")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-queue", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)

    from warpforge.llm.async_engine import AsyncLLM
    from warpforge.serve.config import ServeConfig
    from warpforge.serve.server import bind, serve

    config = ServeConfig(model=args.checkpoint, served_model_name="stub", host="127.0.0.1", port=0,
                         max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
                         shutdown_grace_s=2.0)
    sock = bind(config.host, config.port)
    llm = AsyncLLM(args.checkpoint, device="cpu", dtype="float32", max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs)
    stub = InstantStep.install(llm.engine)
    try:
        return serve(config, llm=llm, sock=sock)
    finally:
        Path(args.stats).write_text(json.dumps({"steps": stub.steps, "seconds": stub.seconds,
                                                "token_id": stub.token_id}))


if __name__ == "__main__":
    sys.exit(main())
