"""The optimizer's report: one JSON-able dict, and a self-contained HTML page of the same.

Keys: ``status`` ("ok", "no_candidate", "bad_input"), ``winner`` and ``why``, ``model`` (class, params,
input shapes, kind), ``settings`` (device, protocol, budgets), ``environment`` (versions, device name),
``candidates`` (one row each: status passed/rejected/failed/skipped and the reason, build time, accuracy,
single-stream latency p50/p90/p99, offline throughput, speedup against eager-fp32 and against the fastest
torch.compile candidate, peak memory, details), ``fallbacks`` (what each candidate could not do and why),
and for the winner ``layers`` (per-layer compute precision), ``coverage`` (operators run by warpforge
kernels vs torch), ``capture`` (how its graph was captured: torch.export or torch.fx.symbolic_trace, why
export was not used, the modules left eager, the exported program's ATen operators and which stayed plain
ATen calls) and ``passes`` (what each pass changed); ``regions`` (when the whole model did not capture and its
submodules were optimized as regions: each region, each part left eager and why; optimize/regions.py);
``quant`` (when the int8 candidate was built:
each layer's decision, int8 or kept float and why, its observer, scale and calibration error); ``fp8`` (the
same for a warpforge-fp8 candidate: e4m3 or kept float and why, static or per-row input scales) and
``weight_only`` (a warpforge-w8 / -w4 candidate: each layer's scheme, weight error and bytes, or kept float
and why), from the winner when it has one, else the first such candidate built. Only
measured figures appear: a figure that was not measured is null, never zero.
"""

from __future__ import annotations

import html
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from warpforge.optimize.logs import clean, first_line, log_path


def environment(device: str) -> dict[str, Any]:
    import warpforge

    env = {"warpforge": warpforge.__version__, "torch": torch.__version__, "python": platform.python_version(),
           "device": device, "device_name": platform.processor() or platform.machine()}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def _range(r: list[float] | None) -> str:
    """A speedup's range across timing rounds, for the sentence; empty with one round."""
    return f" ({r[0]:.2f}-{r[1]:.2f} across rounds)" if r else ""


def _why(records: list[dict[str, Any]], winner: str | None, status: str, error: str | None) -> str:
    if status == "bad_input":
        return f"bad input: {error}"
    if winner is None:
        tried = [r for r in records if r["status"] in ("rejected", "failed", "passed")]
        parts = [f"{r['name']} {r['status']} ({first_line(str(r.get('reason', '')))})" for r in tried]
        if any(r["status"] == "passed" for r in tried):
            parts.append("a passing candidate that was not asked for (the eager-fp32 baseline) is not chosen")
        return "no candidate met the accuracy budget: " + "; ".join(parts) if parts else \
            "no candidate could be tried: " + "; ".join(f"{r['name']}: {first_line(str(r.get('reason')))}"
                                                        for r in records)
    w = next(r for r in records if r["name"] == winner)
    lat = w["latency"]
    text = f"{winner} is the fastest candidate within its {w['precision']} budget: p50 {lat['p50_ms']:.4g} ms"
    if w.get("speedup_vs_eager"):
        text += f", {w['speedup_vs_eager']:.2f}x eager-fp32" + _range(w.get("speedup_vs_eager_range"))
    if w.get("speedup_vs_compile"):
        text += (f", {w['speedup_vs_compile']:.2f}x the fastest torch.compile"
                 + _range(w.get("speedup_vs_compile_range")))
    if lat.get("noisy"):
        text += " (timings noisy: see the notes)"
    acc = w.get("accuracy", {})
    text += f"; max_rel {acc.get('max_rel', 0):.2g}, cosine {acc.get('min_cosine', 1):.6f}"
    if acc.get("top1") is not None:
        text += f", top-1 agreement {acc['top1']:.3f}"
    others = sum(1 for r in records if r["status"] == "passed" and r["name"] != winner)
    return text + f" ({others} other passing candidate(s) were slower)"


def make_report(model: dict[str, Any], settings: dict[str, Any], records: list[dict[str, Any]], winner: str | None,
                *, status: str, error: str | None = None, notes: list[str] | None = None,
                elapsed_s: float | None = None) -> dict[str, Any]:
    w = next((r for r in records if r["name"] == winner), None)
    details = (w or {}).get("details", {})
    # Coverage, capture and passes describe a warpforge pipeline: the winner's, else the first one built.
    graph_src = w if w is not None and "coverage" in details else next(
        (r for r in records if "coverage" in r.get("details", {})), None)
    graph = graph_src.get("details", {}) if graph_src else {}
    fallbacks = [{"candidate": r["name"], **f} for r in records for f in r.get("details", {}).get("fallbacks", [])]
    return {
        "status": status, "winner": winner, "why": _why(records, winner, status, error), "error": error,
        "model": model, "settings": settings, "environment": environment(settings.get("device", "cpu")),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "elapsed_s": elapsed_s, "notes": list(notes or []),
        "log": str(log_path()),  # third-party output (exporters' dumps) and failures' full text
        "candidates": records, "fallbacks": fallbacks,
        "layers": details.get("layers", []), "graph_of": graph_src["name"] if graph_src else None,
        "coverage": graph.get("coverage", {}), "capture": graph.get("capture", {}), "passes": graph.get("passes", []),
        "regions": graph.get("regions"),
        **{key: _section(records, w, key) for key in ("quant", "fp8", "weight_only")},
    }


def _section(records: list[dict[str, Any]], winner: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """A quantizing pass's report (``details[key]``) with its candidate's name: the winner's, else the first."""
    rows = ([winner] if winner is not None else []) + records
    r = next((r for r in rows if key in r.get("details", {})), None)
    return None if r is None else {"candidate": r["name"], **r["details"][key]}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, str):
        return clean(x)  # a tool's colour codes are noise in a file
    if isinstance(x, (int, float, bool)) or x is None:
        return x
    return clean(str(x))


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(_jsonable(report), indent=2)


# --- HTML --------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1200px;color:#1d2330;
padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde2ea;padding-bottom:4px}
.verdict{padding:12px 16px;border-radius:6px;margin:12px 0;background:#eef6ee;border:1px solid #b8dcb8}
.verdict.bad{background:#fbeeee;border-color:#e6b8b8}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:5px 8px;border-bottom:1px solid #e6e9ef;text-align:right;vertical-align:top}
th{background:#f4f6f9;font-weight:600}td.l,th.l{text-align:left}tr.win td{background:#f2f8f2;font-weight:600}
.s-passed{color:#1f7a1f}.s-rejected{color:#b35c00}.s-failed{color:#b00020}.s-skipped{color:#777}
.muted{color:#6b7280}tr.skipped td{font-weight:400}.footnotes{margin:4px 0;font-size:12px}
code{background:#f4f6f9;padding:1px 4px;border-radius:3px}
"""


def _f(v: Any, fmt: str = "{:.4g}") -> str:
    return "—" if v is None else fmt.format(v)


def _bytes(v: int | None) -> str:
    if v is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return str(v)


def _reason_html(reason: str) -> str:
    """A reason's first line; the whole of a longer one folded under it."""
    full, head = clean(reason), first_line(reason)
    if full == head:
        return f'<span class="muted">{html.escape(head)}</span>'
    return (f'<details class="muted"><summary>{html.escape(head)}</summary><pre style="white-space:pre-wrap">'
            f"{html.escape(full)}</pre></details>")


def _table(head: list[str], rows: list[list[str]], left: int = 1, row_class: list[str] | None = None) -> str:
    th = "".join(f'<th class="l">{h}</th>' if i < left else f"<th>{h}</th>" for i, h in enumerate(head))
    body = []
    for k, r in enumerate(rows):
        cls = f' class="{row_class[k]}"' if row_class and row_class[k] else ""
        body.append(f"<tr{cls}>" + "".join(f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>"
                                          for i, c in enumerate(r)) + "</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _latency_svg(report: dict[str, Any]) -> str:
    """Inline SVG: one bar per timed candidate to its p50, a whisker on to p99; the winner green.

    The axis is scaled to the p50s (the figure that picks the winner), not to the slowest p99: one
    noisy tail would otherwise squash every bar into a stub. A whisker past the axis ends in an arrow;
    the label gives both figures."""
    rows = [r for r in report.get("candidates", []) if r.get("latency")]
    if not rows:
        return ""
    top = 1.25 * max(r["latency"]["p50_ms"] for r in rows) or 1.0
    label_w, bar_w, h = 260, 560, 22
    end = label_w + bar_w
    out = [f'<svg width="{end + 170}" height="{h * len(rows) + 24}" '
           'font-family="system-ui,sans-serif" font-size="12">']
    for i, r in enumerate(rows):
        lat, y = r["latency"], 8 + i * h
        x50 = label_w + bar_w * min(lat["p50_ms"] / top, 1.0)
        x99 = label_w + bar_w * min(lat["p99_ms"] / top, 1.0)
        clipped = lat["p99_ms"] > top
        color = "#3c9a3c" if r["name"] == report.get("winner") else "#7a8aa6"
        mid = y + h / 2 - 1
        tip = (f'<path d="M{end:.1f},{mid - 4} L{end + 6:.1f},{mid} L{end:.1f},{mid + 4} z" fill="#333"/>' if clipped
               else f'<line x1="{x99:.1f}" x2="{x99:.1f}" y1="{y + 6}" y2="{y + h - 8}" stroke="#333"/>')
        out.append(f'<text x="{label_w - 8}" y="{y + 14}" text-anchor="end">{html.escape(r["name"])}</text>'
                   f'<rect class="p50" x="{label_w}" y="{y + 3}" width="{x50 - label_w:.1f}" height="{h - 8}" '
                   f'fill="{color}"/>'
                   f'<line x1="{x50:.1f}" x2="{x99:.1f}" y1="{mid}" y2="{mid}" stroke="#333"/>{tip}'
                   f'<text x="{max(x99, x50) + (14 if clipped else 6):.1f}" y="{y + 14}">{lat["p50_ms"]:.4g} ms '
                   f'(p99 {lat["p99_ms"]:.4g})</text>')
    out.append(f'<text x="{label_w}" y="{h * len(rows) + 20}" fill="#6b7280">bar: p50, whisker: to p99 (an arrow: '
               f"beyond the axis, which ends at 1.25x the slowest p50); lower is better</text></svg>")
    return "".join(out)


def _skipped_row(skipped: list[dict[str, Any]], columns: int) -> tuple[str, str]:
    """The skipped candidates as one table row (each name carries its reason on hover and a footnote
    number) and the footnotes, one per distinct reason."""
    e = html.escape
    reasons: list[str] = []
    for r in skipped:
        if str(r.get("reason", "")) not in reasons:
            reasons.append(str(r.get("reason", "")))
    names = ", ".join(f'<code title="{e(str(r.get("reason", "")), quote=True)}">{e(r["name"])}</code>'
                      f'<sup>{reasons.index(str(r.get("reason", ""))) + 1}</sup>' for r in skipped)
    row = (f'<tr class="skipped"><td class="l" colspan="{columns}"><span class="s-skipped">skipped '
           f"({len(skipped)})</span>: {names}</td></tr>")
    notes = "".join(f'<li>{e(reason)}</li>' for reason in reasons)
    return row, f'<ol class="muted footnotes">{notes}</ol>'


def _capture_html(cap: dict[str, Any], graph_of: Any) -> str:
    """How the pipeline graph was captured: the method, why export was not used, the modules left eager,
    and for an export the program's ATen operators with how many calls stayed plain ATen calls."""
    e = html.escape
    eager = cap.get("eager_modules", {})
    text = (f"<h2>Capture ({e(str(graph_of))})</h2><p><b>{e(str(cap.get('method')))}</b> (asked: "
            f"{e(str(cap.get('asked', 'auto')))}): {cap.get('traced_fraction', 0):.1%} of parameters in traced code; "
            f"{len(eager)} module(s) left eager.")
    if cap.get("export_error"):
        text += f" torch.export was not used: {e(cap['export_error'])}"
    text += "</p>"
    if eager:
        text += _table(["module", "why eager"], [[e(k), e(v)] for k, v in eager.items()], left=2)
    ops, kept = cap.get("aten_ops", {}), cap.get("aten_kept", {})
    if ops:
        n_kept = sum(kept.values())
        text += (f'<p class="muted">The exported program\'s {sum(ops.values())} operator calls: {n_kept} stayed plain '
                 "ATen calls (they run as exported; no pass rewrites them), the others became module calls or the "
                 "torch functions the passes match.</p>"
                 + _table(["ATen operator", "calls", "module call / torch form", "plain ATen call"],
                          [[f"<code>{e(k)}</code>", str(v), str(v - kept.get(k, 0)), str(kept.get(k, 0))]
                           for k, v in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))]))
    return text


def to_html(report: dict[str, Any]) -> str:
    """The report as one HTML page: inline CSS, no scripts, no external assets."""
    report = _jsonable(report)  # what report.json holds: no escape codes, non-finite figures as null
    e = html.escape
    m, env = report.get("model", {}), report.get("environment", {})
    rows, classes = [], []
    skipped = [r for r in report.get("candidates", []) if r["status"] == "skipped"]
    for r in report.get("candidates", []):
        if r["status"] == "skipped":  # one line for all of them, below
            continue
        lat, acc, thr = r.get("latency", {}), r.get("accuracy", {}), r.get("throughput", {})
        rows.append([f"<code>{e(r['name'])}</code>", r["precision"],
                     f'<span class="s-{r["status"]}">{r["status"]}</span>',
                     _f(lat.get("p50_ms")), _f(lat.get("p90_ms")), _f(lat.get("p99_ms")),
                     _f(thr.get("items_per_s"), "{:.1f}"), _f(r.get("speedup_vs_eager"), "{:.2f}x"),
                     _f(r.get("speedup_vs_compile"), "{:.2f}x"), _f(acc.get("max_rel"), "{:.2e}"),
                     _f(acc.get("min_cosine"), "{:.6f}"), _f(acc.get("top1"), "{:.3f}"),
                     _bytes(r.get("peak_memory_bytes")), _f(r.get("build_s"), "{:.2f}"),
                     _reason_html(str(r.get("reason", "")))])
        classes.append("win" if r["name"] == report.get("winner") else "")
    head = ["candidate", "precision", "status", "p50 ms", "p90 ms", "p99 ms", "items/s", "vs eager", "vs compile",
            "max rel", "cosine", "top-1", "peak mem", "build s", "reason"]
    inputs = ", ".join(str(i.get("shape", i.get("value"))) + " " + str(i.get("dtype", "")) for i in m.get("inputs", []))
    device = f'{e(str(env.get("device_name", "")))} ({e(str(env.get("device", "")))})'
    versions = f'torch {e(str(env.get("torch", "")))} · warpforge {e(str(env.get("warpforge", "")))}'
    status = report.get("status")
    parts = [f"<h1>warpforge optimize: {e(str(m.get('name', '')))}</h1>",
             f'<div class="muted">{e(str(m.get("class", "")))} · {m.get("params", 0):,} parameters · inputs '
             f'{e(inputs)} · kind {e(str(m.get("kind", "")))} · {device} · {versions} · '
             f'{e(str(report.get("time", "")))}</div>',
             f'<div class="verdict{"" if status == "ok" else " bad"}"><b>{e(str(status))}</b>: '
             f'{e(str(report.get("why", "")))}</div>']
    for n in report.get("notes", []):
        parts.append(f'<div class="muted">note: {e(n)}</div>')
    s = report.get("settings", {})
    table = _table(head, rows, left=1, row_class=classes)
    footnotes = ""
    if skipped:
        row, footnotes = _skipped_row(skipped, len(head))
        table = table.replace("</tbody></table>", row + "</tbody></table>")
    parts.append("<h2>Candidates</h2>" + table + footnotes
                 + f'<p class="muted">Single stream: {s.get("queries")} back-to-back queries after {s.get("warmup")} '
                   f'warm-up, each synchronized; offline: {s.get("offline_calls")} calls at the inputs\' batch. '
                   f'Validation: {e(str(s.get("val", "")))}. Speedups are p50 ratios (above 1: faster). '
                   'Peak memory is CUDA allocation above the level before the candidate was built (— on CPU).</p>')
    chart = _latency_svg(report)
    if chart:
        parts.append("<h2>Single-stream latency</h2>" + chart)
    budgets = s.get("budgets", {})
    if budgets:
        parts.append("<h2>Accuracy budgets</h2>" + _table(
            ["precision", "max abs", "max rel", "min cosine", "min top-1"],
            [[p, _f(b.get("max_abs")), _f(b.get("max_rel")), _f(b.get("min_cosine"), "{:.6f}"),
              _f(b.get("min_top1"))] for p, b in budgets.items()]))
    if report.get("fallbacks"):
        parts.append("<h2>Fallbacks</h2>" + _table(
            ["candidate", "what", "reason"],
            [[e(f["candidate"]), e(str(f.get("what", ""))), e(str(f.get("reason", "")))] for f in report["fallbacks"]],
            left=3))
    cov = report.get("coverage", {})
    if cov:
        ops = [[e(k), str(v), "warpforge kernel"] for k, v in cov.get("warpforge_ops", {}).items()]
        ops += [[e(k), str(v), "torch"] for k, v in cov.get("torch_ops", {}).items()]
        parts.append(f"<h2>Operator coverage ({e(str(report.get('graph_of')))})</h2>"
                     f"<p>{cov.get('warpforge_fraction', 0):.0%} of {cov.get('ops_total', 0)} graph operators "
                     "run through warpforge kernels.</p>"
                     + _table(["operator", "calls", "runs on"], ops, left=1))
    reg = report.get("regions")
    if reg:
        rows = [[e(r["path"]), '<span class="s-passed">optimized</span>', f'{r["params"]:,}',
                 e(f'{r["captured_by"]}, {r["calls"]} call(s)')] for r in reg["regions"]]
        rows += [[e(x["path"]), '<span class="s-skipped">eager</span>', f'{x["params"]:,}', e(x["reason"])]
                 for x in reg["eager"]]
        parts.append(f"<h2>Regions ({e(str(report.get('graph_of')))})</h2><p>The whole model did not capture; "
                     f"{len(reg['regions'])} region(s) hold {reg['optimized_fraction']:.1%} of the parameters and run "
                     "optimized, the rest runs as written (fp32).</p>"
                     + _table(["module", "runs", "params", "how / why eager"], rows, left=4))
    cap = report.get("capture", {})
    if cap:
        parts.append(_capture_html(cap, report.get("graph_of")))
    if report.get("passes"):
        parts.append(f"<h2>Passes ({e(str(report.get('graph_of')))})</h2>" + _table(
            ["pass", "changes"],
            [[e(p["name"]), e(", ".join(f"{k}: {v}" for k, v in p.get("counts", {}).items()) or "none")]
             for p in report["passes"]], left=2))
    q = report.get("quant")
    if q:
        rows = [[e(x["name"]), e(x["type"]), "int8" + (" unsigned" if x.get("unsigned") else "")
                 + (" &rarr; int8 out" if x.get("int8_out") else ""), e(x["observer"]), _f(x["act_scale"], "{:.4g}"),
                 _f(x["rel_err"], "{:.2e}"), ""] for x in q.get("layers", [])]
        rows += [[e(k["name"]), e(k["type"]), e(q.get("float_dtype", "float"))
                  + (" &larr; int8 in" if k.get("int8_in") else "") + (" &rarr; int8 out" if k.get("int8_out") else ""),
                  "", "", "", e(k["reason"])] for k in q.get("kept", [])]
        parts.append(f"<h2>INT8 quantization ({e(q['candidate'])})</h2><p>Calibrated on {q.get('calib_batches')} "
                     f"batch(es) with the {e(str(q.get('observer')))} observer; calibration output error: rel "
                     f"{_f(q.get('output_rel_err'), '{:.2e}')}, cosine {_f(q.get('output_cosine'), '{:.6f}')}.</p>"
                     + _table(["layer", "type", "runs in", "observer", "input scale", "rel err", "why float"], rows,
                              left=3))
    q = report.get("fp8")
    if q:
        rows = [[e(x["name"]), e(x["type"]), "e4m3", f'{x["in_features"]} &times; {x["out_features"]}',
                 "per row" if x["act_scale"] is None else f'{x["act_scale"]:.4g} ({e(str(x["observer"]))})',
                 _f(x["rel_err"], "{:.2e}"), ""] for x in q.get("layers", [])]
        rows += [[e(k["name"]), e(k["type"]), e(q.get("float_dtype", "float")), "", "", "", e(k["reason"])]
                 for k in q.get("kept", [])]
        how = ("static per-tensor input scales calibrated on "
               f"{q.get('calib_batches')} batch(es) with the {e(str(q.get('observer')))} observer"
               if q.get("activations") == "static" else "a dynamic input scale per row")
        parts.append(f"<h2>FP8 quantization ({e(q['candidate'])})</h2><p>e4m3 weights with a scale per output "
                     f"channel, {how}, on the fp8 GEMM (matmul_fp8); calibration output error: rel "
                     f"{_f(q.get('output_rel_err'), '{:.2e}')}, cosine {_f(q.get('output_cosine'), '{:.6f}')}.</p>"
                     + _table(["layer", "type", "runs in", "K &times; N", "input scale", "rel err", "why float"],
                              rows, left=3))
    q = report.get("weight_only")
    if q:
        rows = [[e(x["name"]), e(x["type"]), e(x["scheme"]), f'{x["in_features"]} &times; {x["out_features"]}',
                 _f(x["weight_rel_err"], "{:.2e}"), f'{_bytes(x["bytes_float"])} &rarr; {_bytes(x["bytes_packed"])}',
                 ""] for x in q.get("layers", [])]
        rows += [[e(k["name"]), e(k["type"]), e(q.get("float_dtype", "float")), "", "", "", e(k["reason"])]
                 for k in q.get("kept", [])]
        ratio = q["bytes_packed"] / q["bytes_float"] if q.get("bytes_float") else None
        parts.append(f"<h2>Weight-only quantization ({e(q['candidate'])})</h2><p>{e(q.get('scheme', ''))} weights "
                     f"on the weight-streaming linear kernel (kernels.gemv.linear), {e(q.get('float_dtype', ''))} "
                     f"activations, no calibration; quantized weights {_bytes(q.get('bytes_float'))} &rarr; "
                     f"{_bytes(q.get('bytes_packed'))} ({_f(ratio, '{:.2f}x')}).</p>"
                     + _table(["layer", "type", "runs in", "K &times; N", "weight rel err", "weight bytes",
                               "why float"], rows, left=3))
    if report.get("layers"):
        parts.append("<h2>Per-layer precision (winner)</h2>" + _table(
            ["layer", "type", "computes in"],
            [[e(x["layer"]), e(x["type"]), e(x["dtype"])] for x in report["layers"]], left=3))
    body = "\n".join(parts)
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>warpforge optimize: "
            f"{e(str(m.get('name', '')))}</title><style>{_CSS}</style></head><body>{body}</body></html>")


def write(report: dict[str, Any], directory: str | Path) -> dict[str, Path]:
    """report.json and report.html under ``directory`` (created)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / "report.json", "html": d / "report.html"}
    paths["json"].write_text(to_json(report))
    paths["html"].write_text(to_html(report))
    return paths


__all__ = ["environment", "make_report", "to_html", "to_json", "write"]
