"""The self-contained HTML report, rendered from the profile's JSON dict (so JSON and HTML never disagree).

No network: styles inline, charts inline SVG, no script at all. Sections: verdict and headline
figures, the roofline, findings with their evidence, fraction of the roof per operator, the time
split and one iteration's timeline, modules, top operators, top kernels, notes.
"""

from __future__ import annotations

from html import escape
from typing import Any

from warpforge._html import page_css
from warpforge.profile import svg

TOP = 25

CSS = page_css(h2_top=30, figs_margin=8, fig_min_width=100) + """
.verdict{background:#fff;border:1px solid #e2e8f0;border-left:6px solid #2b6cb0;padding:12px 16px;margin:16px 0;
  font-size:19px;font-weight:600}
.finding{background:#fff;border:1px solid #e2e8f0;border-radius:6px;padding:9px 12px;margin:7px 0}
.finding .sev{display:inline-block;width:60px;font-weight:700;color:#c53030}
.finding .adv{color:#2d3748;font-size:13px;margin-top:3px}
.finding details{font-size:12px;color:#4a5568;margin-top:3px}
table{border-collapse:collapse;width:100%;background:#fff;font-size:12.5px}
th,td{border-bottom:1px solid #edf2f7;padding:4px 6px;text-align:right;white-space:nowrap}
th{background:#edf2f7;position:sticky;top:0} td.l,th.l{text-align:left;white-space:normal}
td.w{text-align:left;white-space:normal;max-width:260px;word-break:break-all;font-size:11.5px;color:#4a5568}
.share{display:inline-block;height:9px;background:#2b6cb0;vertical-align:middle;margin-right:4px}
.memory{color:#2b6cb0;font-weight:600} .compute{color:#dd6b20;font-weight:600}
.note{background:#fffaf0;border:1px solid #feebc8;padding:8px 12px;border-radius:6px;font-size:13px}
.chart{max-width:100%;height:auto;background:#fff;border:1px solid #e2e8f0;border-radius:6px}
ul.notes li{font-size:13px;margin:3px 0} code{font-size:12px}
"""


def _f(v: float | None, fmt: str = "{:.1f}", none: str = "—") -> str:
    return none if v is None else fmt.format(v)


def _us(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f} µs"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%" if abs(v) >= 0.01 else f"{100 * v:.1f}%"


def _rate(r: dict[str, Any]) -> tuple[str, str]:
    tf = r.get("tflops")
    gb = r.get("GBps")
    return (_f(tf, "{:.2f}") if tf is not None and tf >= 0.01 else _f(tf, "{:.2g}"),
            _f(gb, "{:,.0f}") if gb is not None and gb >= 10 else _f(gb, "{:.2g}"))


def _figs(d: dict[str, Any]) -> str:
    t, s = d["timing"], d["split"]
    model = d["totals"].get("model", {})
    figs = [("per iteration", f'{t["window_ms"]:.3f} ms' if t["window_ms"] < 100 else f'{t["window_ms"]:.1f} ms')]
    if t.get("overhead") is not None or t.get("overhead_note"):
        # A profiled window faster than the plain ones means the run-to-run noise exceeds the cost: no figure.
        figs.append(("profiler overhead", _pct(t["overhead"]) if t.get("overhead") is not None else "below noise"))
        if t.get("window") == "light":  # the overhead and the device times are the CUDA-only window's
            figs.append(("timed window", "CUDA activity alone"))
        for half, v in (t.get("overhead_parts") or {}).items():
            if v is not None:
                figs.append((f"{half.upper()} half of it alone", _pct(v)))
    if s.get("busy_us") is not None:
        figs.append(("GPU busy", _pct(s["busy_us"] / s["window_us"] if s["window_us"] else None)))
        figs.append(("kernels / iteration", f'{s["kernels"]:,.0f}'))
    if model.get("tflops") is not None:
        tf = model["tflops"]
        figs.append(("model TFLOP/s", f"{tf:.2f}") if tf >= 1 else ("model GFLOP/s", f"{tf * 1e3:.3g}"))
    if model.get("fraction") is not None:
        figs.append((f'of the {model.get("bound")} roof', _pct(model["fraction"])))
    dec = d.get("declared") or {}
    if dec.get("device_GBps") is not None:
        figs.append(("declared bytes / device time", f'{dec["device_GBps"]:,.0f} GB/s'))
    if dec.get("flops") and dec.get("device_TFLOPs") is not None:
        figs.append(("declared FLOPs / device time", f'{dec["device_TFLOPs"]:.1f} TFLOP/s'))
    figs.append(("GFLOP / iteration", f'{d["counts"]["flops"] / 1e9:.3g}'))
    figs.append(("MB moved / iteration", f'{d["counts"]["bytes"] / 1e6:.3g}'))
    return '<div class="figs">' + "".join(f'<div class="fig"><b>{escape(v)}</b><span>{escape(k)}</span></div>'
                                          for k, v in figs) + "</div>"


def _findings(d: dict[str, Any]) -> str:
    out = []
    for f in d["findings"]:
        sev = f"{100 * f['severity']:.0f}%" if f["severity"] > 0 else "info"
        ev = "".join(f"<div><code>{escape(str(k))}</code>: {escape(_short(v))}</div>" for k, v in f["evidence"].items())
        out.append(f'<div class="finding" data-kind="{escape(f["kind"])}"><span class="sev">{sev}</span>'
                   f'{escape(f["text"])}' + (f'<div class="adv">→ {escape(f["advice"])}</div>' if f["advice"] else "")
                   + (f"<details><summary>evidence</summary>{ev}</details>" if ev else "") + "</div>")
    return "".join(out) or '<p class="sub">no findings</p>'


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return s if len(s) < 400 else s[:400] + "…"


def _points(d: dict[str, Any]) -> list[dict[str, Any]]:
    pts = []
    for r in d["ops"][:200]:
        if r.get("flops") and r.get("tflops"):
            mod = r.get("module") or "(root)"
            mod = mod if len(mod) <= 22 else "…" + mod[-21:]
            pts.append({**r, "marker": "op", "label": f'{mod} · {r["op"].split("::")[-1]}'})
    for r in d["kernels"][:200]:
        if r.get("flops") and r.get("tflops"):
            pts.append({**r, "marker": "kernel"})
    m = d["totals"].get("model") or {}
    if m.get("flops") and m.get("tflops"):
        pts.append({**m, "marker": "model", "share": 0.0})
    return pts


def _roofline(d: dict[str, Any]) -> str:
    c = d.get("ceilings")
    if not c:
        why = ("CPU run: the roofline needs GPU ceilings, so it is omitted; rows show host time."
               if d["device_type"] != "cuda" else "no ceilings were available: roofline omitted.")
        return f'<p class="note" id="no-roofline">{escape(why)}</p>'
    pts = _points(d)
    roofs = sorted({p.get("ceiling") for p in pts if p.get("ceiling")} | {"fp32"},
                   key=lambda k: c["tflops"].get(k, 0))
    return (svg.roofline_svg(pts, c, roofs)
            + f'<p class="sub">ceilings: {escape(c.get("source", ""))}. Circles: operators (area ∝ share of GPU time); '
              f'squares: kernels that carry their operator\'s work; triangle: the whole model over the window.</p>'
)


def _fractions(d: dict[str, Any]) -> str:
    if not d.get("ceilings") or not any(r.get("fraction") is not None for r in d["ops"][:TOP]):
        return ""
    return "<h2>Fraction of the roof, top operators</h2>" + svg.fraction_bars_svg(d["ops"][:TOP])


def _timeline(d: dict[str, Any]) -> str:
    s = d["split"]
    if s.get("busy_us") is None:
        parts = [("in operators", s.get("ops_us") or 0.0, "memory"),
                 ("outside operators (Python, dispatch)", s.get("overhead_us") or 0.0, "outside")]
        return svg.split_svg(parts) + f'<p class="sub">{_us(s["window_us"])} per iteration on the host clock.</p>'
    parts = [("compute", s["compute_us"], "compute"), ("copies", s["memory_us"], "copies"),
             ("communication", s["comm_us"], "comm"), ("idle: host-bound", s["idle_host_us"], "idle-host"),
             ("idle: launch gaps", s["idle_launch_us"], "idle-launch")]
    txt = (f'{_us(s["window_us"])} per iteration: busy {_us(s["busy_us"])}, idle {_us(s["idle_us"])} '
           f'(host-bound {_us(s["idle_host_us"])}, launch gaps {_us(s["idle_launch_us"])}); overlap '
           f'{_us(s["overlap_us"])}. {s["kernels"]:,.0f} kernels per iteration')
    if s.get("short_threshold_us") is not None:
        txt += (f', {s["short_kernels"]:,.0f} shorter than the {s["short_threshold_us"]:.1f} µs launch cost '
                f'({_us(s["short_kernel_us"])} of kernels + {_us(s["short_gap_us"])} of gaps before them)')
    strip = svg.strip_svg(s.get("strip") or [])
    return (svg.split_svg(parts) + f'<p class="sub">{escape(txt)}.</p>'
            + (f"<h3 style=\"font-size:14px\">One iteration, device side</h3>{strip}" if strip else ""))


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str, Any]], table_id: str, wrap_last: bool = False) -> str:
    def cls(j: int) -> str:
        return "l" if j == 1 else "w" if wrap_last and j == len(cols) - 1 else ""

    head = "".join(f'<th class="{cls(i)}">{escape(h)}</th>' for i, (h, _k, _fn) in enumerate(cols))
    body = []
    for i, r in enumerate(rows):
        cells = []
        for j, (_h, k, fn) in enumerate(cols):
            v = fn(r, i) if callable(fn) else escape(str(r.get(k, "")))
            cells.append(f'<td class="{cls(j)}">{v}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _bound(r: dict[str, Any], _i: int) -> str:
    b = r.get("bound")
    return f'<span class="{b}">{escape(b)}</span>' if b else "—"


def _share(r: dict[str, Any], _i: int) -> str:
    return f'<span class="share" style="width:{max(1, int(60 * r["share"]))}px"></span>{_pct(r["share"])}'


def _op_table(d: dict[str, Any]) -> str:
    cols = [("#", "", lambda r, i: str(i + 1)),
            ("operator (module / op)", "",
             lambda r, i: escape(r["name"]) + (" <i>(graph)</i>" if r.get("graph") else "")),
            ("kind", "kind", None), ("calls", "", lambda r, i: _f(r["calls"], "{:g}")),
            ("time / iter", "", lambda r, i: _us(r["time_us"])), ("share", "", _share),
            ("GFLOP", "", lambda r, i: _f(r["flops"] / 1e9 if r.get("flops") is not None else None, "{:.3g}")),
            ("MB", "", lambda r, i: _f(r["bytes"] / 1e6 if r.get("bytes") is not None else None, "{:.3g}")),
            ("FLOP/B", "", lambda r, i: _f(r.get("intensity"), "{:.3g}")),
            ("TFLOP/s", "", lambda r, i: _rate(r)[0]), ("GB/s", "", lambda r, i: _rate(r)[1]),
            ("of roof", "", lambda r, i: _pct(r.get("fraction"))), ("bound", "", _bound)]
    if d["device_type"] == "cuda":
        cols.append(("kernels", "", lambda r, i: escape(", ".join(r.get("launched") or [])[:120])))
    else:
        cols = [c for c in cols if c[0] not in ("of roof", "bound")]
    return _table(d["ops"][:TOP], cols, "ops", wrap_last=d["device_type"] == "cuda")


def _kernel_table(d: dict[str, Any]) -> str:
    if not d["kernels"]:
        return ""
    cols = [("#", "", lambda r, i: str(i + 1)),
            ("kernel", "", lambda r, i: f'<span title="{escape(r["op"])}">{escape(r["name"])}</span>'
             + (" <i>(graph)</i>" if r.get("graph") else "")),
            ("calls", "", lambda r, i: _f(r["calls"], "{:g}")), ("time / iter", "", lambda r, i: _us(r["time_us"])),
            ("mean", "", lambda r, i: _us(r["time_us"] / r["calls"] if r["calls"] else None)), ("share", "", _share),
            ("TFLOP/s", "", lambda r, i: _rate(r)[0]), ("GB/s", "", lambda r, i: _rate(r)[1]),
            ("of roof", "", lambda r, i: _pct(r.get("fraction"))), ("bound", "", _bound),
            ("launched by", "", lambda r, i: escape("; ".join(r.get("launched") or [])[:120]))]
    return "<h2>Top kernels</h2>" + _table(d["kernels"][:TOP], cols, "kernels", wrap_last=True)


def _modules(d: dict[str, Any]) -> str:
    mods = [m for m in d.get("modules", []) if m["depth"] <= 2][:40]
    if not mods:
        return ""
    cuda = d["device_type"] == "cuda"
    cols = [("depth", "depth", None),
            ("module", "",
             lambda r, i: escape(r["module"] or "(root)") + f' <span class="sub">{escape(r["type"])}</span>'),
            ("calls", "", lambda r, i: _f(r["calls"], "{:g}")),
            ("span / iter" + (" (CUDA events)" if cuda else " (host)"), "", lambda r, i: _us(r["span_us"])),
            ("operator time", "", lambda r, i: _us(r["op_time_us"])),
            ("busy in span", "", lambda r, i: _pct(r.get("busy_share"))),
            ("GFLOP", "", lambda r, i: _f(r["flops"] / 1e9, "{:.3g}"))]
    return "<h2>Modules</h2>" + _table(mods, cols, "modules")


def render_html(d: dict[str, Any]) -> str:
    """The report for one profile dict (``Profile.as_dict()`` or a loaded report.json)."""
    m = d["meta"]
    title = f"warpforge profile — {d['target']}"
    sub = (f'{m["device"]} · torch {m["torch"]} · {m["time"]} · {m["iters"]} measured iterations after '
           f'{m["warmup"]} warm-up · {"inference_mode" if not m.get("grad") else "autograd on"}')
    notes = "".join(f"<li>{escape(n)}</li>" for n in [*d.get("notes", []), d["timing"].get("overhead_note")] if n)
    if d.get("trace_file"):
        notes += (f'<li>Kineto trace: <code>{escape(d["trace_file"])}</code> (open in ui.perfetto.dev or '
                  "chrome://tracing; module ranges are named module:&lt;path&gt;)</li>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body><main>
<h1>{escape(title)}</h1><div class="sub">{escape(sub)}</div>
<div class="verdict" id="verdict">{escape(d["verdict"])}</div>
{_figs(d)}
<h2>Roofline</h2>{_roofline(d)}
<h2>Findings</h2>{_findings(d)}
{_fractions(d)}
<h2>Where the time goes</h2>{_timeline(d)}
{_modules(d)}
<h2>Top operators</h2>{_op_table(d)}
{_kernel_table(d)}
<h2>Notes</h2><ul class="notes">{notes}</ul>
<p class="sub">warpforge profile · schema {d.get("schema")} · machine-readable: report.json</p>
</main></body></html>
"""
