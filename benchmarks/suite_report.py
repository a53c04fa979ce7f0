"""benchmarks/gpu_suite.py's phase f: DIR/report.json (everything) and DIR/report.md (tables per phase)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(out: Path, report: dict[str, Any]) -> None:
    for name, text in (("report.json", json.dumps(report, indent=1, default=str)), ("report.md", markdown(report))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


def markdown(report: dict[str, Any]) -> str:
    suite = report.get("suite", {})
    phases = report.get("phases", {})
    env = phases.get("env", {}) if suite.get("plan") == "quick" else phases.get("a", {})
    device = env.get("ceilings", {}).get("device", "unknown (the environment step did not run)")
    order = [x for x in suite.get("order", []) if x in phases] + sorted(set(phases) - set(suite.get("order", [])))
    window = f"; the quick plan's window: {suite['window_s']:.0f} s" if suite.get("window_s") else ""
    lines = [
        "# brisk GPU suite report",
        "",
        f"- command: `{suite.get('command', '')}`",
        f"- started: {suite.get('started', '')} (UTC){'; --smoke: toy sizes on the CPU' if suite.get('smoke') else ''}",
        f"- device: {device}{window}",
        *(f"- logs.tar.gz holds only the end of {x}" for x in suite.get("logs_cut", [])),
        "",
        "| phase | what | status | seconds | budget |",
        "|---|---|---|---|---|",
    ]
    for letter in order:
        p = phases[letter]
        lines.append(
            f"| {letter} | {p.get('title', '')} | {p.get('status', '')} | {p.get('seconds', '')} | {p.get('budget_s', '')} |"
        )
    for letter in order:
        p = phases[letter]
        lines += ["", f"## {letter}. {p.get('title', '')}: {p.get('status', '')}", ""]
        for note in p.get("notes", []):
            lines.append(f"- {note}")
        for section in p.get("sections", []):
            lines += ["", f"### {section['title']}", "", f"command: `{section['command']}`", ""]
            if section.get("note"):
                lines += [section["note"], ""]
            lines += table(section["rows"])
        if p.get("log_tail"):
            lines += ["", f"last lines of {p.get('log', 'the log')}:", "", "```", p["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        out.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")
