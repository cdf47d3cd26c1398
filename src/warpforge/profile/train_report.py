"""The training view of the HTML report, rendered from the training profile's JSON dict (its twin).

Self-contained like the inference report (styles inline, charts inline SVG, no script): verdict and
headline figures, findings, a stacked timeline of the measured steps, the per-phase table, the ranks
side by side, the memory at each phase, the layers, notes.
"""

from __future__ import annotations

from html import escape
from typing import Any

from warpforge.profile.report import CSS, _findings
from warpforge.profile.svg import FONT

PART_LABELS = {"data": "waiting for data", "h2d": "host-to-device copies", "forward": "forward",
               "backward": "backward (compute)", "optimizer": "optimizer", "comm_exposed": "communication, exposed",
               "other": "other (gaps, host, sync)"}
PART_COLORS = {"data": "#e53e3e", "h2d": "#38b2ac", "forward": "#2b6cb0", "backward": "#dd6b20",
               "optimizer": "#2f855a", "comm_exposed": "#805ad5", "other": "#cbd5e0"}
MEM_COLORS = {"parameters": "#2b6cb0", "gradients": "#dd6b20", "optimizer_state": "#2f855a", "activations": "#e53e3e"}


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.3g} ms" if v < 1000 else f"{v / 1000:.3g} s"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _mib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**20:,.3g} MiB"


def _legend(items: dict[str, str], labels: dict[str, str], x: int, y: int) -> str:
    out, cx = [], x
    for k, c in items.items():
        label = labels.get(k, k)
        out.append(f'<rect x="{cx}" y="{y - 9}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{cx + 14}" y="{y}">{escape(label)}</text>')
        cx += 24 + 6.5 * len(label)
    return "".join(out)


def stacked_bars_svg(rows: list[tuple[str, dict[str, float]]], colors: dict[str, str], labels: dict[str, str],
                     unit: str, svg_id: str, width: int = 1000) -> str:
    """Horizontal stacked bars, one per row (a step, a rank, a phase), segments in ``colors`` order."""
    bar, gap, left, top = 18, 6, 110, 30
    height = top + len(rows) * (bar + gap) + 30
    scale_max = max((sum(v.get(k, 0.0) for k in colors) for _l, v in rows), default=0.0) or 1.0
    span = width - left - 90
    s = [f'<svg id="{svg_id}" class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
         f'xmlns="http://www.w3.org/2000/svg" {FONT} font-size="12" role="img">',
         _legend(colors, labels, 10, 16)]
    for i, (label, v) in enumerate(rows):
        y = top + i * (bar + gap)
        s.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{escape(label)}</text>')
        x = float(left)
        for k, c in colors.items():
            w = span * v.get(k, 0.0) / scale_max
            if w <= 0:
                continue
            tip = escape(f"{label}: {labels.get(k, k)} {v[k]:.4g} {unit}")
            s.append(f'<rect class="seg" data-part="{k}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" '
                     f'fill="{c}"><title>{tip}</title></rect>')
            x += w
        total = sum(v.get(k, 0.0) for k in colors)
        s.append(f'<text x="{x + 5:.1f}" y="{y + 13}">{total:.4g} {escape(unit)}</text>')
    s.append("</svg>")
    return "".join(s)


def _figs(d: dict[str, Any]) -> str:
    a, t = d["aggregate"], d["timing"]
    figs = [("step (median, instrumented)", _ms(a["median_step_ms"])),
            ("step without the profiler", _ms(t["plain_ms"])),
            # Instrumented steps faster than plain ones: the cost is below the run-to-run noise, no figure.
            ("profiler overhead", "below noise" if (t["overhead"] or 0) < 0 else _pct(t["overhead"])),
            ("parts vs step", f'{100 * a["parts_error"]:.2f}% apart'),
            ("GFLOP per step", f'{d["flops_per_step"] / 1e9:.3g}')]
    h2d = d.get("h2d") or {}
    if h2d.get("bytes") and a["mean"]["h2d"] > 0:
        figs.append((f'host-to-device ({"pinned" if h2d.get("pinned") else "pageable"})',
                     f'{h2d["bytes"] / (a["mean"]["h2d"] / 1e3) / 1e9:.3g} GB/s'))
    if d.get("bytes_per_step"):
        figs.append(("MiB moved per step (operators' reads and writes)", f'{d["bytes_per_step"] / 2**20:.4g}'))
    if d.get("mfu") is not None:
        figs.append(("MFU of the step", _pct(d["mfu"])))
    rl = d.get("roofline")
    if rl:
        figs.append(("roofline", f'{rl["bound"]}-bound, {_pct(rl["fraction"])} of its floor (MBU {_pct(rl["mbu"])})'))
    mem = d.get("memory") or {}
    figs.append((f'peak memory ({mem.get("peak_phase", "—")})', _mib(mem.get("peak_bytes"))))
    if d.get("ranks"):
        figs.append(("ranks", str(len(d["ranks"]))))
    return '<div class="figs">' + "".join(f'<div class="fig"><b>{escape(v)}</b><span>{escape(k)}</span></div>'
                                          for k, v in figs) + "</div>"


def _phase_table(d: dict[str, Any]) -> str:
    a = d["aggregate"]
    rows = "".join(f'<tr><td class="l"><span class="share" style="width:10px;background:{PART_COLORS[k]}"></span>'
                   f'{escape(PART_LABELS[k])}</td><td>{_ms(a["mean"][k])}</td><td>{_pct(a["share"][k])}</td></tr>'
                   for k in PART_LABELS)
    rows += (f'<tr><td class="l">communication, overlapped (beside compute, not in the sum)</td>'
             f'<td>{_ms(a["mean"]["comm_overlapped"])}</td><td>{_pct(a["share"]["comm_overlapped"])}</td></tr>'
             f'<tr><td class="l"><b>step</b> (sum of parts {_ms(a["parts_sum_ms"])})</td>'
             f'<td><b>{_ms(a["mean"]["step_ms"])}</b></td><td>100%</td></tr>')
    return ('<table id="phases"><thead><tr><th class="l">part</th><th>mean per step</th><th>share</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>")


def _ranks(d: dict[str, Any]) -> str:
    ranks = d.get("ranks")
    if not ranks:
        return '<p class="sub" id="no-ranks">one process: no per-rank comparison.</p>'
    bars = stacked_bars_svg([(f'rank {r["meta"]["rank"]}', r["aggregate"]["mean"]) for r in ranks], PART_COLORS,
                            PART_LABELS, "ms", "ranks-chart")
    head = "".join(f"<th>{escape(PART_LABELS[k])}</th>" for k in PART_LABELS)
    body = "".join(f'<tr><td class="l">{r["meta"]["rank"]}</td><td>{_ms(r["aggregate"]["mean"]["step_ms"])}</td>'
                   + "".join(f'<td>{_ms(r["aggregate"]["mean"][k])}</td>' for k in PART_LABELS) + "</tr>"
                   for r in ranks)
    return (bars + f'<table id="ranks"><thead><tr><th class="l">rank</th><th>step</th>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def _memory(d: dict[str, Any]) -> str:
    mem = d.get("memory") or {}
    if not mem.get("phases"):
        return '<p class="sub">no memory figures.</p>'
    rows = [(k, {c: v / 2**20 for c, v in parts.items()}) for k, parts in mem["phases"].items()]
    labels = {k: k.replace("_", " ") for k in MEM_COLORS}
    extra = (f' Measured peak: {_mib(mem["measured_peak_bytes"])}.' if mem.get("measured_peak_bytes") else "")
    return (stacked_bars_svg(rows, MEM_COLORS, labels, "MiB", "memory-chart")
            + f'<p class="sub">Peak {_mib(mem["peak_bytes"])} in {escape(mem["peak_phase"])}; '
              f'{escape(mem.get("source", ""))}.{escape(extra)}</p>')


def _layers(d: dict[str, Any]) -> str:
    rows = d.get("layers") or []
    if not rows:
        return '<p class="sub">no layers with parameters were timed (the setup gave no model).</p>'
    body = "".join(f'<tr><td class="l">{escape(r["layer"])} <span class="sub">{escape(r["type"])}</span></td>'
                   f'<td>{r["calls"]}</td><td>{_ms(r["forward_ms"])}</td><td>{r["flops"] / 1e9:.3g}</td>'
                   f'<td>{r["flops"] / (r["forward_ms"] / 1e3) / 1e9 if r["forward_ms"] else 0:.3g}</td>'
                   f'<td>{_pct(r.get("mfu"))}</td></tr>' for r in rows[:30])
    return ('<table id="layers"><thead><tr><th class="l">layer</th><th>calls</th><th>forward</th><th>GFLOP</th>'
            f"<th>GFLOP/s</th><th>MFU</th></tr></thead><tbody>{body}</tbody></table>")


def verdict(d: dict[str, Any]) -> str:
    top = [f for f in d.get("findings", []) if f["severity"] >= 0.1]
    if top:
        return top[0]["text"]
    a = d["aggregate"]["share"]
    biggest = max(("forward", "backward", "optimizer"), key=lambda k: a[k])
    return (f"No bottleneck above 10% of the step: compute dominates ({biggest} is the largest part, "
            f"{100 * a[biggest]:.0f}%).")


def render_train_html(d: dict[str, Any]) -> str:
    """The training report for one (possibly merged) training profile dict."""
    m = d["meta"]
    title = f"warpforge profile --train — {d['target']}"
    sub = (f'{m["device"]} · torch {m["torch"]} · {m["time"]} · {m["steps"]} instrumented steps after '
           f'{m["warmup"]} warm-up · {m["clock"]}' + (f' · {m["world"]} ranks' if m["world"] > 1 else ""))
    steps = stacked_bars_svg([(f"step {i + 1}", s) for i, s in enumerate(d["steps"])], PART_COLORS, PART_LABELS,
                             "ms", "steps-chart")
    notes = "".join(f"<li>{escape(n)}</li>" for n in d.get("notes", []))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body><main>
<h1>{escape(title)}</h1><div class="sub">{escape(sub)}</div>
<div class="verdict" id="verdict">{escape(d.get("verdict") or verdict(d))}</div>
{_figs(d)}
<h2>Findings</h2>{_findings(d)}
<h2>Steps</h2>{steps}
<h2>Where a step's time goes</h2>{_phase_table(d)}
<h2>Ranks</h2>{_ranks(d)}
<h2>Memory at each phase</h2>{_memory(d)}
<h2>Layers (forward)</h2>{_layers(d)}
<h2>Notes</h2><ul class="notes">{notes}</ul>
<p class="sub">warpforge profile --train · schema {escape(d.get("schema", ""))} · machine-readable: report.json</p>
</main></body></html>
"""
