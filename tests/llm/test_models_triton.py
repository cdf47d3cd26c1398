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
