"""MCMC densification (3DGS-MCMC, gsplat's MCMCStrategy): Eq. 9 against gsplat's CUDA kernel's loop written out
here (its torch wrapper needs CUDA), relocation of dead Gaussians onto live ones, growth up to the cap, the
opacity-gated noise, and a few training steps on the built-in street through the CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from warpforge.splat.mcmc import MCMCConfig, MCMCDensifier, compute_relocation
from warpforge.splat.optim import SelectiveAdam


def _gsplat_relocation(o: float, s: float, n: int) -> tuple[float, float]:
    """gsplat 1.5.3's relocation_kernel (RelocationCUDA.cu) for one Gaussian, float32 as on the GPU."""
    f = np.float32
    o_new = f(1.0) - f(np.power(f(1.0) - f(o), f(1.0) / f(n)))
    denom = f(0.0)
    for i in range(1, n + 1):
        for k in range(i):
            term = f(f((-1.0) ** k) / f(math.sqrt(k + 1)) * f(np.power(o_new, f(k + 1))))
            denom = f(denom + f(math.comb(i - 1, k)) * term)
    return float(o_new), float(f(f(o) / denom) * f(s))


@pytest.mark.parametrize("o,n", [(0.9, 2), (0.3, 3), (0.99, 5), (0.05, 12), (0.7, 51)])
def test_relocation_matches_gsplat_and_preserves_opacity(o, n):
    new_o, new_s = compute_relocation(torch.tensor([o]), torch.tensor([[0.2, 0.4, 0.8]]), torch.tensor([n]))
    g_o, g_s = _gsplat_relocation(o, 0.2, n)
    assert float(new_o) == pytest.approx(g_o, rel=1e-5)
    assert float(new_s[0, 0]) == pytest.approx(g_s, rel=1e-4)
    torch.testing.assert_close(new_s[0] / new_s[0, 0], torch.tensor([1.0, 2.0, 4.0]))  # one factor per Gaussian
    # n copies of opacity o_new stacked at one point are as opaque as the original
    assert 1 - (1 - float(new_o)) ** n == pytest.approx(o, rel=1e-5)
    assert n == 1 or float(new_s[0, 0]) < 0.2 or o < 0.2  # sharing an opaque Gaussian shrinks each copy


def _params(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {"means": torch.randn(n, 3, generator=g), "scales": torch.randn(n, 3, generator=g) - 2,
         "quats": torch.randn(n, 4, generator=g), "opacities": torch.randn(n, generator=g),
         "sh0": torch.randn(n, 1, 3, generator=g), "shN": torch.randn(n, 3, 3, generator=g)}
    return {k: v.requires_grad_() for k, v in p.items()}


def test_relocate_grow_and_cap():
    p = _params(40)
    opt = SelectiveAdam(p, {k: 1e-3 for k in p})
    for st in opt.state.values():
        for m in st.values():
            m.fill_(1.0)  # so a zeroed moment shows
    dead = torch.tensor([3, 7, 8, 30])
    with torch.no_grad():
        p["opacities"][dead] = -10.0  # opacity 4.5e-5: dead
    before = {k: v.detach().clone() for k, v in p.items()}
    mc = MCMCDensifier(MCMCConfig(cap_max=40, refine_start_iter=0, refine_every=2, noise_lr=0.0), seed=1)
    assert mc.step(4, p, opt) == {"relocated": 4, "added": 0}  # at the cap already: nothing added
    op = torch.sigmoid(p["opacities"].detach())
    assert (op > mc.cfg.min_opacity).all()  # nothing is dead any more
    alive = [i for i in range(40) if i not in dead.tolist()]
    for d in dead.tolist():
        # a relocated Gaussian sits on a live one (same centre, rotation, colour) that now shares its opacity
        src = [a for a in alive if torch.equal(p["means"][d], before["means"][a])]
        assert len(src) == 1 and torch.equal(p["sh0"][d], before["sh0"][src[0]])
        assert float(op[d]) < float(torch.sigmoid(before["opacities"][src[0]]))
        assert torch.equal(p["opacities"][d], p["opacities"][src[0]])
        assert float(opt.state["means"]["exp_avg"][d].abs().sum()) == 0  # fresh moments
    untouched = [i for i in alive if torch.equal(p["opacities"][i], before["opacities"][i])]
    assert len(untouched) >= 32 and float(opt.state["means"]["exp_avg"][untouched[0]].abs().min()) == 1.0
    # growth: 5% of 40 is 2, a cap of 41 allows 1; the new row copies its source, which shares its opacity
    mc.cfg.cap_max = 41
    before = {k: v.detach().clone() for k, v in p.items()}
    assert mc.step(6, p, opt) == {"relocated": 0, "added": 1}
    assert all(v.shape[0] == 41 for v in p.values()) and all(opt.state[k]["exp_avg"].shape[0] == 41 for k in p)
    src = [i for i in range(40) if torch.equal(p["means"][40], before["means"][i])]
    assert torch.equal(p["opacities"][40], p["opacities"][src[0]])
    assert float(torch.sigmoid(p["opacities"].detach()[40])) < float(torch.sigmoid(before["opacities"][src[0]]))
    assert float(opt.state["sh0"]["exp_avg"][40].abs().sum()) == 0
    assert mc.step(8, p, opt) == {"relocated": 0, "added": 0} and p["means"].shape[0] == 41  # at the cap
    assert mc.step(7, p, opt) == {}  # off the refine_every schedule: only noise
    mc2 = MCMCDensifier(MCMCConfig(refine_start_iter=10, refine_every=1, noise_lr=0.0))
    assert mc2.step(10, p, opt) == {}  # refinement starts after refine_start_iter, as gsplat


def test_noise_moves_transparent_gaussians_only():
    p = _params(6)
    with torch.no_grad():
        p["opacities"][:3] = 8.0  # opacity 0.9997: gate ~ sigmoid(-99.5) = 0
        p["opacities"][3:] = -8.0  # opacity 0.0003: gate ~ 0.6
    before = p["means"].detach().clone()
    opt = SelectiveAdam(p, {k: 1e-3 for k in p})
    mc = MCMCDensifier(MCMCConfig(noise_lr=5e5), seed=0)
    mc.step(0, p, opt)
    moved = (p["means"].detach() - before).norm(dim=-1)
    assert (moved[:3] < 1e-20).all() and (moved[3:] > 1e-3).all()
    # the same seed makes the same moves (every rank of a data-parallel run agrees)
    q = {k: v.detach().clone() for k, v in _params(6).items()}
    with torch.no_grad():
        q["opacities"][:3], q["opacities"][3:] = 8.0, -8.0
    MCMCDensifier(MCMCConfig(noise_lr=5e5), seed=0).step(0, q, opt)
    assert torch.equal(q["means"], p["means"].detach())


def test_train_mcmc_on_the_street_stays_under_the_cap():
    """A few steps on the built-in street with refinements every 2 steps: dead Gaussians are relocated, the count
    grows to the cap and never past it, and training still lowers the loss."""
    from warpforge.splat.scene import street_scene
    from warpforge.splat.train import STRATEGY_PRESETS, TrainConfig, Trainer

    data = street_scene(n=1500, width=32, height=24, n_ring=6, n_drive=6).posed_images()
    cap = 170
    cfg = TrainConfig(steps=12, eval_every=12, strategy="mcmc", **STRATEGY_PRESETS["mcmc"],
                      mcmc=MCMCConfig(cap_max=cap, refine_start_iter=1, refine_every=2))
    tr = Trainer(data, cfg)
    n0 = tr.n
    assert n0 <= cap and n0 > 100
    with torch.no_grad():
        tr.params["opacities"][:20] = -10.0  # 20 dead Gaussians for the first refinement
    rows = [tr.train_step() for _ in range(12)]
    assert max(r["n"] for r in rows) <= cap and tr.n == cap
    assert rows[2]["relocated"] >= 20 and sum(r.get("added", 0) for r in rows) == cap - n0
    assert rows[-1]["loss"] < rows[0]["loss"]
    # resume: the checkpoint holds the generator, so the continued run is the same run
    state = tr.state_dict()
    a = Trainer(data, cfg)
    a.load_state_dict(state)
    b = Trainer(data, cfg)
    b.load_state_dict(state)
    assert a.train_step()["loss"] == b.train_step()["loss"] and torch.equal(a.params["means"], b.params["means"])
    with pytest.raises(ValueError, match="trained with --strategy mcmc, not default"):
        Trainer(data, TrainConfig(steps=12)).load_state_dict(state)


def test_train_cli_mcmc(tmp_path):
    from warpforge.cli import main
    from warpforge.splat.train import load_checkpoint

    out = tmp_path / "mcmc"
    args = ["splat", "train", "street", "--out", str(out), "--steps", "3", "--gaussians", "1200", "--size", "32x24",
            "--eval-every", "3", "--device", "cpu", "--quiet", "--strategy", "mcmc", "--cap-max", "100"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    ck = load_checkpoint(out / "ckpt" / "last.pt")
    assert ck["config"]["strategy"] == "mcmc" and ck["config"]["mcmc"]["cap_max"] == 100
    assert ck["params"]["means"].shape[0] <= 100 and ck["config"]["init_opacity"] == 0.5
    res = CliRunner().invoke(main, [*args[:-4], "--cap-max", "100"])
    assert res.exit_code == 2 and "warpforge splat: --cap-max: only with --strategy mcmc" in res.stderr
