"""Plots as inline SVG, drawn on the server: no chart library, nothing to fetch, and the page
works offline. Every label is escaped (env names come from task files).

Sizes are in SVG user units; the page scales the SVG to its width (viewBox).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Sequence

from markupsafe import Markup, escape

PALETTE = ("#2b6cb0", "#c05621", "#2f855a", "#9b2c2c", "#6b46c1", "#b7791f", "#2c7a7b", "#97266d")
HIST_BINS = 20
TIME_BINS = 60
MAX_DOTS = 1500  # above this many episodes the time plot shows bin means only


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == int(x) and abs(x) < 1e9:
        return str(int(x))
    return f"{x:.3g}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.3f}".rstrip("0").rstrip(".")


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _range(values: Iterable[float]) -> tuple[float, float]:
    vals = list(values)
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.1 or 0.5
        lo, hi = lo - pad, hi + pad
    return lo, hi


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(step)) if step > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if step <= m * mag:
            step = m * mag
            break
    start = math.ceil(lo / step) * step
    out, x = [], start
    while x <= hi + step * 1e-9 and len(out) < 12:
        out.append(round(x, 10))
        x += step
    return out


def _text(x: float, y: float, s: str, *, anchor: str = "start", size: int = 11, fill: str = "#333",
          weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}" '
            f'font-weight="{weight}">{escape(s)}</text>')


def reward_distribution(by_env: dict[str, list[float]]) -> Markup:
    """Per env_name: a box plot (quartiles, whiskers at min and max, a dot at the mean) and a
    histogram, on one reward axis shared by every env."""
    envs = sorted(k for k, v in by_env.items() if v)
    if not envs:
        return Markup('<p class="muted">No completed episodes yet.</p>')
    lo, hi = _range(v for e in envs for v in by_env[e])
    label_w, box_w, gap, hist_w, row_h, top, axis_h = 190, 330, 30, 230, 40, 24, 30
    width = label_w + box_w + gap + hist_w + 10
    height = top + row_h * len(envs) + axis_h
    bx0, hx0 = label_w, label_w + box_w + gap

    def sx(v: float, x0: float, w: float) -> float:
        return x0 + (v - lo) / (hi - lo) * w

    out = [f'<svg class="plot" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="reward distribution per env_name">',
           _text(bx0, 14, "reward: box plot (min, quartiles, max; dot = mean)", size=11, fill="#555"),
           _text(hx0, 14, f"histogram ({HIST_BINS} bins)", size=11, fill="#555")]
    for tick in _ticks(lo, hi):
        for x0, w in ((bx0, box_w), (hx0, hist_w)):
            x = sx(tick, x0, w)
            out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height - axis_h + 4}" stroke="#eee"/>')
            out.append(_text(x, height - axis_h + 18, fmt(tick), anchor="middle", size=10, fill="#666"))
    for i, env in enumerate(envs):
        vals = sorted(by_env[env])
        n = len(vals)
        mean = sum(vals) / n
        q1, med, q3 = quantile(vals, 0.25), quantile(vals, 0.5), quantile(vals, 0.75)
        y = top + i * row_h
        cy = y + row_h / 2
        c = color(i)
        summary = (f"{env}: n={n} mean={fmt(mean)} min={fmt(vals[0])} q1={fmt(q1)} median={fmt(med)} "
                   f"q3={fmt(q3)} max={fmt(vals[-1])}")
        out.append(f'<g><title>{escape(summary)}</title>')
        short = env if len(env) <= 26 else env[:25] + "…"
        out.append(_text(4, cy - 2, short, size=12, weight="bold"))
        out.append(_text(4, cy + 12, f"n={n}  mean={fmt(mean)}", size=10, fill="#666"))
        x_min, x_max = sx(vals[0], bx0, box_w), sx(vals[-1], bx0, box_w)
        x_q1, x_q3, x_med = sx(q1, bx0, box_w), sx(q3, bx0, box_w), sx(med, bx0, box_w)
        out.append(f'<line x1="{x_min:.1f}" y1="{cy:.1f}" x2="{x_max:.1f}" y2="{cy:.1f}" stroke="{c}"/>')
        for xe in (x_min, x_max):
            out.append(f'<line x1="{xe:.1f}" y1="{cy - 7:.1f}" x2="{xe:.1f}" y2="{cy + 7:.1f}" stroke="{c}"/>')
        out.append(f'<rect x="{x_q1:.1f}" y="{cy - 10:.1f}" width="{max(1.5, x_q3 - x_q1):.1f}" height="20" '
                   f'fill="{c}" fill-opacity="0.25" stroke="{c}"/>')
        out.append(f'<line x1="{x_med:.1f}" y1="{cy - 10:.1f}" x2="{x_med:.1f}" y2="{cy + 10:.1f}" '
                   f'stroke="{c}" stroke-width="2.5"/>')
        out.append(f'<circle cx="{sx(mean, bx0, box_w):.1f}" cy="{cy:.1f}" r="3.2" fill="#fff" stroke="#000"/>')
        counts = [0] * HIST_BINS
        for v in vals:
            counts[min(HIST_BINS - 1, max(0, int((v - lo) / (hi - lo) * HIST_BINS)))] += 1
        peak = max(counts)
        bw = hist_w / HIST_BINS
        for b, k in enumerate(counts):
            if k:
                h = (row_h - 8) * k / peak
                out.append(f'<rect x="{hx0 + b * bw + 0.5:.1f}" y="{y + row_h - 4 - h:.1f}" width="{bw - 1:.1f}" '
                           f'height="{h:.1f}" fill="{c}" fill-opacity="0.7"><title>{k} episodes in '
                           f'[{fmt(lo + b * (hi - lo) / HIST_BINS)}, {fmt(lo + (b + 1) * (hi - lo) / HIST_BINS)})'
                           f'</title></rect>')
        out.append("</g>")
    out.append("</svg>")
    return Markup("".join(out))


def reward_over_time(points: Sequence[tuple[str, float, float | None]]) -> Markup:
    """Completed episodes' rewards against the time they finished: per env_name the mean of
    each of up to 60 time bins as a line, and each episode as a dot while they are few."""
    pts = [(e, r, t) for e, r, t in points if t is not None]
    if len(pts) < 2:
        return Markup('<p class="muted">Not enough finished episodes for a time plot yet.</p>')
    envs = sorted({e for e, _, _ in pts})
    t0 = min(t for _, _, t in pts)
    span = max(t for _, _, t in pts) - t0
    unit, div = ("min", 60.0) if span >= 120 else ("s", 1.0)
    tmax = max(span / div, 1e-9)
    lo, hi = _range(r for _, r, _ in pts)
    width, height, left, right, top, bottom = 760, 260, 50, 150, 16, 34
    pw, ph = width - left - right, height - top - bottom

    def sx(t: float) -> float:
        return left + (t - t0) / div / tmax * pw

    def sy(r: float) -> float:
        return top + ph - (r - lo) / (hi - lo) * ph

    out = [f'<svg class="plot" viewBox="0 0 {width} {height}" role="img" aria-label="reward over time">']
    for tick in _ticks(lo, hi):
        y = sy(tick)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(_text(left - 6, y + 4, fmt(tick), anchor="end", size=10, fill="#666"))
    for tick in _ticks(0, tmax):
        x = left + tick / tmax * pw
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#f3f3f3"/>')
        out.append(_text(x, top + ph + 16, fmt(tick), anchor="middle", size=10, fill="#666"))
    out.append(_text(left + pw / 2, height - 2, f"finished at ({unit} since the first)", anchor="middle", size=10,
                     fill="#555"))
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>')
    dots = len(pts) <= MAX_DOTS
    bins = max(1, min(TIME_BINS, len(pts) // max(1, 5 * len(envs))))
    for i, env in enumerate(envs):
        c = color(i)
        mine = [(r, t) for e, r, t in pts if e == env]
        if dots:
            out.extend(f'<circle cx="{sx(t):.1f}" cy="{sy(r):.1f}" r="2" fill="{c}" fill-opacity="0.35"/>'
                       for r, t in mine)
        sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
        for r, t in mine:
            b = min(bins - 1, int((t - t0) / (span or 1) * bins))
            sums[b][0] += r
            sums[b][1] += 1
        line = [(left + (b + 0.5) / bins * pw, sy(s / k)) for b, (s, k) in sorted(sums.items())]
        if len(line) > 1:
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y in line) + '"/>')
        elif line:
            out.append(f'<circle cx="{line[0][0]:.1f}" cy="{line[0][1]:.1f}" r="4" fill="{c}"/>')
        ly = top + 12 + i * 16
        out.append(f'<rect x="{left + pw + 12}" y="{ly - 9}" width="10" height="10" fill="{c}"/>')
        short = env if len(env) <= 20 else env[:19] + "…"
        out.append(f'<g><title>{escape(env)}</title>{_text(left + pw + 26, ly, short, size=11)}</g>')
    out.append("</svg>")
    return Markup("".join(out))
