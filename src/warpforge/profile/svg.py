"""Inline SVG charts for the HTML report: log-log roofline, fraction-of-roof bars, time split, timeline strip.

Plain strings, no plotting library and nothing fetched: the report must open offline. Every mark
carries a <title>, which browsers show as a tooltip without any script.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

COLORS = {"memory": "#2b6cb0", "compute": "#dd6b20", "unplaced": "#a0aec0", "model": "#2f855a",
          "idle-host": "#e53e3e", "idle-launch": "#f6ad55", "comm": "#805ad5", "copies": "#38b2ac",
          "outside": "#cbd5e0"}
ROOF_COLORS = {"fp32": "#4a5568", "tf32": "#718096", "fp16": "#2d3748", "bf16": "#1a202c", "fp8": "#744210",
               "int8": "#744210"}
FONT = 'font-family="system-ui, sans-serif"'


def _num(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.0f}"
    if v >= 1:
        return f"{v:.1f}"
    return f"{v:.2g}"


class LogAxis:
    """Maps values in [lo, hi] to pixels [a, b] on a log10 scale."""

    def __init__(self, lo: float, hi: float, a: float, b: float):
        self.lo, self.hi, self.a, self.b = lo, hi, a, b
        self.l0, self.l1 = math.log10(lo), math.log10(hi)

    def __call__(self, v: float) -> float:
        v = min(max(v, self.lo), self.hi)
        return self.a + (math.log10(v) - self.l0) / (self.l1 - self.l0) * (self.b - self.a)

    def ticks(self) -> list[float]:
        return [10.0 ** e for e in range(math.ceil(self.l0 - 1e-9), math.floor(self.l1 + 1e-9) + 1)]


def _decade_range(values: list[float], pad_lo: float, pad_hi: float) -> tuple[float, float]:
    lo = 10 ** math.floor(math.log10(min(values) * pad_lo))
    hi = 10 ** math.ceil(math.log10(max(values) * pad_hi))
    return lo, max(hi, lo * 100)


def roofline_svg(points: list[dict[str, Any]], ceilings: dict[str, Any], roofs: list[str],
                 width: int = 860, height: int = 520) -> str:
    """Log-log roofline: x FLOP/byte, y TFLOP/s; HBM roof (and L2, dashed) and one flat roof per
    precision in ``roofs``; points {name, intensity, tflops, share, bound, marker, fraction, time_us}."""
    bw_tbs = ceilings["hbm_GBps"] / 1e3
    l2_tbs = (ceilings.get("l2_GBps") or 0) / 1e3
    peaks = {k: ceilings["tflops"][k] for k in roofs if k in ceilings["tflops"]}
    pts = [p for p in points if p.get("intensity") and p.get("tflops")]
    ridges = [v / bw_tbs for v in peaks.values()]
    xlo, xhi = _decade_range([p["intensity"] for p in pts] + ridges, 0.5, 4)
    ylo, yhi = _decade_range([p["tflops"] for p in pts] + list(peaks.values()), 0.5, 2.5)
    xlo, ylo = max(xlo, 1e-3), max(ylo, 1e-5)
    L, R, T, B = 70, width - 150, 20, height - 50
    X, Y = LogAxis(xlo, xhi, L, R), LogAxis(ylo, yhi, B, T)
    s = [f'<svg id="roofline" class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
         f'xmlns="http://www.w3.org/2000/svg" {FONT} font-size="12" role="img" aria-label="roofline chart">',
         f'<rect x="{L}" y="{T}" width="{R - L}" height="{B - T}" fill="#fff" stroke="#cbd5e0"/>']
    for v in X.ticks():
        s.append(f'<line x1="{X(v):.1f}" y1="{T}" x2="{X(v):.1f}" y2="{B}" stroke="#edf2f7"/>'
                 f'<text x="{X(v):.1f}" y="{B + 16}" text-anchor="middle">{_num(v)}</text>')
    for v in Y.ticks():
        s.append(f'<line x1="{L}" y1="{Y(v):.1f}" x2="{R}" y2="{Y(v):.1f}" stroke="#edf2f7"/>'
                 f'<text x="{L - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{_num(v)}</text>')
    s.append(f'<text x="{(L + R) / 2}" y="{height - 12}" text-anchor="middle">arithmetic intensity (FLOP/byte)</text>'
             f'<text transform="translate(16 {(T + B) / 2}) rotate(-90)" text-anchor="middle">TFLOP/s</text>')

    def roof_line(tbs: float, peak: float, **attrs: str) -> str:
        # From where y = x * bandwidth enters the plot to the ridge point of the highest roof.
        x0 = max(xlo, ylo / tbs)
        x1 = min(xhi, peak / tbs)
        extra = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in attrs.items())
        return (f'<line class="roof" x1="{X(x0):.1f}" y1="{Y(x0 * tbs):.1f}" x2="{X(x1):.1f}" y2="{Y(x1 * tbs):.1f}" '
                f'{extra}/>')

    top = max(peaks.values()) if peaks else 1.0
    s.append(roof_line(bw_tbs, top, stroke="#2b6cb0", stroke_width="2.5"))
    # The bandwidth label sits along the diagonal, a third of the way up, rotated with it.
    xa, xb = max(xlo, ylo / bw_tbs), min(xhi, top / bw_tbs)
    xm = 10 ** (math.log10(xa) + (math.log10(xb) - math.log10(xa)) / 3)
    ang = math.degrees(math.atan2(Y(xb * bw_tbs) - Y(xa * bw_tbs), X(xb) - X(xa)))
    s.append(f'<text transform="translate({X(xm):.1f} {Y(xm * bw_tbs) - 7:.1f}) rotate({ang:.1f})" '
             f'fill="#2b6cb0" font-weight="600">HBM {bw_tbs:.2f} TB/s</text>')
    if l2_tbs > bw_tbs:
        s.append(roof_line(l2_tbs, top, stroke="#63b3ed", stroke_width="1.5", stroke_dasharray="5 4"))
    for k, peak in sorted(peaks.items(), key=lambda kv: kv[1]):
        xr = peak / bw_tbs
        c = ROOF_COLORS.get(k, "#4a5568")
        s.append(f'<line class="roof" x1="{X(xr):.1f}" y1="{Y(peak):.1f}" x2="{R}" y2="{Y(peak):.1f}" '
                 f'stroke="{c}" stroke-width="2"/>'
                 f'<text x="{R + 6}" y="{Y(peak) + 4:.1f}" fill="{c}" font-weight="600">'
                 f'{k} {_num(peak)} TFLOP/s</text>')
    for p in sorted(pts, key=lambda p: -p.get("share", 0)):
        x, y = X(p["intensity"]), Y(p["tflops"])
        r = 3 + 19 * math.sqrt(max(min(p.get("share", 0), 1.0), 0.0))
        c = COLORS.get(p.get("bound") or "unplaced", COLORS["unplaced"])
        tip = escape(f'{p["name"]}: {p["tflops"]:.3g} TFLOP/s at {p["intensity"]:.3g} FLOP/B'
                     + (f', {100 * p["fraction"]:.0f}% of the {p.get("bound")} roof' if p.get("fraction") else "")
                     + f', {p.get("time_us", 0):.1f} µs/iter ({100 * p.get("share", 0):.1f}%)')
        if p.get("marker") == "kernel":
            side = 2 * r / 1.4
            s.append(f'<rect class="point kernel" x="{x - r / 1.4:.1f}" y="{y - r / 1.4:.1f}" width="{side:.1f}" '
                     f'height="{side:.1f}" fill="none" stroke="{c}" stroke-width="1.5"><title>{tip}</title></rect>')
        elif p.get("marker") == "model":
            s.append(f'<path class="point model" '
                     f'd="M{x:.1f},{y - 9:.1f} L{x + 8:.1f},{y + 6:.1f} L{x - 8:.1f},{y + 6:.1f} Z" '
                     f'fill="{COLORS["model"]}" stroke="#fff"><title>{tip}</title></path>')
        else:
            s.append(f'<circle class="point op" cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{c}" fill-opacity="0.55" '
                     f'stroke="{c}"><title>{tip}</title></circle>')
    # Label the biggest operators: left of the point near the right edge, never over another label.
    placed: list[tuple[float, float]] = []  # roof labels sit right of R, where no point label reaches
    for p in [p for p in pts if p.get("marker") == "op"][:10]:
        text = p.get("label", p["name"])[:34]
        right = X(p["intensity"]) > R - 7 * len(text) - 20
        x = X(p["intensity"]) + (-10 if right else 10)
        y = Y(p["tflops"]) - 8
        if len(placed) >= 5 or any(abs(x - a) < 120 and abs(y - b) < 15 for a, b in placed):
            continue
        placed.append((x, y))
        s.append(f'<text class="label" x="{x:.1f}" y="{y:.1f}" text-anchor="{"end" if right else "start"}" '
                 f'fill="#1a202c" stroke="#fff" stroke-width="3" paint-order="stroke">{escape(text)}</text>')
    ly = T + 10
    for label, color, shape in (("operator (memory-bound)", COLORS["memory"], "c"),
                                ("operator (compute-bound)", COLORS["compute"], "c"),
                                ("kernel", "#4a5568", "r"), ("whole model", COLORS["model"], "t")):
        mark = (f'<circle cx="{L + 14}" cy="{ly}" r="5" fill="{color}" fill-opacity="0.6"/>' if shape == "c" else
                f'<rect x="{L + 9}" y="{ly - 5}" width="10" height="10" fill="none" stroke="{color}"/>' if shape == "r"
                else f'<path d="M{L + 14},{ly - 6} L{L + 20},{ly + 5} L{L + 8},{ly + 5} Z" fill="{color}"/>')
        s.append(mark + f'<text x="{L + 26}" y="{ly + 4}">{label}</text>')
        ly += 17
    if not pts:
        s.append(f'<text x="{(L + R) / 2}" y="{(T + B) / 2}" text-anchor="middle" fill="#718096">'
                 'no operator with counted FLOPs to place</text>')
    s.append("</svg>")
    return "".join(s)


def fraction_bars_svg(rows: list[dict[str, Any]], width: int = 860) -> str:
    """One bar per operator: fraction of the roof that binds it (memory or compute), share in the label."""
    rows = [r for r in rows if r.get("fraction") is not None]
    h = 24 * len(rows) + 40
    L, R = 330, width - 60
    s = [f'<svg id="fraction" class="chart" viewBox="0 0 {width} {h}" width="{width}" height="{h}" '
         f'xmlns="http://www.w3.org/2000/svg" {FONT} font-size="12" role="img" aria-label="fraction of roof">']
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        x = L + v * (R - L)
        s.append(f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{h - 24}" stroke="#e2e8f0"/>'
                 f'<text x="{x:.1f}" y="{h - 8}" text-anchor="middle">{int(v * 100)}%</text>')
    for i, r in enumerate(rows):
        y = 14 + 24 * i
        f = min(max(r["fraction"], 0.0), 1.2)
        c = COLORS.get(r.get("bound") or "unplaced")
        tip = escape(f'{r["name"]}: {100 * r["fraction"]:.1f}% of the {r.get("bound")} roof, '
                     f'{100 * r.get("share", 0):.1f}% of time')
        s.append(f'<text x="{L - 8}" y="{y + 13}" text-anchor="end">{escape(r["name"][:46])}</text>'
                 f'<rect class="bar" x="{L}" y="{y}" width="{max(f * (R - L), 1):.1f}" height="17" fill="{c}">'
                 f'<title>{tip}</title></rect>'
                 f'<text x="{L + min(f, 1.0) * (R - L) + 4:.1f}" y="{y + 13}">{100 * r["fraction"]:.0f}%</text>')
    s.append("</svg>")
    return "".join(s)


def split_svg(parts: list[tuple[str, float, str]], width: int = 860) -> str:
    """A stacked bar of the window: (label, microseconds, color key)."""
    total = sum(v for _, v, _ in parts) or 1.0
    L, R = 10, width - 10
    s = [f'<svg id="split" class="chart" viewBox="0 0 {width} 74" width="{width}" height="74" '
         f'xmlns="http://www.w3.org/2000/svg" {FONT} font-size="12" role="img" aria-label="time split">']
    x = L
    lx = L
    for label, v, key in parts:
        w = v / total * (R - L)
        c = COLORS.get(key, "#a0aec0")
        if w > 0:
            s.append(f'<rect x="{x:.1f}" y="6" width="{w:.1f}" height="26" fill="{c}">'
                     f'<title>{escape(label)}: {v:.1f} µs ({100 * v / total:.1f}%)</title></rect>')
        x += w
        s.append(f'<rect x="{lx}" y="46" width="11" height="11" fill="{c}"/>'
                 f'<text x="{lx + 15}" y="56">{escape(label)} {100 * v / total:.0f}%</text>')
        lx += 16 + 8 * (len(label) + 5)
    s.append("</svg>")
    return "".join(s)


def strip_svg(strip: list[list], width: int = 860) -> str:
    """One iteration's device timeline: busy work by category, idle gaps by cause."""
    if not strip:
        return ""
    end = max(s + d for s, d, _ in strip) or 1.0
    L, R = 10, width - 10
    s = [f'<svg id="strip" class="chart" viewBox="0 0 {width} 56" width="{width}" height="56" '
         f'xmlns="http://www.w3.org/2000/svg" {FONT} font-size="11" role="img" aria-label="one iteration">']
    for start, dur, cat in strip:
        x = L + start / end * (R - L)
        w = max(dur / end * (R - L), 0.4)
        c = COLORS.get("copies" if cat == "memory" else cat, "#a0aec0")
        s.append(f'<rect x="{x:.2f}" y="4" width="{w:.2f}" height="24" fill="{c}"/>')
    s.append(f'<text x="{L}" y="46">0</text><text x="{R}" y="46" text-anchor="end">{end:,.0f} µs</text>')
    s.append("</svg>")
    return "".join(s)
