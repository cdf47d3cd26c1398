"""The results dashboard: one self-contained HTML page, one plot per case over its runs.

Each plot shows ours' time per record, oldest to newest (p20-p80 as a whisker), the noise band around the
previous point (the band :func:`warpforge.results.history.judge` uses), and marks a point red when it is
slower beyond that band (or failed its check or failed to run), green when faster. Under each plot: the
commit, source, ratio against each peer with its interval, and the roofline fraction of every point.

Inline SVG and CSS only, no script and nothing fetched: the page opens offline and from a CI artifact.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from html import escape

from warpforge.results.history import REGRESSED, Point, Sourced, cases_of, history

CSS = """
body{font-family:system-ui,sans-serif;margin:0;background:#f7fafc;color:#1a202c}
main{max-width:1080px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #cbd5e0}
h3{font-size:14px;margin:0 0 6px;font-weight:600}
.sub{color:#4a5568;font-size:13px}
.case{background:#fff;border:1px solid #e2e8f0;border-radius:6px;padding:12px;margin:10px 0}
.case.regressed{border-color:#e53e3e}
table{border-collapse:collapse;font-size:12px;margin-top:6px;width:100%}
td,th{border-bottom:1px solid #edf2f7;padding:2px 6px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.flag-slower,.flag-check,.flag-failed{color:#c53030;font-weight:600} .flag-faster{color:#2f855a}
.summary li{margin:2px 0} a{color:#2b6cb0}
"""
W, H = 720, 200
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 14, 40
RED, GREEN, BLUE, BAND = "#e53e3e", "#38a169", "#2b6cb0", "#bee3f8"


def _slug(suite: str, case: str) -> str:
    return "c-" + re.sub(r"[^a-z0-9]+", "-", f"{suite} {case}".lower()).strip("-")


def _fmt_ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x / 1000:.2f} s" if x >= 10_000 else f"{x:.4g} ms"


def _flag_class(flag: str) -> str:
    return {"slower": "flag-slower", "faster": "flag-faster", "check failed": "flag-check",
            "failed to run": "flag-failed"}.get(flag, "")


def _nice(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= x (a tick step)."""
    if not x > 0:
        return 1.0
    e = 10 ** math.floor(math.log10(x))
    return next(m * e for m in (1, 2, 2.5, 5, 10) if m * e >= x * (1 - 1e-9))


def plot_svg(pts: Sequence[Point], idx: int) -> str:
    """Ours' ms per point (p20-p80 whiskers), the noise band of each step, regressions marked."""
    timed = [(p, p.ms) for p in pts if p.ms is not None]  # each with its ms, so the type checker knows it is set
    high = max([p.p80_ms or ms for p, ms in timed]
               + [ms * (1 + (q.band or 0)) for (_, ms), (q, _) in zip(timed, timed[1:])], default=1.0) * 1.08
    step = _nice(high / 4)
    top = step * math.ceil(high / step)
    n = len(pts)
    x_of = {id(p): PAD_L + (W - PAD_L - PAD_R) * ((i + 0.5) / n) for i, p in enumerate(pts)}

    def y(v: float) -> float:
        return PAD_T + (H - PAD_T - PAD_B) * (1 - v / top)

    out = [f'<svg id="plot-{idx}" class="plot" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" font-family="system-ui, sans-serif" font-size="10">',
           f'<rect x="{PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" height="{H - PAD_T - PAD_B}" fill="#fff" '
           'stroke="#cbd5e0"/>']
    for k in range(round(top / step) + 1):  # y grid from 0: a plot that starts at zero shows a change at its true size
        v = step * k
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#edf2f7"/>'
                   f'<text x="{PAD_L - 4}" y="{y(v) + 3:.1f}" text-anchor="end" fill="#4a5568">{_fmt_ms(v)}</text>')
    prev: Point | None = None
    prev_ms = 0.0  # prev's ms: prev is only ever a timed point
    for p in pts:
        if p.ms is None:
            continue
        if prev is not None and p.band is not None:  # the band the step is judged against, around the previous point
            lo, hi = prev_ms / (1 + p.band), prev_ms * (1 + p.band)
            x0, x1 = x_of[id(prev)], x_of[id(p)]
            out.append(f'<rect class="band" x="{x0:.1f}" y="{y(hi):.1f}" width="{x1 - x0:.1f}" '
                       f'height="{y(lo) - y(hi):.1f}" fill="{BAND}" opacity="0.5"><title>noise band '
                       f'±{100 * p.band:.1f}%</title></rect>')
        if prev is not None:
            out.append(f'<line x1="{x_of[id(prev)]:.1f}" y1="{y(prev_ms):.1f}" x2="{x_of[id(p)]:.1f}" '
                       f'y2="{y(p.ms):.1f}" stroke="{BLUE}" stroke-width="1.5"/>')
        prev, prev_ms = p, p.ms
    for p in pts:
        x = x_of[id(p)]
        label = escape((p.git or "—")[:7])
        out.append(f'<text x="{x:.1f}" y="{H - PAD_B + 13}" text-anchor="middle" fill="#4a5568">{label}</text>'
                   f'<text x="{x:.1f}" y="{H - PAD_B + 25}" text-anchor="middle" fill="#718096">'
                   f'{escape(p.time[:10])}</text>')
        if p.ms is None:
            out.append(f'<text class="point failed" x="{x:.1f}" y="{y(top * 0.5):.1f}" text-anchor="middle" '
                       f'fill="{RED}">failed<title>{escape(p.source)}: ours did not run</title></text>')
            continue
        if p.p20_ms is not None and p.p80_ms is not None and p.p80_ms > p.p20_ms:
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y(p.p20_ms):.1f}" y2="{y(p.p80_ms):.1f}" '
                       f'stroke="{BLUE}" stroke-width="1"/>')
        regressed, faster = p.flag in REGRESSED, p.flag == "faster"
        cls = "point regressed" if regressed else "point faster" if faster else "point"
        color = RED if regressed else GREEN if faster else BLUE
        change = f", {100 * (p.change - 1):+.1f}% vs previous" if p.change is not None else ""
        out.append(f'<circle class="{cls}" cx="{x:.1f}" cy="{y(p.ms):.1f}" r="{6 if regressed else 4}" '
                   f'fill="{color}"><title>{escape(p.source)}: {_fmt_ms(p.ms)}{change}'
                   f'{" (" + p.flag + ")" if p.flag else ""}</title></circle>')
        if regressed and p.change is not None:
            out.append(f'<text x="{x:.1f}" y="{y(p.ms) - 9:.1f}" text-anchor="middle" fill="{RED}" '
                       f'font-weight="600">{100 * (p.change - 1):+.0f}%</text>')
    out.append("</svg>")
    return "".join(out)


def _ratios(p: Point) -> str:
    parts = []
    for name, v in p.ratio.items():
        iv = p.ratio_interval.get(name)
        parts.append(f"{v:.2f}x {name}" + (f" ({iv[0]:.2f}-{iv[1]:.2f})" if iv else ""))
    parts += [f"— {name}" for name in p.ratio_null]
    return escape("; ".join(parts) or "—")


def _points_table(pts: Sequence[Point]) -> str:
    rows = []
    for p in reversed(pts):  # newest first
        frac = "—" if p.fraction is None else f"{100 * p.fraction:.0f}% {p.bound or ''}"
        spread = "" if p.p20_ms is None or p.p80_ms is None else f" ({p.p20_ms:.4g}-{p.p80_ms:.4g})"
        flag = p.flag + (f" {100 * (p.change - 1):+.1f}% (band ±{100 * p.band:.1f}%)"
                         if p.change is not None and p.band is not None else "")
        rows.append(f"<tr><td>{escape(p.time[:16].replace('T', ' '))}</td><td>{escape((p.git or '—')[:7])}</td>"
                    f"<td>{escape(p.source)}</td><td class=\"num\">{_fmt_ms(p.ms)}{escape(spread)}"
                    f"{' noisy' if p.noisy else ''}</td><td>{_ratios(p)}</td><td>{escape(frac)}</td>"
                    f"<td>{'ok' if p.ok else 'FAIL'}</td><td class=\"{_flag_class(p.flag)}\">{escape(flag)}</td></tr>")
    return ("<table><tr><th>time (UTC)</th><th>commit</th><th>source</th><th>ours</th><th>vs peers</th>"
            "<th>roofline</th><th>check</th><th>vs previous</th></tr>" + "".join(rows) + "</table>")


def render_dashboard(items: Sequence[Sourced], *, title: str = "warpforge results", sources: Sequence[str] = (),
                     generated: str = "") -> str:
    """The whole page for every case in ``items``; see the module docstring."""
    keys = sorted(cases_of(items))
    by_suite: dict[str, list[tuple[str, list[Point]]]] = {}
    for suite, case in keys:
        by_suite.setdefault(suite, []).append((case, history(items, case, suite)))
    regressed = [(s, c, pts[-1]) for s, cs in by_suite.items() for c, pts in cs if pts and pts[-1].flag in REGRESSED]
    n_points = sum(len(pts) for cs in by_suite.values() for _, pts in cs)
    body, idx = [], 0
    for suite, cases in by_suite.items():
        body.append(f'<h2 id="suite-{escape(suite)}">{escape(suite)}</h2>')
        for case, pts in cases:
            bad = bool(pts) and pts[-1].flag in REGRESSED
            body.append(f'<section class="case{" regressed" if bad else ""}" id="{_slug(suite, case)}">'
                        f'<h3>{escape(case)}</h3>{plot_svg(pts, idx)}{_points_table(pts)}</section>')
            idx += 1
    if regressed:
        items_html = "".join(f'<li><a href="#{_slug(s, c)}">{escape(s)}: {escape(c)}</a> — {escape(p.flag)}'
                             + (f" {100 * (p.change - 1):+.1f}% (band ±{100 * p.band:.1f}%)"
                                if p.change is not None and p.band is not None else "") + "</li>"
                             for s, c, p in regressed)
        summary = f'<p id="regressions">Latest point regressed beyond its noise band in {len(regressed)} case(s):</p>' \
                  f'<ul class="summary">{items_html}</ul>'
    else:
        summary = '<p id="regressions">No case\'s latest point regressed beyond its noise band.</p>'
    src = "; ".join(sources) or "records given"
    when = ", " + generated if generated else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body><main>
<h1>{escape(title)}</h1>
<div class="sub">{len(keys)} cases, {n_points} records from {escape(src)}{escape(when)}.
Each plot: ours' median time per record, oldest to newest (whisker: p20-p80; shaded: the noise band a step is judged
against); red: slower beyond the band, failed its check or failed to run; green: faster beyond it. Ratios: peer ms /
ours ms on the same work (above 1: warpforge faster).</div>
{summary}
{"".join(body)}
</main></body></html>
"""


def case_count(html: str) -> int:
    return html.count('<section class="case')


__all__ = ["case_count", "plot_svg", "render_dashboard"]
