"""The dtype spellings every entry point takes: ``LLM(dtype=...)``, ``warpforge serve --dtype``,
``warpforge generate --dtype``, ``ServeConfig(dtype=...)``, ``optimize --precision``. One table, so a spelling
one of them takes the others take too.

    short_name("float16")          # "fp16" (also "fp16", "half", "torch.float16", "FP16")
    torch_name("bf16")             # "bfloat16": the torch attribute (torch.bfloat16)

Standard library only: configs that stay torch-free (serve.config) use it.
"""

from __future__ import annotations

SHORT = ("fp32", "fp16", "bf16")  # the names the toolkit reports and documents
# every accepted spelling (lower case, without "torch.") -> its short name
ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32",
           "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16"}
TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # short name -> torch attribute


def short_name(dtype: str, *, auto: bool = False) -> str:
    """The short name of a spelling ("float16", "half", "torch.float16" -> "fp16"); with ``auto``, "auto"
    passes through. ValueError names the spellings taken."""
    key = dtype.strip().lower().removeprefix("torch.") if isinstance(dtype, str) else None
    if auto and key == "auto":
        return "auto"
    if key not in ALIASES:
        taken = (["auto"] if auto else []) + list(ALIASES)
        raise ValueError(f"dtype: expected one of {taken}, got {dtype!r}")
    return ALIASES[key]


def torch_name(dtype: str) -> str | None:
    """The torch attribute name of a spelling ("fp16" -> "float16"); "auto" -> None."""
    short = short_name(dtype, auto=True)
    return None if short == "auto" else TORCH_NAMES[short]


__all__ = ["ALIASES", "SHORT", "TORCH_NAMES", "short_name", "torch_name"]
