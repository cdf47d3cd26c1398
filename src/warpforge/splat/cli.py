"""`warpforge splat train|render|export|video|view`: what the click group in warpforge/cli.py runs.

Each returns an exit status: 0 done, 2 bad input. Every message on stderr has one form,
``warpforge splat: <file or argument>: <what>`` (warnings too, with ``warning:`` after the file), the same
prefix warpforge/_cli_support.py gives an error a command lets through.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

STREET = "street"


class UsageError(ValueError):
    """Bad input from the command line; printed as one line, exit status 2."""


PREFIX = "warpforge splat"


def _fail(msg: str) -> int:
    """One line on stderr, exit status 2. ``msg`` starts with the file or argument it is about."""
    print(f"{PREFIX}: {msg}", file=sys.stderr)
    return 2


def _warn(where: str | Path, msg: str) -> None:
    print(f"{PREFIX}: {where}: warning: {msg}", file=sys.stderr)


def _about(where: str | Path, msg: str) -> str:
    """``msg`` led by the file it is about (library messages mostly start with their path already)."""
    return msg if msg.startswith(str(where)) else f"{where}: {msg}"


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size: expected WIDTHxHEIGHT such as 960x540, got {text!r}") from None
    if w < 16 or h < 16 or w > 16384 or h > 16384:
        raise UsageError(f"--size: each side must be in 16..16384, got {text!r}")
    return w, h


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device(name)


STREET_GAUSSIANS, RANDOM_INIT_POINTS = 300_000, 100_000  # --gaussians' defaults for its two meanings


def load_scene(scene: str, *, gaussians: int | None, size: tuple[int, int], downscale: int, test_every: int,
               seed: int, device: torch.device, say=None):
    """SCENE: ``street`` (the built-in procedural street), a COLMAP folder (a model in sparse/0, sparse or the
    folder), or a nerfstudio / Blender scene (transforms.json, or transforms_train.json, or the json itself).
    ``gaussians``: the street's ground truth, or the random initial points of a json scene without a PLY.
    ``say(text)``, when given, hears a line before and after the street's ground truth is built: rendering every
    camera of a 300k-Gaussian street takes minutes on a CPU, which should not pass in silence."""
    from warpforge.splat.colmap import load_colmap
    from warpforge.splat.scene import StreetConfig, street_scene
    from warpforge.splat.transforms import find_transforms, load_transforms

    if scene == STREET:
        cfg = StreetConfig(n=gaussians or STREET_GAUSSIANS, width=size[0], height=size[1], test_every=test_every,
                           seed=seed)
        t0 = time.perf_counter()
        if say:
            say(f"building the street's ground truth: about {cfg.n:,} Gaussians, rendering its "
                f"{cfg.n_ring + cfg.n_drive} cameras at {size[0]}x{size[1]} on {device} ...")
        street = street_scene(cfg)
        data = street.posed_images(device)
        if say:
            say(f"built the ground truth: {street.splats.n:,} Gaussians, {len(street.views)} images in "
                f"{time.perf_counter() - t0:.1f} s")
        return data
    path = Path(scene)
    if not path.exists():
        raise UsageError(f"{scene}: no such file or folder (SCENE is '{STREET}', a COLMAP folder or a "
                         "transforms.json scene)")
    try:
        if path.is_dir() and _has_colmap(path):
            return load_colmap(path, downscale=downscale, test_every=test_every, device=device)
        if find_transforms(path) is None:
            raise UsageError(f"{scene}: neither a COLMAP model (sparse/0/cameras.bin or .txt) nor a "
                             "transforms.json / transforms_train.json")
        return load_transforms(path, downscale=downscale, test_every=test_every,
                               init_points=gaussians or RANDOM_INIT_POINTS, seed=seed, device=device)
    except ValueError as e:  # ColmapError, TransformsError
        if isinstance(e, UsageError):
            raise
        raise UsageError(_about(path, str(e))) from None


def _has_colmap(folder: Path) -> bool:
    from warpforge.splat.colmap import ColmapError, find_sparse

    try:
        find_sparse(folder)
        return True
    except ColmapError:
        return False


def _held_out_views(trainer, limit: int = 8) -> list[dict]:
    """Renders of up to ``limit`` held-out cameras beside their ground truth, for the report."""
    from warpforge.splat.metrics import psnr
    from warpforge.splat.scene import render

    out = []
    splats = trainer.splats
    for i in (trainer.data.test or trainer.data.train)[:limit]:
        v = trainer.views.subset([i])
        with torch.no_grad():
            img, _, _ = render(splats, v.viewmats, v.Ks, v.width, v.height, sh_degree=trainer.sh_degree_now(),
                               background=trainer.background, tile_size=trainer.cfg.tile_size,
                               rasterize_mode=trainer.rasterize_mode)
        gt = trainer.data.batch([i], trainer.device)
        img = img.clamp(0, 1)
        out.append({"name": v.names[0], "render": img[0].cpu().numpy(), "truth": gt[0].cpu().numpy(),
                    "psnr": float(psnr(img, gt)[0])})
    return out


def cli_train(scene: str, *, out: str, steps: int, batch: int, gaussians: int | None, size: str, downscale: int,
              sh_degree: int, test_every: int, eval_every: int, ckpt_every: int, resume: bool, device: str,
              seed: int, quiet: bool = False, antialiased: bool = False, strategy: str = "default",
              cap_max: int | None = None) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from warpforge._cli_support import make_console
    from warpforge.splat import distributed
    from warpforge.splat.report import write_report
    from warpforge.splat.mcmc import MCMCConfig
    from warpforge.splat.train import STRATEGY_PRESETS, TrainConfig, Trainer

    try:
        import plyfile  # noqa: F401  (checked before hours of training, not at the export)
    except ImportError:
        return _fail("plyfile: not installed; splat training writes a PLY: pip install 'warpforge[splat]'")
    try:
        wh = parse_size(size)
        n_gauss = 200 if gaussians is None else gaussians
        for name, value, low in (("--steps", steps, 1), ("--batch", batch, 1), ("--gaussians", n_gauss, 200),
                                 ("--downscale", downscale, 1), ("--test-every", test_every, 2),
                                 ("--eval-every", eval_every, 1), ("--ckpt-every", ckpt_every, 0)):
            if value < low:
                raise UsageError(f"{name}: must be >= {low}, got {value}")
        dev = _device(device)
        world = distributed.init_world("cuda" if dev.type == "cuda" else "cpu")
        dev = world.device if world is not None else dev
        rank0 = world is None or world.rank == 0
        console = make_console(quiet=quiet or not rank0)
        if strategy not in STRATEGY_PRESETS:
            raise UsageError(f"--strategy: one of {', '.join(STRATEGY_PRESETS)}, got {strategy!r}")
        if cap_max is not None and strategy != "mcmc":
            raise UsageError("--cap-max: only with --strategy mcmc (the default strategy has no cap)")
        if cap_max is not None and cap_max < 1:
            raise UsageError(f"--cap-max: must be >= 1, got {cap_max}")
        mcmc = MCMCConfig(**({} if cap_max is None else {"cap_max": cap_max}))
        cfg = TrainConfig(steps=steps, batch=batch, sh_degree=sh_degree, seed=seed, eval_every=eval_every,
                          antialiased=antialiased, strategy=strategy, mcmc=mcmc, **STRATEGY_PRESETS[strategy])
        data = load_scene(scene, gaussians=gaussians, size=wh, downscale=downscale, test_every=test_every,
                          seed=seed, device=dev, say=lambda text: console.print(text, highlight=False, soft_wrap=True))
    except (UsageError, ValueError) as e:
        return _fail(str(e))
    out_dir = Path(out)
    ckpt = out_dir / "ckpt" / "last.pt"
    trainer = Trainer(data, cfg, device=dev, world=world)
    if resume:
        if not ckpt.is_file():
            return _fail(f"{ckpt}: no checkpoint to --resume from")
        try:
            trainer.resume(ckpt)
        except ValueError as e:
            return _fail(f"{ckpt}: {e}")
        console.print(f"resumed from {ckpt} at step {trainer.step}")
    where = f"{dev}" + (f", {world.size} ranks" if world is not None else "")
    console.print(f"training {data.name}: {len(data.train)} cameras ({len(data.test)} held out), "
                  f"{data.views.width}x{data.views.height}, {trainer.n:,} initial Gaussians, {steps} steps on {where}")
    t0, start = time.perf_counter(), trainer.step
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
                  disable=quiet or not rank0) as bar:
        task = bar.add_task("train", total=steps, completed=trainer.step, info="")

        def on_step(row: dict) -> None:
            bar.update(task, completed=row["step"] + 1,
                       info=f"loss {row['loss']:.4f}  psnr {row['psnr']:.2f}  N {row['n']:,}")
            if ckpt_every and (row["step"] + 1) % ckpt_every == 0 and rank0:
                trainer.save(ckpt)

        def on_eval(ev: dict) -> None:
            bar.console.print(f"step {ev['step']:>6}: {'held-out' if ev['held_out'] else 'train'} PSNR "
                              f"{ev['psnr']:.2f} dB, SSIM {ev['ssim']:.4f}, {ev['n']:,} Gaussians")

        if rank0 and not trainer.evals:
            on_eval(trainer.evaluate())  # where the held-out PSNR starts
        trainer.fit(on_step=on_step, on_eval=on_eval)
    wall = time.perf_counter() - t0
    if world is not None:
        world.barrier()
    if rank0:
        from warpforge.splat.ply import save_ply

        trainer.save(ckpt)
        ply = save_ply(trainer.splats, out_dir / "point_cloud.ply")
        ev = trainer.evals[-1]
        rate = (trainer.step - start) / wall if wall > 0 else None
        stage_ms = {k: v / max(trainer.stage_steps, 1) for k, v in trainer.stage_ms.items()}
        summary = {"scene": data.name, "device": where, "steps": trainer.step, "n": trainer.n,
                   "steps_per_s": rate, "wall_s": trainer.wall_s, "held_out_psnr": ev["psnr"],
                   "held_out_ssim": ev["ssim"], "stage_ms": stage_ms,
                   "config_line": f"batch {batch} x {trainer.world_size} rank(s), SH degree {sh_degree}, "
                                  f"{strategy} densification"
                                  + (f" (cap {cfg.mcmc.cap_max:,})" if strategy == "mcmc" else "")}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        report = write_report({**summary, "history": trainer.history, "evals": trainer.evals,
                               "stage_steps": trainer.stage_steps, "views": _held_out_views(trainer)},
                              out_dir / "report.html")
        console.print(f"held-out PSNR {ev['psnr']:.2f} dB, SSIM {ev['ssim']:.4f}, {trainer.n:,} Gaussians, "
                      f"{rate:.2f} steps/s, {wall:.1f} s")
        console.print(f"wrote {ckpt}, {ply}, {report}")
    distributed.shutdown()
    return 0


# ---- render -----------------------------------------------------------------------------------------------

def _parse_vec(text: str, what: str) -> list[float]:
    try:
        v = [float(x) for x in text.split(",")]
    except ValueError:
        v = []
    if len(v) != 3:
        raise UsageError(f"{what}: expected three numbers separated by commas, got {text!r}")
    return v


def _split(split: dict[str, list[int]] | None) -> dict[str, list[int]]:
    assert split is not None, "a checkpoint's cameras come with their train/test split (load_source)"
    return split


def resolve_cameras(specs: tuple[str, ...], views, split: dict[str, list[int]] | None, *,
                    size: tuple[int, int] | None, fov: float):
    """--camera values -> (names, Views). A spec is ``EYE@TARGET`` ("x,y,z@x,y,z", pinhole, --size/--fov), or
    for a checkpoint a camera name, ``train:I``, ``test:I``, ``test`` (all held out) or ``all``."""
    from warpforge.splat.scene import Views, intrinsics, look_at

    names: list[str] = []
    mats, ks = [], []
    w, h = size or ((views.width, views.height) if views is not None else (960, 540))
    for spec in specs:
        if "@" in spec:
            eye, at = spec.split("@", 1)
            e, a = torch.tensor([_parse_vec(eye, "--camera EYE")]), torch.tensor([_parse_vec(at, "--camera TARGET")])
            try:
                mats.append(look_at(e, a)[0])
            except ValueError as err:
                raise UsageError(f"--camera {spec!r}: {err}") from None
            ks.append(intrinsics(w, h, fov)[0])
            names.append(f"camera{len(names)}")
            continue
        if views is None:
            raise UsageError(f"--camera {spec!r}: a PLY has no cameras; give EYE@TARGET, e.g. 0,-20,10@0,0,0")
        if spec in ("all", "test", "train"):
            idx = list(range(len(views))) if spec == "all" else list(_split(split)[spec])
        elif spec.startswith(("train:", "test:")):
            part, _, num = spec.partition(":")
            part_idx = _split(split)[part]
            if not num.isdigit() or int(num) >= len(part_idx):
                raise UsageError(f"--camera {spec!r}: index must be in 0..{len(part_idx) - 1}")
            idx = [part_idx[int(num)]]
        elif spec in views.names:
            idx = [views.names.index(spec)]
        else:
            raise UsageError(f"--camera {spec!r}: not a camera of the checkpoint (names like {views.names[0]!r}, "
                             "or train:I, test:I, test, all, EYE@TARGET)")
        for i in idx:
            names.append(views.names[i])
            mats.append(views.viewmats[i])
            k = views.Ks[i].clone()
            if size is not None:  # another resolution of the same camera
                k[0] *= w / views.width
                k[1] *= h / views.height
            ks.append(k)
    return names, Views(torch.stack(mats), torch.stack(ks), w, h, names)


def load_source(source: str):
    """CKPT_OR_PLY -> (splats, views or None, {"train", "test"} or None, background [3], trained antialiased).
    Values are checked here, so a bad file fails naming itself before anything renders."""
    from warpforge.splat.scene import Splats, Views

    src = Path(source)
    if not src.is_file():
        raise UsageError(f"{source}: no such file")
    if src.suffix.lower() == ".ply":
        from warpforge.splat.ply import load_ply

        return load_ply(src), None, None, torch.zeros(3), False
    from warpforge.splat.train import load_checkpoint

    d = load_checkpoint(src)
    splats = Splats.from_dict(d["params"])
    splats.check_values(src)
    v = d["views"]
    views = Views(v["viewmats"], v["Ks"], v["width"], v["height"], v["names"])
    return (splats, views, {"train": v["train"], "test": v["test"]}, d["background"],
            bool(d["config"].get("antialiased", False)))


def cli_render(source: str, *, cameras: tuple[str, ...], out: str, size: str | None, fov: float,
               sh_degree: int | None, device: str, background: str | None, antialiased: bool | None = None) -> int:
    from warpforge.splat.report import write_png
    from warpforge.splat.scene import render

    try:
        dev = _device(device)
        wh = parse_size(size) if size else None
        if not 1.0 <= fov < 179.0:
            raise UsageError(f"--fov: degrees in [1, 179), got {fov}")
        splats, views, split, bg, trained_aa = load_source(source)
        if background is not None:
            bg = torch.tensor(_parse_vec(background, "--background"))
            if not all(0.0 <= x <= 1.0 for x in bg.tolist()):
                raise UsageError(f"--background: expected r,g,b in [0, 1], got {background!r}")
        if not cameras:
            raise UsageError("--camera: give at least one (a checkpoint's camera name, test:0, or EYE@TARGET)")
        names, cams = resolve_cameras(cameras, views, split, size=wh, fov=fov)
        if sh_degree is not None and not 0 <= sh_degree <= 3:
            raise UsageError(f"--sh-degree: 0..3, got {sh_degree}")
    except (UsageError, ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    out_path = Path(out)
    single = len(names) == 1 and out_path.suffix.lower() == ".png"
    splats, cams, bg = splats.to(dev), cams.to(dev), bg.to(dev)
    # a checkpoint renders the way it was trained unless told otherwise
    mode = "antialiased" if (trained_aa if antialiased is None else antialiased) else "classic"
    t0 = time.perf_counter()
    written = []
    for i, name in enumerate(names):
        c = cams.subset([i])
        try:
            with torch.no_grad():
                img, alpha, _ = render(splats, c.viewmats, c.Ks, c.width, c.height, sh_degree=sh_degree,
                                       background=bg, rasterize_mode=mode)
        except ValueError as e:  # the Gaussians' or the camera's values; the file is what the user can fix
            return _fail(f"{source}: {e}")
        path = out_path if single else out_path / f"{name.replace('/', '_').rsplit('.', 1)[0]}.png"
        written.append(write_png(img[0].clamp(0, 1).cpu().numpy().astype(np.float32), path))
        if not bool(alpha.any()):  # a mistyped EYE@TARGET or a wrong file: say so rather than hand back a blank
            _warn(path, f"camera {name} sees none of the {splats.n:,} Gaussians; the image is only the background")
    dt = time.perf_counter() - t0
    print(f"rendered {len(written)} view(s) of {splats.n:,} Gaussians at {cams.width}x{cams.height} in {dt:.2f} s: "
          + (str(written[0]) if single else f"{out_path}/"))
    return 0


# ---- export, video -----------------------------------------------------------------------------------------

EXPORT_FORMATS = ("splat", "ply")


def cli_export(source: str, *, out: str, fmt: str | None) -> int:
    """CKPT_OR_PLY -> a .splat (web viewers) or an Inria-layout .ply."""
    try:
        fmt = fmt or (Path(out).suffix.lower().lstrip(".") if Path(out).suffix.lower() in (".splat", ".ply")
                      else "splat")
        if fmt not in EXPORT_FORMATS:
            raise UsageError(f"--format: one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
        splats = load_source(source)[0]
        if fmt == "splat":
            from warpforge.splat.export import RECORD, save_splat

            path = save_splat(splats, out)
            detail = f"{RECORD.itemsize} bytes each, SH beyond the DC band dropped"
        else:
            from warpforge.splat.ply import save_ply

            path = save_ply(splats, out)
            detail = f"Inria layout, SH degree {splats.sh_degree}"
    except (UsageError, ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    print(f"wrote {splats.n:,} Gaussians to {path} ({detail}; {path.stat().st_size / 1e6:.2f} MB)")
    return 0


def cli_video(source: str, *, out: str, path: str, frames: int, size: str | None, fps: int, fov: float | None,
              device: str, background: str | None, antialiased: bool | None) -> int:
    """CKPT_OR_PLY -> an MP4 along an orbit or through the training cameras."""
    from warpforge.splat.scene import render
    from warpforge.splat.video import PATHS, orbit_path, train_path, write_mp4

    try:
        dev = _device(device)
        if path not in PATHS:
            raise UsageError(f"--path: one of {', '.join(PATHS)}, got {path!r}")
        if frames < 2:
            raise UsageError(f"--frames: at least 2, got {frames}")
        if not 1 <= fps <= 240:
            raise UsageError(f"--fps: 1..240, got {fps}")
        if fov is not None and not 1.0 <= fov < 179.0:
            raise UsageError(f"--fov: degrees in [1, 179), got {fov}")
        splats, views, split, bg, trained_aa = load_source(source)
        if size:
            w, h = parse_size(size)
        elif views is not None:
            w, h = views.width, views.height
        else:
            w, h = 640, 360
        if size is None:
            w, h = w - w % 2, h - h % 2  # a checkpoint's odd size, rounded down for H.264
        elif w % 2 or h % 2:
            raise UsageError(f"--size: H.264 (yuv420p) needs an even width and height, got {size!r}")
        if background is not None:
            bg = torch.tensor(_parse_vec(background, "--background"))
        if path == "train":
            if views is None:
                raise UsageError(f"{source}: a PLY has no training cameras; use --path orbit or a checkpoint")
            cams = train_path(views, split["train"], frames, w, h)
        else:
            cams = orbit_path(splats, views, frames, w, h, fov)
    except (UsageError, ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    mode = "antialiased" if (trained_aa if antialiased is None else antialiased) else "classic"
    splats, cams, bg = splats.to(dev), cams.to(dev), bg.to(dev)
    blank = []
    t0 = time.perf_counter()

    def frames_rgb():
        for i in range(len(cams)):
            c = cams.subset([i])
            with torch.no_grad():
                img, alpha, _ = render(splats, c.viewmats, c.Ks, w, h, background=bg, rasterize_mode=mode)
            if not bool(alpha.any()):
                blank.append(i)
            yield (img[0].clamp(0, 1) * 255 + 0.5).to(torch.uint8).cpu().numpy()

    try:
        written = write_mp4(frames_rgb(), out, w, h, fps)
    except ImportError as e:
        return _fail(f"imageio-ffmpeg: {e}")
    except ValueError as e:  # the Gaussians' or a camera's values
        return _fail(f"{source}: {e}")
    if blank:
        _warn(written, f"{len(blank)} of {len(cams)} frames see none of the {splats.n:,} Gaussians (first: "
                       f"frame {blank[0]}); they are only the background")
    dt = time.perf_counter() - t0
    print(f"wrote {written}: {len(cams)} frames at {w}x{h}, {fps} fps ({path} path) of {splats.n:,} Gaussians in "
          f"{dt:.1f} s")
    return 0


# ---- view --------------------------------------------------------------------------------------------------

VIEW_STREET_GAUSSIANS = {"cpu": 20_000, "cuda": STREET_GAUSSIANS}  # the street's ground truth: a CPU redraws 20k
VIEW_SIZE = {"cpu": "320x240", "cuda": "1280x960"}  # --size's default: the largest frame, the canvas's aspect inside


def load_view_source(source: str, device: torch.device):
    """SCENE_OR_PLY_OR_CHECKPOINT -> (splats, views or None, background [3], trained antialiased, title).
    ``street``: the built-in street's ground truth (its cameras place the first view); a folder: a
    `warpforge splat train` output (ckpt/last.pt, else point_cloud.ply); a file: a checkpoint or PLY."""
    if source == STREET:
        from warpforge.splat.scene import street_scene

        n = VIEW_STREET_GAUSSIANS["cuda" if device.type == "cuda" else "cpu"]
        street = street_scene(n=n, n_ring=8, n_drive=8)
        return street.splats, street.views, street.background, False, "street (ground truth)"
    path = Path(source)
    if path.is_dir():
        found = [p for p in (path / "ckpt" / "last.pt", path / "point_cloud.ply") if p.is_file()]
        if not found:
            raise UsageError(f"{source}: no ckpt/last.pt or point_cloud.ply in this folder (expected the --out "
                             "folder of `warpforge splat train`, a .ply, a checkpoint or 'street')")
        path = found[0]
    elif not path.exists():
        raise UsageError(f"{source}: no such file or folder (expected 'street', a `warpforge splat train` output "
                         "folder, a .ply or a checkpoint)")
    splats, views, _, bg, trained_aa = load_source(str(path))
    return splats, views, bg, trained_aa, str(path)


def _interrupt(*_) -> None:
    """SIGTERM (a service manager, a test) stops the viewer the way Ctrl-C does."""
    raise KeyboardInterrupt


def cli_view(source: str, *, host: str, port: int, size: str | None, device: str,
             antialiased: bool | None = None) -> int:
    """Serve the viewer until Ctrl-C (SIGINT) or SIGTERM; exit status 0 then."""
    import signal
    import socket

    from warpforge.splat.video import orbit_around

    try:
        dev = _device(device)
        wh = parse_size(size or VIEW_SIZE[dev.type if dev.type in VIEW_SIZE else "cpu"])
        if not 0 <= port <= 65535:
            raise UsageError(f"--port: 0..65535 (0: any free port), got {port}")
        # viser moves on to the next port when one is taken and never returns when the host cannot be bound:
        # try the address here so either is one line naming it
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as e:
            raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); "
                             "--port 0 takes any free port") from None
        try:
            import viser  # noqa: F401  (checked before the scene loads)
        except ImportError:
            raise UsageError("viser: not installed; the viewer serves its page with it: "
                             "pip install 'warpforge[splat]'") from None
        splats, views, bg, trained_aa, title = load_view_source(source, dev)
        home = orbit_around(splats, views)
    except (UsageError, ValueError, FileNotFoundError, ImportError) as e:
        return _fail(_about(source, str(e)) if isinstance(e, FileNotFoundError) else str(e))
    from warpforge.splat.viewer import Viewer

    mode = "antialiased" if (trained_aa if antialiased is None else antialiased) else "classic"
    viewer = Viewer(splats, background=bg, home=home, size=wh, device=dev, rasterize_mode=mode, title=title)
    url = viewer.start(host, port)
    print(f"viewing {title}: {splats.n:,} Gaussians on {dev}, frames up to {wh[0]}x{wh[1]}, at {url} "
          "(Ctrl-C to stop)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        viewer.stop()
    print(f"stopped after {viewer.frames} frame(s)", flush=True)
    return 0


# ---- the demo's step -------------------------------------------------------------------------------------

def demo_render(out: str | Path, *, gpu: bool, console) -> dict:
    """The procedural street from the aerial ring and the drive-through, one PNG side by side, timed.

    GPU: the full street (300k Gaussians) at 1920x1080, median of 10 synchronised renders. CPU: the torch
    path on a 20k-Gaussian street at 320x180, median of 3. Returns the measured figures.
    """
    from warpforge.splat.report import write_png
    from warpforge.splat.scene import render, street_scene

    n, (w, h), reps = (300_000, (1920, 1080), 10) if gpu else (20_000, (320, 180), 3)
    dev = torch.device("cuda" if gpu else "cpu")
    street = street_scene(n=n, width=w, height=h, n_ring=8, n_drive=8)
    splats, views, bg = street.splats.to(dev), street.views.subset([1, 8]).to(dev), street.background.to(dev)
    times = []
    with torch.no_grad():
        for i in range(reps + 1):  # the first call warms up (kernel compilation on a GPU)
            t0 = time.perf_counter()
            img, _, meta = render(splats, views.viewmats, views.Ks, w, h, background=bg)
            if gpu:
                torch.cuda.synchronize()
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
    ms = float(np.median(times)) / len(views)
    pairs = int(meta["isect_ids"].numel()) if meta.get("isect_ids") is not None else None
    path = write_png(torch.cat(list(img.clamp(0, 1)), dim=1).cpu().numpy(), out)
    figures = {"gaussians": splats.n, "width": w, "height": h, "ms_per_view": ms, "tile_pairs": pairs,
               "png": str(path), "where": "CUDA kernels" if gpu else "CPU torch path"}
    console.print(f"street: {splats.n:,} Gaussians, 2 views at {w}x{h}: [bold]{ms:.1f} ms per view[/] "
                  f"({figures['where']}, median of {reps})" + (f", {pairs:,} tile-Gaussian pairs" if pairs else ""))
    console.print(f"wrote {path} (aerial ring view | drive-through view)")
    return figures
