"""The whole tiny model through warpforge's Triton kernels (the interpreter on CPU, the GPU with CUDA).

Model tests elsewhere run the kernels' torch references on CPU; this one forces the Triton path so
the layers' use of the kernels (strided q/k/v views of the fused qkv output in rope, store_kv and the
attention kernels, residual-fused norms with Gemma's offset) is checked end to end against HF.
Short prompts keep the interpreter to a few seconds per model.

Each (arch, fused) pass through the interpreter runs once per module (``triton_runs``): the unfused
pass that is checked against HF is also the baseline of the fused-norm test.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import force_triton
from warpforge.llm.loader import load
from warpforge.llm.testing import PagedDriver, hamlet_text, tiny_checkpoint

transformers = pytest.importorskip("transformers")
# numpy's deprecation of int(array) inside Triton's interpreter, once per program index: noise
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def triton_runs(tmp_path_factory):
    """``runs(arch, fused)`` -> (checkpoint path, prompt a, prompt b, the five logits blocks of three paged
    steps: a[:12]; a[12:] with b; one decode token each), each (arch, fused) computed once per module."""
    cache: dict = {}
    models: dict = {}

    def runs(arch: str, fused: bool):
        if (arch, fused) in cache:
            return cache[arch, fused]
        with pytest.MonkeyPatch.context() as mp:  # as the autouse _isolated_dirs, which is per test
            root = tmp_path_factory.mktemp(f"wf-{arch}")
            mp.setenv("WARPFORGE_CACHE_DIR", str(root / "cache"))
            mp.setenv("WARPFORGE_AUTOTUNE", "0")
            if arch not in models:
                path = tiny_checkpoint(arch, root / arch)
                model, tok, _ = load(path, dtype=torch.float32, device=DEVICE)
                ids = tok.encode(hamlet_text() or "Who's there? Nay, answer me: stand, and unfold yourself. " * 3)
                models[arch] = (path, model, ids[:20], ids[100:109])  # a crosses Gemma's 16-token window
            path, model, a, b = models[arch]
            with force_triton(), torch.no_grad():
                model.fuse_norms(fused)
                try:
                    drv = PagedDriver(model)
                    got = [*drv.step([("a", a[:12])]), *drv.step([("a", a[12:]), ("b", b)]),
                           *drv.step([("a", [7]), ("b", [9])])]
                finally:
                    model.fuse_norms(False)
        cache[arch, fused] = (path, a, b, got)
        return cache[arch, fused]

    return runs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # strided q/k/v views; qk-norm, sandwich norms, window
def test_triton_path_matches_hf(arch, triton_runs):
    path, a, b, got = triton_runs(arch, False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ra, rb = hf(torch.tensor([a + [7]])).logits[0], hf(torch.tensor([b + [9]])).logits[0]
    refs = [ra[:12], ra[12:20], rb[:9], ra[-1:], rb[-1:]]
    assert len(got) == len(refs)
    for g, r in zip(got, refs):
        # fp32 with IEEE dots in the attention kernels; 1e-4 of the largest logit covers tf32 GEMMs on a GPU
        assert (g.cpu() - r).abs().max() <= 1e-4 * r.abs().max()


# One arch for the fused pass: Gemma 3. Both archs reach the fused GEMV through the same prenorm/NormedInput
# code (DecoderLayer and Gemma3DecoderLayer call it alike, the same K = hidden 64 and the same kernel
# constexprs: the norm offset is a runtime scalar); Gemma adds what Llama cannot show: offset 1 (its norm
# weights sit near 0, so a dropped offset changes every logit), sandwich-normed inputs to the fused norm,
# 4 layers. The GEMV norm fusion's own odd-size tests (tests/kernels/test_gemv_norm.py) cover offsets 0 and 1.
@pytest.mark.slow  # two interpreter passes of the 4-layer model (one shared with the HF test)
def test_triton_path_fused_norm_matches_unfused(triton_runs):
    """CausalLM.fuse_norms(True): the norms before qkv and gate_up run inside those GEMVs (the Triton kernels
    through the interpreter: prefill chunks and decode rows are GEMV-sized here). Same logits as the unfused
    model to fp32 summation order, and HF's within the bar above."""
    path, a, _, unfused = triton_runs("gemma3", False)
    _, _, _, fused = triton_runs("gemma3", True)
    assert len(fused) == len(unfused) == 5
    for f, u in zip(fused, unfused):
        assert (f - u).abs().max() <= 1e-5 * u.abs().max()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        r = hf(torch.tensor([a + [7]])).logits[0]
    assert (fused[0].cpu() - r[:12]).abs().max() <= 1e-4 * r.abs().max()
