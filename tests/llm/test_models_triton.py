"""The whole tiny model through warpforge's Triton kernels (the interpreter on CPU, the GPU with CUDA).

Model tests elsewhere run the kernels' torch references on CPU; this one forces the Triton path so
the layers' use of the kernels (strided q/k/v views of the fused qkv output in rope, store_kv and the
attention kernels, residual-fused norms with Gemma's offset) is checked end to end against HF.
Short prompts keep the interpreter to a few seconds per model.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.llm.loader import load
from warpforge.llm.testing import PagedDriver, hamlet_text, tiny_checkpoint

transformers = pytest.importorskip("transformers")
# numpy's deprecation of int(array) inside Triton's interpreter, once per program index: noise
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # strided q/k/v views; qk-norm, sandwich norms, window
def test_triton_path_matches_hf(arch, tmp_path, triton_on_cpu, device):
    path = tiny_checkpoint(arch, tmp_path / arch)
    model, tok, _ = load(path, dtype=torch.float32, device=device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.encode(hamlet_text() or "Who's there? Nay, answer me: stand, and unfold yourself. " * 3)
    a, b = ids[:20], ids[100:109]  # a crosses Gemma's 16-token window
    drv = PagedDriver(model)
    got = [*drv.step([("a", a[:12])]), *drv.step([("a", a[12:]), ("b", b)]), *drv.step([("a", [7]), ("b", [9])])]
    with torch.no_grad():
        ra, rb = hf(torch.tensor([a + [7]])).logits[0], hf(torch.tensor([b + [9]])).logits[0]
    refs = [ra[:12], ra[12:20], rb[:9], ra[-1:], rb[-1:]]
    for g, r in zip(got, refs):
        # fp32 with IEEE dots in the attention kernels; 1e-4 of the largest logit covers tf32 GEMMs on a GPU
        assert (g.cpu() - r).abs().max() <= 1e-4 * r.abs().max()


@pytest.mark.slow  # two interpreter passes per model, ~2 min each on a loaded 2-core box
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_triton_path_fused_norm_matches_unfused(arch, tmp_path, triton_on_cpu, device):
    """CausalLM.fuse_norms(True): the norms before qkv and gate_up run inside those GEMVs (the Triton kernels
    through the interpreter: prefill chunks and decode rows are GEMV-sized here). Same logits as the unfused
    model to fp32 summation order, and HF's within the bar above."""
    path = tiny_checkpoint(arch, tmp_path / arch)
    model, tok, _ = load(path, dtype=torch.float32, device=device)
    ids = tok.encode(hamlet_text() or "Who's there? Nay, answer me: stand, and unfold yourself. " * 3)
    a, b = ids[:20], ids[100:109]
    runs = []
    for fused in (False, True):
        model.fuse_norms(fused)
        drv = PagedDriver(model)
        runs.append([*drv.step([("a", a[:12])]), *drv.step([("a", a[12:]), ("b", b)]),
                     *drv.step([("a", [7]), ("b", [9])])])
    model.fuse_norms(False)
    for f, u in zip(runs[1], runs[0]):
        assert (f - u).abs().max() <= 1e-5 * u.abs().max()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        r = hf(torch.tensor([a + [7]])).logits[0]
    assert (runs[1][0].cpu() - r[:12]).abs().max() <= 1e-4 * r.abs().max()
