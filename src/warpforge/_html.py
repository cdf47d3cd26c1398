"""What the self-contained HTML reports share: the page, heading and headline-figure styles (one look, so the
profile report and the splat training report read alike). Each report appends its own rules."""

from __future__ import annotations

from string import Template

# $-placeholders (string.Template) rather than an f-string: CSS's braces stay as written
_PAGE = Template("""
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;background:#f7fafc;color:#1a202c}
main{max-width:1180px;margin:0 auto;padding:20px 28px 60px}
h1{font-size:22px;margin:8px 0 2px}
h2{font-size:17px;margin:${h2_top}px 0 8px;border-bottom:1px solid #e2e8f0;padding-bottom:4px}
.sub{color:#4a5568;font-size:13px}
.figs{display:flex;flex-wrap:wrap;gap:10px;margin:${figs_margin}px 0}
.fig{background:#fff;border:1px solid #e2e8f0;border-radius:6px;padding:8px 12px;min-width:${fig_min_width}px;
  flex:1 1 0}
.fig b{display:block;font-size:18px} .fig span{font-size:12px;color:#4a5568}
""")


def page_css(*, h2_top: int, figs_margin: int, fig_min_width: int) -> str:
    """The shared rules (body, main, h1, h2, .sub and the .figs row of .fig boxes) with a report's spacing:
    the space above an h2, above and below the figures' row, and a figure box's minimum width, in px."""
    return _PAGE.substitute(h2_top=h2_top, figs_margin=figs_margin, fig_min_width=fig_min_width)


__all__ = ["page_css"]
