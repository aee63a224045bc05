"""The report of a chaos run: summary.json, three plots and report.md.

Called by the harness (`chaos.session`) after the checkers ran, with the
merged history and their results; it reads nothing but those. `summary.json`
is for machines (CI, the simulator comparison), `report.md` for people: the
headline goodput and uptime, each check's verdict, the faults injected and
links to the plots — per-learner loss, fragment versions and per-window
goodput/uptime over time, every plot marking when the faults hit.

Plots use matplotlib's object API on the Agg canvas (no pyplot, no global
backend switch), so a report can be written from any thread or process.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from chaos import metrics
from chaos.checkers import CheckResult
from chaos.history import (
    COORDINATOR,
    HARNESS,
    Event,
    SkippedLine,
    fragment_count,
    learner_ids,
    run_bounds,
    run_info,
    versions_of,
)

# A failed check that names an event within this many seconds after a fault
# healed is listed against that fault (a heuristic, for the reader).
ATTRIBUTION_MARGIN_S = 10.0

_FAULT_COLORS = {
    "kill_learner": "tab:red", "restart_learner": "tab:red", "kill_coordinator": "black",
    "restart_coordinator": "black", "pause_learner": "tab:orange", "straggle": "tab:olive",
    "partition_learner": "tab:purple", "latency": "tab:cyan", "bandwidth": "tab:blue",
    "reset_connections": "tab:pink", "adversary": "tab:brown",
}


@dataclass(frozen=True)
class FaultSpan:
    """One fault from inject to heal (`end` == `start` for an instant one,
    None if it never healed)."""

    fault: str
    target: str
    start: float
    end: float | None
    inject_index: int
    heal_index: int | None
    detail: str


def fault_spans(events: Sequence[Event]) -> list[FaultSpan]:
    """Pair each fault's inject with the next heal of the same fault and target."""
    open_: dict[tuple[str, str], Event] = {}
    spans: list[FaultSpan] = []
    for e in events:
        if e.source != HARNESS or e.kind != "fault":
            continue
        key = (str(e.get("fault")), str(e.get("target")))
        if e.get("action") == "heal":
            inject = open_.pop(key, None)
            if inject is not None:
                spans.append(FaultSpan(key[0], key[1], inject.t, e.t, inject.index, e.index,
                                       str(inject.get("detail") or "")))
        elif key in open_:  # injected again without a heal: the first one was instant
            first = open_[key]
            spans.append(FaultSpan(key[0], key[1], first.t, first.t, first.index, None,
                                   str(first.get("detail") or "")))
            open_[key] = e
        else:
            open_[key] = e
    instant = {"reset_connections"}
    for (fault, target), inject in open_.items():
        spans.append(FaultSpan(fault, target, inject.t,
                               inject.t if fault in instant else None, inject.index, None,
                               str(inject.get("detail") or "")))
    return sorted(spans, key=lambda s: (s.start, s.inject_index))


def write_report(events: Sequence[Event], results: Sequence[CheckResult], out_dir: str | Path,
                 experiment_name: str, *, window_s: float | None = None,
                 skipped: Sequence[SkippedLine] = ()) -> Path:
    """Write summary.json, loss.png, versions.png, goodput.png and report.md
    into `out_dir`; returns the path of report.md.

    `window_s` defaults to the one the uptime check used, else 2 s;
    `skipped` are the log lines loading could not parse (`LoadedLog.skipped`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if window_s is None:
        window_s = next((float(r.details["window_s"]) for r in results
                         if "window_s" in r.details), metrics.DEFAULT_WINDOW_S)
    summary = build_summary(events, results, experiment_name, window_s, skipped)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    spans = fault_spans(events)
    t0, _ = run_bounds(events)
    _plot_loss(events, spans, t0, out / "loss.png")
    _plot_versions(events, spans, t0, out / "versions.png")
    _plot_goodput(events, spans, t0, window_s, summary, out / "goodput.png")
    report = out / "report.md"
    report.write_text(_markdown(summary, results))
    return report


# -- summary ---------------------------------------------------------------------------


def build_summary(events: Sequence[Event], results: Sequence[CheckResult],
                  experiment_name: str, window_s: float = metrics.DEFAULT_WINDOW_S,
                  skipped: Sequence[SkippedLine] = ()) -> dict[str, Any]:
    """The content of summary.json (times relative to the run's start, in s)."""
    t0, t_end = run_bounds(events)
    info = run_info(events)
    g = metrics.goodput(events)
    u = metrics.uptime(events, window_s)
    end_reason = next((e.get("reason") for e in reversed(events)
                       if e.source == HARNESS and e.kind == "run_end"), None)

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    failed = [r for r in results if not r.passed]
    by_index = {e.index: e for e in events}
    spans = []
    for span in fault_spans(events):
        until = (span.end if span.end is not None else math.inf) + ATTRIBUTION_MARGIN_S
        nearby = sorted({r.name for r in failed for i in r.events
                         if i in by_index and span.start <= by_index[i].t <= until})
        spans.append({"fault": span.fault, "target": span.target, "start_s": rel(span.start),
                      "end_s": rel(span.end), "detail": span.detail,
                      "inject_event": span.inject_index, "heal_event": span.heal_index,
                      "failed_checks_nearby": nearby, "survived": not nearby})
    stall = u.longest_stall
    return {
        "experiment": experiment_name,
        "passed": all(r.passed for r in results),
        "run": {"seed": info.get("seed"), "mode": info.get("mode"),
                "learners": learner_ids(events), "fragments": fragment_count(events),
                "duration_s": round(t_end - t0, 3), "end_reason": end_reason,
                "events": len(events), "skipped_lines": len(skipped)},
        "checks": [r.to_json() for r in results],
        "goodput": {"value": g.value, "useful_s": g.useful_s, "allocated_s": g.allocated_s,
                    "unmerged_s": g.unmerged_s, "bound": g.bound, "losses": g.losses,
                    "per_learner": {lid: {"goodput": lg.goodput, "useful_s": lg.useful_s,
                                          "allocated_s": lg.allocated_s, "merged": lg.merged}
                                    for lid, lg in g.per_learner.items()}},
        "uptime": {"value": u.value, "window_s": u.window_s, "start_s": rel(u.start),
                   "end_s": rel(u.end), "windows": u.windows, "advanced": u.advanced,
                   "longest_stall_s": stall.seconds if stall else None},
        "faults": [{"t_s": rel(e.t), "event": e.index, "fault": e.get("fault"),
                    "target": e.get("target"), "action": e.get("action"),
                    "detail": e.get("detail")}
                   for e in events if e.source == HARNESS and e.kind == "fault"],
        "faults_skipped": [{"t_s": rel(e.t), "event": e.index, "fault": e.get("fault"),
                            "target": e.get("target"), "reason": e.get("reason")}
                           for e in events if e.source == HARNESS and e.kind == "fault_skipped"],
        "fault_spans": spans,
        "learners": _learner_table(events),
        "versions": {str(p): v for p, v in sorted(_final_versions(events).items())},
        "commits": sum(1 for e in events if e.source == COORDINATOR and e.kind == "commit"),
    }


def _learner_table(events: Sequence[Event]) -> dict[str, dict[str, Any]]:
    acked: dict[str, set[tuple[int, int]]] = defaultdict(set)
    merged: Counter[str] = Counter()
    dropped: dict[str, Counter[str]] = defaultdict(Counter)
    evals: dict[str, list[float]] = defaultdict(list)
    starts: Counter[str] = Counter()
    unsent: Counter[str] = Counter()
    catch_ups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.source == COORDINATOR and e.kind == "push_ack":
            acked[e.learner].add((e.integer("fragment"), e.integer("seq")))
        elif e.source == COORDINATOR and e.kind == "commit":
            for cid in e.manifest():
                merged[cid.learner_id] += 1
        elif e.source == HARNESS and e.kind == "process_start":
            starts[str(e.get("name"))] += 1
        elif e.source in (COORDINATOR, HARNESS):
            continue
        elif e.kind == "dropped":
            dropped[e.learner][str(e.get("reason"))] += 1
        elif e.kind == "eval":
            evals[e.learner].append(e.number("loss"))
        elif e.kind == "push_unsent":
            unsent[e.learner] += 1
        elif e.kind == "catch_up":
            sources = e.get("sources")
            sources = sources if isinstance(sources, dict) else {}
            catch_ups[e.learner].append({
                "seconds": e.number("seconds"), "fragments": len(sources),
                "from_peers": sum(1 for source in sources.values() if source != "coordinator")})
    table = {}
    for lid in learner_ids(events):
        losses = evals.get(lid, [])
        table[lid] = {"eval_start": losses[0] if losses else None,
                      "eval_end": losses[-1] if len(losses) > 1 else None,
                      "acknowledged": len(acked.get(lid, ())), "merged": merged[lid],
                      "dropped": dict(dropped.get(lid, {})), "push_unsent": unsent[lid],
                      "restarts": max(starts[lid] - 1, 0),
                      "catch_ups": catch_ups.get(lid, [])}
    return table


def _final_versions(events: Sequence[Event]) -> dict[int, int]:
    versions: dict[int, int] = {}
    for e in events:
        if e.source != COORDINATOR:
            continue
        if e.kind == "init":
            versions.setdefault(e.integer("fragment"), 0)
        elif e.kind == "commit":
            p = e.integer("fragment")
            versions[p] = max(versions.get(p, 0), e.integer("version"))
        elif e.kind in ("resume", "elected"):
            for p, v in versions_of(e).items():
                versions[p] = max(versions.get(p, v), v)
    return versions


# -- plots -------------------------------------------------------------------------------


def _mark_faults(ax: Axes, spans: Sequence[FaultSpan], t0: float, end: float,
                 label: bool = True) -> None:
    """Shade each fault's span, draw a line where it hit, and name it at the top."""
    for span in spans:
        color = _FAULT_COLORS.get(span.fault, "tab:gray")
        start = span.start - t0
        stop = (span.end if span.end is not None else end) - t0
        if stop > start:
            ax.axvspan(start, stop, color=color, alpha=0.12, linewidth=0)
        ax.axvline(start, color=color, linestyle="--", linewidth=0.8, alpha=0.8)
        if label:
            ax.annotate(f"{span.fault} {span.target}", xy=(start, 1.0),
                        xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", rotation=90, va="top", ha="left",
                        fontsize=6, color=color)


def _figure(rows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(10, 3.2 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)
    return fig, [axes[i][0] for i in range(rows)]


def _plot_loss(events: Sequence[Event], spans: Sequence[FaultSpan], t0: float,
               path: Path) -> None:
    _, end = run_bounds(events)
    fig, (ax,) = _figure()
    trains: dict[str, list[tuple[float, float]]] = defaultdict(list)
    evals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.source in (COORDINATOR, HARNESS) or not e.has("loss"):
            continue
        if e.kind == "train":
            trains[e.learner].append((e.t - t0, e.number("loss")))
        elif e.kind == "eval":
            evals[e.learner].append((e.t - t0, e.number("loss")))
    for i, lid in enumerate(learner_ids(events)):
        color = f"C{i % 10}"
        if trains.get(lid):
            xs, ys = zip(*trains[lid], strict=True)
            ax.plot(xs, ys, color=color, linewidth=1, label=f"{lid} train")
        if evals.get(lid):
            xs, ys = zip(*evals[lid], strict=True)
            ax.scatter(xs, ys, color=color, marker="D", s=28, edgecolors="black",
                       linewidths=0.5, zorder=3, label=f"{lid} eval")
    _mark_faults(ax, spans, t0, end)
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("loss")
    ax.set_title("Learner loss (lines: train, diamonds: held-out eval)")
    if trains or evals:
        ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def _plot_versions(events: Sequence[Event], spans: Sequence[FaultSpan], t0: float,
                   path: Path) -> None:
    _, end = run_bounds(events)
    fig, (ax,) = _figure()
    series: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        if e.source != COORDINATOR:
            continue
        if e.kind == "init":
            series[e.integer("fragment")].append((e.t - t0, 0))
        elif e.kind == "commit":
            series[e.integer("fragment")].append((e.t - t0, e.integer("version")))
        elif e.kind in ("resume", "elected"):
            for p, v in versions_of(e).items():
                series[p].append((e.t - t0, v))
    for p in sorted(series):
        points = [*series[p], (end - t0, series[p][-1][1])]  # a version holds to the end
        xs, ys = zip(*points, strict=True)
        ax.step(xs, ys, where="post", linewidth=1.2, label=f"fragment {p}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _mark_faults(ax, spans, t0, end)
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("committed version")
    ax.set_title("Fragment versions (coordinator commits)")
    if series:
        ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def _plot_goodput(events: Sequence[Event], spans: Sequence[FaultSpan], t0: float,
                  window_s: float, summary: dict[str, Any], path: Path) -> None:
    _, end = run_bounds(events)
    windows = metrics.timeline(events, window_s)
    fig, (top, bottom) = _figure(rows=2)
    mids = [(w.start + w.end) / 2 - t0 for w in windows]
    widths = [w.end - w.start for w in windows]
    top.bar(mids, [w.goodput for w in windows], width=widths, color="tab:green", alpha=0.7,
            label="goodput per window")
    top.axhline(summary["goodput"]["value"], color="tab:green", linestyle=":",
                label=f"run goodput {summary['goodput']['value']:.3f}")
    top.set_ylim(0, 1.05)
    top.set_ylabel("goodput")
    top.legend(fontsize=7, loc="upper right")
    _mark_faults(top, spans, t0, end)
    uptime = summary["uptime"]
    lo, hi = uptime["start_s"], uptime["end_s"]
    colors = ["tab:blue" if w.advanced
              else ("tab:red" if lo is not None and lo <= m <= hi else "lightgray")
              for w, m in zip(windows, mids, strict=True)]
    bottom.bar(mids, [max(w.commits, 0.15) if lo is not None and lo <= m <= hi else w.commits
                      for w, m in zip(windows, mids, strict=True)],
               width=widths, color=colors)
    bottom.set_ylabel("commits per window")
    bottom.set_xlabel("time since run start (s)")
    bottom.set_title(f"Model advanced in blue windows, stalled in red: uptime "
                     f"{uptime['value']:.3f}", fontsize=9)
    _mark_faults(bottom, spans, t0, end, label=False)
    top.set_title(f"Goodput per {window_s:g}s window", fontsize=9)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


# -- markdown ----------------------------------------------------------------------------


def _cell(value: Any) -> str:
    text = "—" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
    return text.replace("|", "\\|").replace("\n", " ")


def _markdown(summary: dict[str, Any], results: Sequence[CheckResult]) -> str:
    run, g, u = summary["run"], summary["goodput"], summary["uptime"]
    passed = sum(r.passed for r in results)
    lines = [
        f"# Chaos run: {summary['experiment']}",
        "",
        f"**{'PASS' if summary['passed'] else 'FAIL'}**: {passed} of {len(results)} checks "
        f"passed. Goodput **{g['value']:.3f}** ({g['useful_s']:.1f} s of learner work reached "
        f"the model, of {g['allocated_s']:.1f} s allocated); uptime **{u['value']:.3f}** "
        f"({u['advanced']} of {u['windows']} windows of {u['window_s']:g} s advanced the model).",
        "",
        f"The schedule allows goodput **{g['bound']:.3f}** at best (1 − scripted down time / "
        f"allocated). Allocated time that did not reach the model: "
        + ", ".join(f"{name} {share:.3f}" for name, share in g["losses"].items()) + ".",
        "",
        f"Seed {_cell(run['seed'])}, mode {_cell(run['mode'])}, {len(run['learners'])} learners "
        f"({', '.join(run['learners'])}), {run['fragments']} fragments, "
        f"{run['duration_s']:.1f} s, ended: {_cell(run['end_reason'])}. "
        f"{run['events']} events, {summary['commits']} commits, final versions: "
        + (", ".join(f"fragment {p} v{v}" for p, v in summary["versions"].items()) or "none")
        + ".",
    ]
    if run["skipped_lines"]:
        lines.append(f"{run['skipped_lines']} unparsable log lines were skipped "
                     "(cut short by a killed process).")
    lines += ["", "## Checks", "", "| check | verdict | message | events |",
              "| --- | --- | --- | --- |"]
    for r in results:
        named = ", ".join(f"#{i}" for i in r.events)
        lines.append(f"| {r.name} | {'pass' if r.passed else '**FAIL**'} | {_cell(r.message)} "
                     f"| {named} |")
    lines += ["", "## Faults injected", ""]
    if summary["faults"]:
        lines += ["| t (s) | fault | target | action | detail | event |",
                  "| ---: | --- | --- | --- | --- | --- |"]
        for f in summary["faults"]:
            lines.append(f"| {f['t_s']:.2f} | {_cell(f['fault'])} | {_cell(f['target'])} | "
                         f"{_cell(f['action'])} | {_cell(f['detail'] or '')} | #{f['event']} |")
        troubled = [s for s in summary["fault_spans"] if not s["survived"]]
        if troubled:
            lines += ["", "Failed checks naming events during a fault or within "
                      f"{ATTRIBUTION_MARGIN_S:g} s after it healed:", ""]
            lines += [f"- {s['fault']} {s['target']} at {s['start_s']:.2f} s: "
                      f"{', '.join(s['failed_checks_nearby'])}" for s in troubled]
    else:
        lines.append("None.")
    if summary["faults_skipped"]:
        lines += ["", "Skipped: " + "; ".join(
            f"{f['fault']} {f['target']} at {f['t_s']:.2f} s ({f['reason']})"
            for f in summary["faults_skipped"])]
    lines += ["", "## Learners", "",
              "| learner | eval start | eval end | acknowledged | merged | dropped | restarts "
              "| catch-ups after restarts | goodput |",
              "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    for lid, row in summary["learners"].items():
        dropped = ", ".join(f"{k}: {v}" for k, v in sorted(row["dropped"].items())) or "0"
        lg = g["per_learner"].get(lid)
        caught = "; ".join(f"{c['seconds']:.2f} s, {c['from_peers']}/{c['fragments']} "
                           f"fragments from peers" for c in row["catch_ups"][1:]) or "-"
        lines.append(f"| {lid} | {_cell(row['eval_start'])} | {_cell(row['eval_end'])} | "
                     f"{row['acknowledged']} | {row['merged']} | {dropped} | {row['restarts']} "
                     f"| {caught} | {_cell(lg['goodput'] if lg else None)} |")
    lines += ["", "## Plots", "",
              "Dashed lines mark when a fault was injected, shading how long it lasted.", "",
              "![Learner loss over time](loss.png)", "",
              "![Fragment versions over time](versions.png)", "",
              "![Goodput and uptime per window](goodput.png)", "",
              "Details: [summary.json](summary.json); the merged log is `events.jsonl`; "
              "`#N` is its line N + 1.", ""]
    return "\n".join(lines)
