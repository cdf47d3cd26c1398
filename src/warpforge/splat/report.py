"""The training report: one self-contained HTML file (inline CSS, inline SVG charts, images as data URIs).

Headline figures, loss and PSNR curves, the Gaussian count over steps, time per stage of a step, and a grid
of held-out renders next to their ground truth. No script and nothing fetched: it opens offline.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from warpforge._html import page_css

CSS = page_css(h2_top=28, figs_margin=12, fig_min_width=110) + """
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:10px}
.chart{width:100%;height:auto;background:#fff;border:1px solid #e2e8f0;border-radius:6px}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{border-bottom:1px solid #edf2f7;padding:4px 10px;text-align:right} th{background:#edf2f7}
td.l,th.l{text-align:left}
.bar{display:inline-block;height:9px;background:#2b6cb0;vertical-align:middle}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:12px}
.pair{background:#fff;border:1px solid #e2e8f0;border-radius:6px;padding:6px;font-size:12px}
.pair svg{width:100%;height:auto;image-rendering:pixelated}
"""
FONT = 'font-family="system-ui, sans-serif"'


def encode_png(img: np.ndarray) -> bytes:
    """PNG bytes of an [H, W, 3] uint8 (or float in [0, 1]) image; zlib only, no imaging library."""
    a = np.asarray(img)
    if a.dtype != np.uint8:
        a = (np.clip(a, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if a.ndim != 3 or a.shape[2] != 3 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"encode_png: expected an [H, W, 3] image, got shape {a.shape}")
    h, w, _ = a.shape
    raw = b"".join(b"\x00" + a[y].tobytes() for y in range(h))  # filter type 0 on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def write_png(img: np.ndarray, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_png(img))
    return path


def _num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v / 1000:.0f}k" if a < 1e6 else f"{v / 1e6:.1f}M"
    return f"{v:.0f}" if a >= 10 else f"{v:.2g}"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = 10 ** math.floor(math.log10(max(hi - lo, 1e-12) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + 1e-9 * step:
        out.append(t)
        t += step
    return out


def line_chart(chart_id: str, title: str, series: list[tuple[str, list[float], list[float], str]],
               y_label: str, width: int = 560, height: int = 260) -> str:
    """An SVG line chart; each series is (name, xs, ys, colour); a one-point series is drawn as dots."""
    pts = [(x, y) for _, xs, ys, _ in series for x, y in zip(xs, ys) if math.isfinite(y)]
    if not pts:
        return f'<svg id="{chart_id}" class="chart" viewBox="0 0 {width} 40"><text x="10" y="25" {FONT} ' \
               f'font-size="12">{escape(title)}: no data</text></svg>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    pad = (y1 - y0) * 0.08 or abs(y0) * 0.1 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    left, right, top, bottom = 56, 14, 28, 34
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [f'<svg id="{chart_id}" class="chart" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{left}" y="17" {FONT} font-size="13" font-weight="600">{escape(title)}</text>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#edf2f7"/>'
                   f'<text x="{left - 5}" y="{sy(t) + 4:.1f}" {FONT} font-size="10" text-anchor="end">{_num(t)}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 14}" {FONT} font-size="10" text-anchor="middle">'
                   f'{_num(t)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#cbd5e0"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 4}" {FONT} font-size="11" text-anchor="middle">step</text>')
    out.append(f'<text x="12" y="{top + ph / 2}" {FONT} font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {top + ph / 2})">{escape(y_label)}</text>')
    lx = left + 8
    for name, xs, ys, color in series:
        good = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        if len(good) > 1:
            d = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(good))
            out.append(f'<path class="series" d="{d}" fill="none" stroke="{color}" stroke-width="1.6">'
                       f'<title>{escape(name)}</title></path>')
        for x, y in good if len(good) <= 40 else []:
            out.append(f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{color}">'
                       f'<title>{escape(name)} at step {x:.0f}: {y:.4g}</title></circle>')
        out.append(f'<rect x="{lx}" y="{top + 6}" width="10" height="3" fill="{color}"/><text x="{lx + 14}" '
                   f'y="{top + 11}" {FONT} font-size="10">{escape(name)}</text>')
        lx += 24 + 6 * len(name)
    out.append("</svg>")
    return "".join(out)


def _smooth(ys: list[float], k: int) -> list[float]:
    if k <= 1 or len(ys) < k:
        return ys
    c = np.cumsum(np.insert(np.asarray(ys, dtype=np.float64), 0, 0.0))
    head = [float(c[i + 1] / (i + 1)) for i in range(k - 1)]
    return head + list((c[k:] - c[:-k]) / k)


def _image_pair(name: str, render: np.ndarray, truth: np.ndarray, psnr_db: float) -> str:
    h, w = render.shape[:2]
    uri = [base64.b64encode(encode_png(a)).decode() for a in (render, truth)]
    svg = (f'<svg viewBox="0 0 {2 * w + 4} {h}" xmlns="http://www.w3.org/2000/svg">'
           f'<image x="0" y="0" width="{w}" height="{h}" href="data:image/png;base64,{uri[0]}"/>'
           f'<image x="{w + 4}" y="0" width="{w}" height="{h}" href="data:image/png;base64,{uri[1]}"/></svg>')
    return (f'<div class="pair">{svg}<div>{escape(name)}: render (left) and ground truth (right), '
            f'PSNR {psnr_db:.2f} dB</div></div>')


def render_html(d: dict[str, Any]) -> str:
    """The report from a summary dict (``Trainer``'s history, evals, stage times, and the view renders)."""
    hist, evals = d.get("history", []), d.get("evals", [])
    last = evals[-1] if evals else {}
    figs = [("held-out PSNR" if last.get("held_out", True) else "training-view PSNR",
             f"{last['psnr']:.2f} dB" if last else "—"),
            ("SSIM", f"{last['ssim']:.4f}" if last else "—"), ("Gaussians", f"{d.get('n', 0):,}"),
            ("steps", f"{d.get('steps', 0):,}"),
            ("steps/s", f"{d['steps_per_s']:.2f}" if d.get("steps_per_s") else "—"),
            ("wall time", f"{d.get('wall_s', 0):.0f} s")]
    head = "".join(f'<div class="fig"><b>{escape(v)}</b><span>{escape(k)}</span></div>' for k, v in figs)
    xs = [r["step"] for r in hist]
    loss = line_chart("loss", "Training loss (L1 + SSIM term), smoothed", [
        ("loss", xs, _smooth([r["loss"] for r in hist], 5), "#2b6cb0")], "loss")
    psnr = line_chart("psnr", "PSNR", [
        ("train views (smoothed)", xs, _smooth([r["psnr"] for r in hist], 5), "#a0aec0"),
        ("held out" if last.get("held_out", True) else "training views", [e["step"] for e in evals],
         [e["psnr"] for e in evals], "#dd6b20")], "dB")
    count = line_chart("gaussians", "Gaussians", [("count", xs, [r["n"] for r in hist], "#2f855a")], "Gaussians")
    stages = d.get("stage_ms", {})
    total = sum(stages.values()) or 1.0
    rows = "".join(f'<tr><td class="l">{escape(k)}</td><td>{v:.2f}</td><td>{100 * v / total:.0f}%</td>'
                   f'<td class="l"><span class="bar" style="width:{int(300 * v / total)}px"></span></td></tr>'
                   for k, v in stages.items())
    pairs = "".join(_image_pair(p["name"], p["render"], p["truth"], p["psnr"]) for p in d.get("views", []))
    meta = " · ".join(escape(str(x)) for x in (d.get("scene", ""), d.get("device", ""), d.get("config_line", "")) if x)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>warpforge splat training: {escape(str(d.get('scene', '')))}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body><main>
<h1>Gaussian-splat training</h1><div class="sub">{meta}</div>
<div class="figs" id="headline">{head}</div>
<h2>Curves</h2><div class="charts">{loss}{psnr}{count}</div>
<h2>Time per stage of a step</h2>
<table id="stages"><tr><th class="l">stage</th><th>ms / step</th><th>share</th><th class="l"></th></tr>{rows}</table>
<div class="sub">Mean over the timed steps ({d.get('stage_steps', 0)}); on a GPU every 10th step is timed with a
synchronisation per stage.</div>
<h2>Held-out views</h2><div class="grid" id="views">{pairs}</div>
</main></body></html>
"""


def write_report(d: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(d), encoding="utf-8")
    return path
