"""ServeConfig: what `warpforge serve` loads and how its HTTP front behaves, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from warpforge import dtypes
from warpforge._validate import check_int

DTYPES = ("auto", *dtypes.SHORT)  # documented; every spelling of warpforge.dtypes is taken
TORCH_DTYPES = {"auto": None, **dtypes.TORCH_NAMES}
KV_CACHE_DTYPES = ("auto", "fp8")  # llm.engine_config.KV_CACHE_DTYPES, spelled out: this module stays torch-free
MAX_BODY_BYTES = 4 << 20  # a request body beyond this gets 413 (a 100k-token prompt as JSON is ~0.5 MB)


@dataclass
class ServeConfig:
    """Every setting of one server. The engine fields build the AsyncLLM (``server.build_llm``); the
    rest shape the HTTP API (``app.create_app``).

    model               checkpoint as `warpforge generate` takes it: an HF directory, a .gguf, or gemma3-270m
    served_model_name   the name clients send as ``model`` and /v1/models lists (default: ``model`` as given)
    host, port          where to listen (port 0: any free port; the startup line says which)
    api_key             None: open; else every endpoint but /health wants ``Authorization: Bearer <key>``
    metrics_without_auth  with an api_key, leave /metrics open too (a Prometheus scraper without the key)
    max_model_len       longest prompt + output in tokens (None: the model's context)
    max_num_seqs        sequences the engine runs at once
    max_queue           sequences allowed to wait beyond the max_num_seqs running ones; a request that
                        would exceed running + waiting = max_num_seqs + max_queue gets 429 + Retry-After
    dtype               weights and activations: auto (bf16 on a GPU, fp32 on CPU), fp32, fp16 or bf16
    kv_cache_dtype      auto (the model's dtype) or fp8
    chat_template       jinja text replacing the model's chat template (None: the model's own)
    max_body_bytes      request bodies beyond this get 413
    shutdown_grace_s    on SIGTERM / Ctrl-C, how long in-flight requests may run before they are aborted
    access_log          log one line per HTTP request (uvicorn's access log)
    speculative         None, or "ngram" / "self": the engine's speculative decoding (llm.speculative)
    """

    model: str = ""
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # never in a repr, a log line or an error
    metrics_without_auth: bool = False
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_queue: int = 1024
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    chat_template: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    shutdown_grace_s: float = 30.0
    access_log: bool = False
    speculative: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise ValueError(f"model: expected a string, got {self.model!r}")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError(f"served_model_name: expected a non-empty string, got {self.served_model_name!r}")
        if not self.model and self.served_model_name is None:
            raise ValueError("model: expected a checkpoint (or a served_model_name), got neither")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: expected an address such as 127.0.0.1 or 0.0.0.0, got {self.host!r}")
        check_int("port", self.port, 0, 65535)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key: expected a non-empty string")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_queue", self.max_queue, 0)
        self.dtype = dtypes.short_name(self.dtype, auto=True)  # "float16" -> "fp16": what TORCH_DTYPES keys
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        tpl = self.chat_template
        if tpl is not None and (not isinstance(tpl, str) or not tpl.strip()):
            raise ValueError("chat_template: expected non-empty jinja text")
        check_int("max_body_bytes", self.max_body_bytes, 1024)
        g = self.shutdown_grace_s
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ValueError(f"shutdown_grace_s: expected a number of seconds >= 0, got {g!r}")
        if not isinstance(self.metrics_without_auth, bool):
            raise ValueError(f"metrics_without_auth: expected a bool, got {self.metrics_without_auth!r}")
        if not isinstance(self.access_log, bool):
            raise ValueError(f"access_log: expected a bool, got {self.access_log!r}")
        if self.speculative not in (None, "ngram", "self"):  # "draft" needs a second model: Python API only
            raise ValueError(f"speculative: expected None, 'ngram' or 'self', got {self.speculative!r}")

    @property
    def model_name(self) -> str:
        """What clients send as ``model``."""
        return self.served_model_name or self.model

    @property
    def max_in_flight(self) -> int:
        """Sequences admitted at once (running + waiting); one more gets 429."""
        return self.max_num_seqs + self.max_queue
