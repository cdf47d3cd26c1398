"""Suite ``splat``: the case list, the scene, the checks against gsplat, the stage timer and the records, on
CPU at tiny sizes. The renderers are stand-ins here (gsplat's CUDA build cannot run on a CPU, and the session's
plumbing is what is tested); the H200 run renders with warpforge.splat and gsplat 1.5.3."""

from __future__ import annotations

import json

import pytest
import torch

from warpforge.bench.e2e import run_end_to_end
from warpforge.results.record import validate_record
from warpforge.bench.suites import _splat_run as sr

CPU = torch.device("cpu")
ENV = {"name": "cpu", "torch": torch.__version__}


def _suite():
    from warpforge.bench.runner import load_suite

    return load_suite("splat")


def test_suite_lists_every_row_tiny_on_cpu():
    cases = _suite().build(quick=False)  # no CUDA here: tiny sizes whatever quick says
    rows = [c.params["row"] for c in cases]
    assert rows == ["fwd-100k", "fwd-1M", "fwd-3M", "fwdbwd-1M", "fwdbwd-3M", "fwdbwd-1M-c8", "stages-1M"]
    assert all(c.params["tiny"] and "[tiny:" in c.name for c in cases)
    assert len({c.name for c in cases}) == len(cases)
    fwd_1m = cases[1]
    assert fwd_1m.name.startswith("forward N=1M 1920x1080 SH3")
    assert set(fwd_1m.peers) == {sr.GSPLAT, sr.GSPLAT_PACKED}
    assert fwd_1m.target["ratio"] == {sr.GSPLAT: 1.25} and fwd_1m.target["max"] == {"peak_mem_vs_gsplat": 1.0}
    assert fwd_1m.target["published_ms"] == {"gsplat dense (issue)": 2.07}
    assert cases[5].params["cameras"] == 2 and cases[5].name.startswith("forward+backward N=1M 8 cameras")
    json.dumps([c.params for c in cases] + [c.target for c in cases])


def test_full_size_workloads_are_the_issues():
    from warpforge.bench.suites import splat

    got = [splat._workload(n, c, b, tiny=False) for n, c, b in splat.ROWS]
    assert [(w.n, w.cameras, w.width, w.height, w.sh_degree, w.backward) for w in got] == [
        (100_000, 1, 1920, 1080, 3, False), (1_000_000, 1, 1920, 1080, 3, False),
        (3_000_000, 1, 1920, 1080, 3, False), (1_000_000, 1, 1920, 1080, 3, True),
        (3_000_000, 1, 1920, 1080, 3, True), (1_000_000, 8, 1920, 1080, 3, True)]
    with pytest.raises(ValueError, match="Workload.n must be an int >= 1"):
        sr.Workload(n=0)


def test_scene_is_seeded_and_in_front_of_every_camera():
    w = sr.Workload(n=500, cameras=3, width=64, height=48, seed=4)
    a, b = sr.make_scene(w, CPU), sr.make_scene(w, CPU)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["sh"].shape == (500, 16, 3) and a["means"].shape == (500, 3) and a["v_img"].shape == (3, 48, 64, 3)
    assert torch.allclose(a["quats"].norm(dim=-1), torch.ones(500))
    assert bool(((a["opacities"] > 0) & (a["opacities"] < 1)).all())
    assert not torch.equal(a["means"], sr.make_scene(sr.Workload(n=500, cameras=3, width=64, height=48, seed=5),
                                                     CPU)["means"])
    V, K = a["viewmats"], a["Ks"]
    assert torch.equal(V[1], torch.eye(4)) and K[0, 0, 0] == 0.8 * 64
    R = V[:, :3, :3]
    assert torch.allclose(R @ R.transpose(1, 2), torch.eye(3).expand(3, 3, 3), atol=1e-6)
    cam = torch.einsum("cij,nj->cni", R, a["means"]) + V[:, None, :3, 3]
    assert bool((cam[..., 2] > 1.5).all())
    uv = cam[..., :2] / cam[..., 2:] * K[:, None, 0, 0, None] + K[:, None, :2, 2]
    inside = (uv[..., 0] >= 0) & (uv[..., 0] < 64) & (uv[..., 1] >= 0) & (uv[..., 1] < 48)
    assert float(inside.float().mean()) > 0.7  # most of the scene is on screen in every camera


def _fake(offset: float = 0.0, n_isects: int = 7):
    """A differentiable stand-in renderer: every parameter reaches the image."""
    def build(w: sr.Workload):
        def render(means, quats, scales, opacities, sh, viewmats, Ks):
            base = (sh[:, 0] * opacities[:, None]).mean(0) + 1e-3 * ((means * scales).sum() + quats.pow(2).sum())
            ramp = torch.linspace(0.0, 1.0, w.width)[None, None, :, None]
            img = base.expand(viewmats.shape[0], w.height, w.width, 3) * ramp + offset
            return img, img[..., :1] * 0 + 0.5, n_isects
        return render
    return build


def _missing(w: sr.Workload):
    raise sr.PeerMissing("gsplat is not installed (ModuleNotFoundError: No module named 'gsplat')")


def test_compare_judges_images_and_every_gradient():
    w = sr.Workload(n=50, width=16, height=8, backward=True)
    scene = sr.make_scene(w, CPU)
    a = sr.make_call(_fake()(w), scene, True)()
    got = sr.compare(a, a, "peer:gsplat")
    assert got["ok"] and got["rel_err"] == 0.0 and set(got["grad_cosine"]) == set(sr.PARAMS)
    assert got["grad_cosine_min"] == pytest.approx(1.0)
    off = sr.make_call(_fake(offset=2e-3)(w), scene, True)()
    bad = sr.compare(off, a, "peer:gsplat")
    assert not bad["ok"] and bad["rel_err"] == pytest.approx(2e-3, rel=1e-3)
    flipped = dict(a, grads=(a["grads"][0], -a["grads"][1], *a["grads"][2:]))
    worse = sr.compare(flipped, a, "peer:gsplat")
    assert not worse["ok"] and worse["grad_cosine"]["quats"] == pytest.approx(-1.0)


def test_session_records_gsplat_missing_and_checks_ours_against_the_reference(monkeypatch):
    from warpforge.bench.suites import splat

    monkeypatch.setitem(sr.BUILDERS, sr.OURS, _fake())
    monkeypatch.setitem(sr.BUILDERS, sr.GSPLAT, _missing)
    monkeypatch.setitem(sr.BUILDERS, sr.GSPLAT_PACKED, _missing)
    monkeypatch.setattr(sr, "reference_render", _fake())
    case = splat._case(1_000_000, 1, True, gpu=False, tiny=True)
    rec = run_end_to_end(case, suite="splat", device=CPU, env_device=ENV, git="test")
    validate_record(rec)
    assert "gsplat is not installed" in rec["peers"][sr.GSPLAT]["error"]
    assert rec["ratio"] == {} and rec["meets"]["ratio.gsplat"] is None
    assert rec["correct"]["ok"] and rec["correct"]["rel_err"] == 0.0
    assert rec["correct"]["against"] == "warpforge.splat.reference.render_reference"
    assert "gsplat did not run" in rec["correct"]["note"]
    ours = rec["ours"]
    assert ours["ms"] > 0 and ours["n_isects"] == 7 and ours["peak_mem_GB"] is None  # no device memory on CPU
    assert ours["peak_mem_vs_gsplat"] is None and ours["gaussians"] == sr.Workload(n=3000).n
    json.dumps(rec, allow_nan=False)


def test_session_ratios_and_memory_against_a_peer(monkeypatch):
    from warpforge.bench.suites import splat

    monkeypatch.setitem(sr.BUILDERS, sr.OURS, _fake(n_isects=6))
    monkeypatch.setitem(sr.BUILDERS, sr.GSPLAT, _fake(n_isects=8))
    monkeypatch.setitem(sr.BUILDERS, sr.GSPLAT_PACKED, _fake(offset=1.0))
    monkeypatch.setattr(sr, "peak_memory_gb", lambda call, device: 2.0 if call().get("n_isects") == 6 else 4.0)
    rec = run_end_to_end(splat._case(100_000, 1, False, gpu=False, tiny=True), suite="splat", device=CPU,
                         env_device=ENV, git="test")
    validate_record(rec)
    assert rec["correct"]["ok"] and rec["correct"]["against"] == "peer:gsplat"
    assert "grad_cosine" not in rec["correct"]  # a forward case compares images only
    assert set(rec["ratio"]) == {sr.GSPLAT, sr.GSPLAT_PACKED} and all(r > 0 for r in rec["ratio"].values())
    assert rec["ours"]["peak_mem_vs_gsplat"] == 0.5 and rec["ours"]["n_isects_vs_gsplat"] == 0.75
    assert rec["meets"]["max.peak_mem_vs_gsplat"] is True
    assert rec["peers"][sr.GSPLAT]["correct"]["ok"]  # the baseline


def test_stage_timer_splits_the_pipeline():
    def ours_like(scene, clock):
        clock.mark("start")
        for stage in sr.STAGES:
            torch.ones(10).sum()
            clock.mark(stage)

    def gsplat_like(scene, clock):
        clock.mark("start")
        for stage in ("project", "sh", "intersect", "intersect+sort", "offsets", "rasterize", "backward"):
            clock.mark(stage)

    got = sr.time_stages(ours_like, {}, CPU, warmup=1, rep=3)
    assert set(got) == set(sr.STAGES) | {"total"}
    assert got["total"] == pytest.approx(sum(got[s] for s in sr.STAGES))
    g = sr.time_stages(gsplat_like, {}, CPU, warmup=0, rep=2)
    assert set(g) == set(sr.STAGES) | {"intersect+sort", "total"}
    assert g["sort"] == pytest.approx(max(g["intersect+sort"] - g["intersect"], 0.0))
    assert g["total"] == pytest.approx(sum(g[k] for k in g if k not in ("intersect", "sort", "total")))


def test_stages_case_records_each_pipelines_breakdown(monkeypatch):
    from warpforge.bench.suites import splat

    def staged(names):
        def build(w):
            def run(scene, clock):
                clock.mark("start")
                for stage in names:
                    torch.ones(10).sum()  # some work: a stage of zero measured time would make ms 0
                    clock.mark(stage)
            return run
        return build

    monkeypatch.setitem(sr.BUILDERS, sr.OURS, _fake())
    monkeypatch.setitem(sr.BUILDERS, sr.GSPLAT, _fake())
    monkeypatch.setitem(sr.STAGE_BUILDERS, sr.OURS, staged(sr.STAGES))
    monkeypatch.setitem(sr.STAGE_BUILDERS, sr.GSPLAT, staged(("project", "sh", "intersect", "intersect+sort",
                                                                "offsets", "rasterize", "backward")))
    rec = run_end_to_end(splat._stages_case(gpu=False, tiny=True), suite="splat", device=CPU, env_device=ENV,
                         git="test")
    validate_record(rec)
    assert set(rec["ours"]["stages_ms"]) == set(sr.STAGES) | {"total"}
    assert rec["ours"]["ms"] == pytest.approx(rec["ours"]["stages_ms"]["total"])
    assert "sort" in rec["peers"][sr.GSPLAT]["stages_ms"] and sr.GSPLAT in rec["ratio"]
    assert rec["correct"]["ok"] and "grad_cosine" in rec["correct"]
