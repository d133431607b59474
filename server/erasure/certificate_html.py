"""The erasure certificate as one self-contained HTML page (``render``), for a data-protection
officer: no script, no font, image or style sheet fetched (a Content-Security-Policy forbids
it), inline CSS only, the one figure inline as SVG. It prints as it shows.

It renders the dict ``certificate.build`` returns, and nothing else: every text of it goes
through ``html.escape`` (a reason or an audit detail may hold markup), every number through
``_n``, every list is already bounded there, and at most ``DIGESTS_SHOWN`` sample digests are
listed here (all of them are in ``certificate.json``).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

DIGESTS_SHOWN = 200
"""Most sample digests listed on the page; the rest are in the JSON."""

_CSS = """
body{font:14px/1.45 "DejaVu Sans",Arial,sans-serif;color:#1d2530;max-width:1100px;
margin:24px auto;padding:0 24px}
h1{font-size:24px;margin:0 0 4px}
h2{font-size:18px;margin:28px 0 8px;border-bottom:2px solid #d6dde6;
padding-bottom:4px}h3{font-size:15px;margin:18px 0 6px}
.statement{background:#f3f6f9;border-left:5px solid #3c6e9f;padding:10px 14px;font-size:15px}
.state{display:inline-block;padding:1px 8px;border-radius:9px;font-weight:bold;color:#fff;
background:#6b7785}.state.verified{background:#2f7d4a}.state.failed,.state.notverified{
background:#a63a32}.verdict{font-size:17px;margin:10px 0}
table{border-collapse:collapse;width:100%;margin:6px 0 10px}
td,th{border:1px solid #d6dde6;padding:4px 7px;text-align:left;vertical-align:top}
th{background:#eef2f6;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums;
white-space:nowrap}code,.mono{font-family:"DejaVu Sans Mono",monospace;font-size:12.5px;
overflow-wrap:anywhere}.muted{color:#5d6875}.no{color:#a63a32;font-weight:600}
.ok{color:#2f7d4a;font-weight:600}.nw{white-space:nowrap}ol.timeline{list-style:none;padding:0;margin:0}
ol.timeline li{border-left:4px solid #2f7d4a;margin:0 0 8px;padding:2px 0 2px 12px}
ol.timeline li.todo{border-left-color:#c3cbd4;color:#5d6875}
.notverified{border:2px solid #a63a32;border-radius:4px;padding:4px 14px 10px}
.digests{columns:3;font-family:"DejaVu Sans Mono",monospace;font-size:12px}
@media print{body{margin:0}h2{break-after:avoid}tr{break-inside:avoid}}
"""

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
"""What the page may load: nothing but its own inline style (and data: images)."""


def _e(x: object) -> str:
    """Escaped text (``None`` as a dash)."""
    return "—" if x is None else html.escape(str(x), quote=True)


def _n(v: object) -> str:
    """A number for the page: integers as such, others to 4 significant digits."""
    if v is None or isinstance(v, bool) or not isinstance(v, int | float):
        return "—" if v is None else _e(v)
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4g}"


def _when(at: object) -> str:
    """An ISO time on two lines that never break inside: the date, then the time."""
    if not isinstance(at, str) or "T" not in at:
        return _e(at)
    day, clock = at.split("T", 1)
    return f'<span class="nw">{_e(day)}</span> <span class="nw">{_e(clock)}</span>'


def _row(cells: Iterable[str], tag: str = "td") -> str:
    return "<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>"


def _table(head: Sequence[str], rows: Iterable[Iterable[str]]) -> str:
    body = "".join(_row(r) for r in rows)
    return f"<table><thead>{_row((_e(h) for h in head), 'th')}</thead><tbody>{body}</tbody></table>"


def _kv(pairs: Iterable[tuple[str, str]]) -> str:
    return (
        "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in pairs) + "</table>"
    )


def render(cert: dict[str, Any]) -> str:
    """The certificate ``cert`` (``certificate.build``'s dict) as one HTML page."""
    r = cert["request"]
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        f"<title>Erasure certificate {_e(r['id'])}</title><style>{_CSS}</style></head><body>",
        "<h1>Erasure certificate</h1>",
        f'<p class="muted">fedasync {_e(cert["format"])} v{_e(cert["version"])} · request '
        f"<code>{_e(r['id'])}</code> · lifecycle state {_e(r['state'])}</p>",
        _verdict(cert["verdict"]),
        f'<p class="statement">{_e(cert["outcome"]["statement"])}</p>',
        _request(r),
        _timeline(cert["timeline"]),
        _model(cert["model"]),
        _checks(cert["checks"]),
        _not_verified(cert["not_verified"]),
        _audit(cert["audit"]),
        _refusals(cert["refusals"]),
        _sources(cert["sources"], r["id"]),
        "</body></html>\n",
    ]
    return "\n".join(parts)


def _verdict(v: dict[str, Any]) -> str:
    """The verdict at the top, and each check (with its figures) not within."""
    reading = v["reading"]
    cls = {"verified": "verified", "not verified": "notverified", "failed": "failed"}
    label = f"{reading} (in progress)" if v["in_progress"] else reading
    head = (
        f'<p class="verdict" id="verdict">Verdict: <span class="state '
        f'{cls.get(reading, "")}">{_e(label)}</span> <span class="muted">{_e(v["summary"])}'
        "</span></p>"
    )
    if not v["not_within"]:
        return head
    items = "".join(
        f"<li><b>{_e(x['title'])}</b> ({_e(x['check'])}): {_e(', '.join(x['figures']))}</li>"
        for x in v["not_within"]
    )
    return f'{head}<div class="notverified"><p>Not within:</p><ul>{items}</ul></div>'


def _request(r: dict[str, Any]) -> str:
    s = r["samples"]
    if r["scope"] == "whole_silo":
        what = f"the whole silo {_n(r['silo'])}"
        if s["forget_set_reported_by_silo"] is not None:
            what += f" ({_n(s['forget_set_reported_by_silo'])} samples at erasure, by the silo)"
    else:
        what = f"{_n(s['count'])} sample(s) of silo {_n(r['silo'])}"
    rows = [
        ("Requested by", _e(r["requester"])),
        (
            "Submitted",
            f"{_e(r['submitted_at'])} (global model version {_n(r['model_version_at_submit'])})",
        ),
        ("Silo", _n(r["silo"])),
        ("What is erased", what),
        ("Reason given", _e(r["reason"]) if r["reason"] else '<span class="muted">none</span>'),
        ("State", f"{_e(r['state'])} {_e(r['failure_reason'])}"),
    ]
    digests = s["digests"]
    listed = "".join(f"<div>{_e(d)}</div>" for d in digests[:DIGESTS_SHOWN])
    more = len(digests) - DIGESTS_SHOWN + s["digests_left_out"]
    tail = f'<p class="muted">… and {_n(more)} more in certificate.json.</p>' if more > 0 else ""
    samples = (
        f"<h3>The erased samples, as digests ({_n(len(digests))})</h3>"
        f'<p class="muted">{_e(s["digest"])}. The ids themselves are never shown: whoever holds '
        "an id computes its digest and finds it here (see How this certificate was made).</p>"
        f'<div class="digests">{listed}</div>{tail}'
        if digests
        else ""
    )
    return f'<h2 id="request">1. The request</h2>{_kv(rows)}{samples}'


def _timeline(steps: list[dict[str, Any]]) -> str:
    items = []
    for s in steps:
        when = (
            f"{_e(s['at'])} · model version {_n(s['model_version'])}"
            if s["reached"]
            else "not reached"
        )
        if s["clock_t"] is not None:
            when += f" · run clock t={_n(s['clock_t'])} s"
        detail = f'<br><span class="muted">{_e(s["detail"])}</span>' if s["detail"] else ""
        cls = "" if s["reached"] else ' class="todo"'
        items.append(f"<li{cls}><b>{_e(s['label'])}</b><br>{when}{detail}</li>")
    return f'<h2 id="timeline">2. Timeline</h2><ol class="timeline">{"".join(items)}</ol>'


def _model(m: dict[str, Any]) -> str:
    def cell(x: dict[str, Any] | None) -> list[str]:
        if x is None:
            return ["—", '<span class="no">not recorded</span>']
        return [_n(x["version"]), f'<span class="mono">{_e(x["sha256"])}</span>']

    rows = [
        ["Just before the erasure", *cell(m["before"])],
        ["With the erasure (the boundary)", *cell(m["after"])],
        ["When checked again after the relearning window", *cell(m["checked"])],
    ]
    return (
        '<h2 id="model">3. The global model before and after</h2>'
        + _table(["Model", "Version", "SHA-256"], rows)
        + f'<p class="muted">{_e(m["hash"])}.</p>'
    )


def _checks(checks: list[dict[str, Any]]) -> str:
    out = ['<h2 id="checks">4. What was verified</h2>']
    for c in checks:
        if not c["ran"]:
            continue
        out.append(f"<h3>{_e(c['title'])}</h3>")
        rows = []
        for f in c["figures"]:
            rows.append(
                [
                    _e(f["label"]),
                    _n(f["value"]),
                    _n(f["reference"]) if f["reference"] is not None else "",
                    _e(f["reference_label"]),
                    _rule(f),
                    _reading(f),
                ]
            )
        out.append(_figures(rows))
        if c.get("settings"):
            out.append(_kv((k, _e(v)) for k, v in c["settings"].items()))
        if c["id"] == "resurfacing" and c.get("points"):
            out.append(_chart(c))
        for note in c["notes"]:
            out.append(f'<p class="muted">{_e(note)}</p>')
        out.append(f'<p class="muted">Source: {_e(c["source"])}.</p>')
    return "".join(out)


def _rule(f: dict[str, Any]) -> str:
    """A figure's rule, with its tolerance when it has one."""
    tol = f.get("tolerance")
    return _e(f.get("rule")) + ("" if tol is None else f" (tolerance {_n(tol)})")


def _reading(f: dict[str, Any]) -> str:
    """A figure's reading: within (green), not within and on which side (red), or
    informational."""
    verdict = f.get("verdict")
    if verdict == "within":
        return '<span class="ok">within</span>'
    if verdict == "not within":
        side = f" ({_e(f['side'])})" if f.get("side") else ""
        return f'<span class="no">not within{side}</span>'
    return f'<span class="muted">{_e(verdict)}</span>'


def _figures(rows: list[list[str]]) -> str:
    head = _row(
        (_e(h) for h in ("Figure", "Value", "Reference", "The reference is", "Rule", "Reading")),
        "th",
    )
    body = "".join(
        f'<tr><td>{r[0]}</td><td class="n">{r[1]}</td><td class="n">{r[2]}</td>'
        f'<td>{r[3]}</td><td>{r[4]}</td><td class="reading">{r[5]}</td></tr>'
        for r in rows
    )
    return f"<table><thead>{head}</thead><tbody>{body}</tbody></table>"


_COLOURS = {
    "forget_accuracy": "#3c6e9f",
    "mia_auc": "#a63a32",
    "asr": "#c17a1b",
    "test_accuracy": "#2f7d4a",
}


def _chart(res: dict[str, Any]) -> str:
    """Each forgetting metric from the boundary (x = 0) through the checks in between
    (``erasure_watch``) to the verification, as an inline SVG line chart (values in [0, 1])."""
    at_boundary = {f["name"]: f.get("at_boundary") for f in res["figures"]}
    at_verified = {f["name"]: f["value"] for f in res["figures"]}
    points = res["points"]
    end = max((p.get("since_boundary") or 0 for p in points), default=0)
    first = points[0] if points else {}
    boundary = (first.get("version") or 0) - (first.get("since_boundary") or 0)
    verified = res.get("verified_version")
    last = verified - boundary if isinstance(verified, int) else None
    span = max(last or 0, end, 1)
    w, h, left, top = 640, 230, 44, 12
    pw, ph = w - left - 150, h - top - 34

    def px(x: float) -> float:
        return left + pw * x / span

    def py(y: float) -> float:
        return top + ph * (1 - max(0.0, min(1.0, y)))

    svg = [
        f'<svg width="{w}" height="{h}" role="img" aria-label="forgetting metrics after the '
        f'boundary"><rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafbfc" '
        'stroke="#c3cbd4"/>'
    ]
    for y in (0.0, 0.5, 1.0):
        svg.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
            f'stroke="#d6dde6" stroke-dasharray="3,3"/><text x="{left - 6}" '
            f'y="{py(y) + 4:.1f}" font-size="11" text-anchor="end">{y:g}</text>'
        )
    for x in sorted({0, span // 2, span}):
        svg.append(
            f'<text x="{px(x):.1f}" y="{top + ph + 13}" font-size="11" text-anchor="middle">'
            f"{x}</text>"
        )
    svg.append(
        f'<text x="{left + pw / 2:.1f}" y="{h - 4}" font-size="11" text-anchor="middle">'
        "versions after the boundary</text>"
    )
    row = 0
    for key, colour in _COLOURS.items():
        raw = [(0.0, at_boundary.get(key))]
        raw += [(float(p.get("since_boundary") or 0), p.get(key)) for p in points]
        if last is not None:
            raw.append((float(last), at_verified.get(key)))
        series = [(x, float(y)) for x, y in raw if isinstance(y, int | float)]
        if len(series) < 2:
            continue
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in series)
        svg.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{line}"/>')
        svg += [
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in series
        ]
        ly = top + 14 + 18 * row
        svg.append(
            f'<rect x="{left + pw + 12}" y="{ly - 9}" width="12" height="4" fill="{colour}"/>'
            f'<text x="{left + pw + 30}" y="{ly - 3}" font-size="12">{_e(key)}</text>'
        )
        row += 1
    svg.append("</svg>")
    return "".join(svg)


def _not_verified(items: list[dict[str, str]]) -> str:
    rows = "".join(f"<li><b>{_e(x['check'])}</b>: {_e(x['why'])}</li>" for x in items)
    return (
        '<h2 id="not-verified">5. What was NOT verified</h2><div class="notverified">'
        "<p>The checks below did not run for this request, or cannot be made by fedasync. "
        f"Read the figures above with them in mind.</p><ul>{rows}</ul></div>"
    )


def _audit(a: dict[str, Any]) -> str:
    rows = []
    for x in a["rows"]:
        moved = f"{_e(x['from_state'] or '')} → {_e(x['to_state'])}"
        facts = "".join(f"<div>{_e(k)} = {_e(v)}</div>" for k, v in x["facts"].items())
        n = len(x["metrics"])
        detail = (
            _e(x["detail"])
            + (f'<div class="muted">{n} metric(s)</div>' if n else "")
            + (f'<div class="mono">{facts}</div>' if facts else "")
        )
        rows.append(
            [
                _n(x["seq"]),
                _when(x["at"]),
                _e(x["actor"]),
                _e(x["action"]),
                moved,
                _n(x["model_version"]),
                detail,
            ]
        )
    left = (
        f'<p class="muted">{_n(a["left_out"])} of {_n(a["total"])} rows left out (the middle '
        "ones); all are in the store.</p>"
        if a["left_out"]
        else ""
    )
    return (
        '<h2 id="audit">6. Audit log</h2>'
        + _table(["#", "Time (UTC)", "By", "Action", "State", "Version", "Detail"], rows)
        + left
        + f'<p class="muted">{_e(a["note"])}.</p>'
    )


def _refusals(f: dict[str, Any]) -> str:
    rows = [
        [_when(x["at"]), _e(x["who"]), _e(x["method"]), _e(x["code"]), _e(x["reason"])]
        for x in f["rows"]
    ]
    table = (
        _table(["Time (UTC)", "Who", "Method", "Code", "Reason"], rows) if rows else "<p>None.</p>"
    )
    return (
        f'<h2 id="refusals">7. Refused calls about this request</h2>{table}'
        f'<p class="muted">{_e(f["note"])}.</p>'
    )


def _sources(s: dict[str, Any], request_id: str) -> str:
    log, store = s["event_log"], s["store"]
    read = (
        "not read"
        if log is None
        else f'{_e(log["file"])} (SHA-256 <span class="mono">{_e(log["sha256"])}</span>, '
        f"{_e(log['clock'])} clock)"
    )
    refs = ", ".join(
        f'{_e(x["run"])} (<span class="mono">{_e(x["sha256"][:16])}</span>…)'
        for x in s["references"]
    )
    rows = [
        (
            "Erasure store",
            f"{_e(store['file'])} ({_n(store['audit_rows'])} audit rows of this request, "
            f"up to #{_n(store['last_seq'])})",
        ),
        ("Event log", read),
        ("Retraining references", refs or "none"),
    ]
    check = (
        "python -c 'import hashlib, hmac, sys; print(hmac.new(sys.argv[1].encode(), "
        "sys.argv[2].encode(), hashlib.sha256).hexdigest()[:32])' "
        f"{request_id} SAMPLE_ID"
    )
    return (
        '<h2 id="sources">8. How this certificate was made</h2>'
        + _kv(rows)
        + "<p>Made from the erasure store and the run's event log alone: the same files give the "
        "same certificate. To make it again: <code>fedasync erase certificate "
        f"{_e(request_id)} --run RUN_DIR --out DIR</code> (or through the erasure service, "
        "without <code>--run</code>). To check that a sample is among the erased ones, compute "
        f"its digest: <code>{_e(check)}</code></p>"
    )
