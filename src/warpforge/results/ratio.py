"""The ratio rule, in one place: a ratio only between two sides that ran the same work and both passed
their correctness check (docs/design.md, "Rules for a figure"). Records (``results.record``), the side-by-side
(``bench.compare``), end-to-end cases (``bench.e2e``) and the optimizer's speedups all take their ratios
through :func:`same_work_ratio`; ``results.record.figure_violations`` checks stored records against it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RATIO_RTOL = 1e-6  # a stored ratio must equal peer ms / ours ms to this relative precision
FRACTION_MAX = 1.0 + 1e-9  # a roofline fraction or a utilisation above this is a bug (float slack only)


@dataclass(frozen=True)
class Side:
    """Ours or one peer, as the ratio rule sees it."""

    ms: float | None = None  # the median time of its work; None when it did not run or was not timed
    ok: bool | None = None  # its own correctness check; None: never checked (then it is no baseline)
    error: str | None = None  # why it did not run or was not timed
    ran: Any = None  # what it ran, when that is not simply the case's workload (JSON-able, compared by ==)
    rounds_ms: Sequence[float] = ()  # per-round medians, paired by position with the other side's
    check: str = ""  # what its check found, for the reason (e.g. "rel_err 0.4 > tol 0.02")
    tokens: int | None = None  # output tokens a throughput figure counts (end-to-end runs): part of the work


@dataclass(frozen=True)
class Ratio:
    """``value`` = peer ms / ours ms (above 1: ours is faster), or None and ``why``."""

    value: float | None
    why: str | None = None
    interval: tuple[float, float] | None = None  # lowest and highest per-round ratio (None: one round)


def same_work_ratio(ours: Side, peer: Side) -> Ratio:
    """The only way a ratio enters a record: ``peer.ms / ours.ms`` when both ran, both passed their
    correctness check and both ran the same work; otherwise no ratio and the reason.

    A throughput figure inverts to the same number on the same work (tokens over time, same tokens), so
    this is also "ours tok/s over the peer's". The interval pairs rounds by position (round i of ours
    with round i of the peer: the same drift hits both); the ratio of the medians lies inside it (some
    round is at or below both medians' ratio and some at or above), it is widened to hold it anyway.
    """
    if ours.error is not None or ours.ms is None:
        return Ratio(None, f"ours did not run: {ours.error or 'not timed'}")
    if peer.error is not None or peer.ms is None:
        return Ratio(None, f"the peer did not run: {peer.error or 'not timed'}")
    if ours.ok is not True:
        return Ratio(None, "ours failed its correctness check" + (f" ({ours.check})" if ours.check else "")
                     if ours.ok is False else "ours was not checked")
    if peer.ok is not True:
        return Ratio(None, ("the peer failed its correctness check" + (f" ({peer.check})" if peer.check else "")
                            if peer.ok is False else "the peer was not checked") + ": it is no baseline")
    if ours.ran != peer.ran:
        return Ratio(None, f"different work: the peer ran {_show(peer.ran)}, ours {_show(ours.ran)}")
    if ours.tokens is not None and peer.tokens is not None and ours.tokens != peer.tokens:
        return Ratio(None, f"different work: the peer produced {peer.tokens:,} tokens, ours {ours.tokens:,}")
    if not (math.isfinite(ours.ms) and math.isfinite(peer.ms) and ours.ms > 0 and peer.ms > 0):
        return Ratio(None, f"no positive finite times (ours {ours.ms!r} ms, peer {peer.ms!r} ms)")
    value = peer.ms / ours.ms
    interval = None
    pairs = [(p, o) for p, o in zip(peer.rounds_ms, ours.rounds_ms) if o > 0 and p > 0]
    if len(pairs) >= 2 and len(peer.rounds_ms) == len(ours.rounds_ms):
        per_round = [p / o for p, o in pairs]
        interval = (min(min(per_round), value), max(max(per_round), value))
    return Ratio(value, None, interval)


def _show(ran: Any) -> str:
    if ran is None:
        return "the case's workload"
    return json.dumps(ran, sort_keys=True, default=str) if not isinstance(ran, str) else ran


def put_ratio(rec: dict[str, Any], name: str, r: Ratio) -> None:
    """Write one peer's :class:`Ratio` into a record's ``ratio`` / ``ratio_interval`` / ``ratio_null``."""
    if r.value is None:
        rec.setdefault("ratio_null", {})[name] = r.why or "no ratio"
        return
    rec.setdefault("ratio", {})[name] = r.value
    if r.interval is not None:
        rec.setdefault("ratio_interval", {})[name] = [r.interval[0], r.interval[1]]


def check_note(c: dict[str, Any] | None) -> str:
    """A correctness block in a few words, for a ratio's reason."""
    if not isinstance(c, dict):
        return ""
    if c.get("note"):
        return str(c["note"])
    err, tol = c.get("rel_err"), c.get("tol")
    if isinstance(err, (int, float)):
        return f"rel_err {err:.3g}" + (f" > tol {tol:.3g}" if isinstance(tol, (int, float)) else "")
    return ""


def entry_side(entry: dict[str, Any], correct: dict[str, Any] | None) -> Side:
    """A record entry (ours or a peer) and its correctness block as a :class:`Side`."""
    if "error" in entry:
        return Side(error=entry["error"])
    ok = correct.get("ok") if isinstance(correct, dict) else None
    tokens = entry.get("tokens")
    return Side(ms=entry.get("ms"), ok=ok if isinstance(ok, bool) else None, ran=entry.get("ran"),
                rounds_ms=tuple(entry.get("rounds_ms") or ()), check=check_note(correct),
                tokens=tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None)


__all__ = ["FRACTION_MAX", "RATIO_RTOL", "Ratio", "Side", "check_note", "entry_side", "put_ratio",
           "same_work_ratio"]
