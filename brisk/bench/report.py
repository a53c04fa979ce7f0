"""Run records: what machine and server a run measured, the JSON file it is saved to, and the text table."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
from typing import Any

import httpx

from brisk.host import cpu_info

SCHEMA_VERSION = 1


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine_info() -> dict[str, Any]:
    """The machine the benchmark client ran on (the server's GPUs show only when it is the same machine)."""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_info().model_name,
        "cpu_count": os.cpu_count(),
        "gpus": _gpus(),
    }


def server_info(http: httpx.Client, base_url: str, models: list[dict]) -> dict[str, Any]:
    """Which server this is: /v1/models' `owned_by` names it (brisk, vllm, sglang, llamacpp...), /version its
    version where the server has that route."""
    version: Any = None
    try:
        response = http.get(f"{base_url}/version")
        if response.status_code == 200:
            body = response.json()
            version = body.get("version", body) if isinstance(body, dict) else body
    except (httpx.HTTPError, ValueError):
        pass
    owned_by = models[0].get("owned_by") if models else None
    return {"name": owned_by, "version": version}


def run_label(run: dict[str, Any]) -> str:
    if run.get("label"):
        return str(run["label"])
    server = run.get("server") or {}
    name = " ".join(str(part) for part in (server.get("name"), server.get("version")) if part)
    return f"{run.get('model')} ({name})" if name else str(run.get("model"))


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "run"


def write_json(run: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(run, f, indent=1)
        f.write("\n")


def load_run(path: str) -> dict[str, Any]:
    with open(path) as f:
        run = json.load(f)
    if not isinstance(run, dict) or not isinstance(run.get("points"), list):
        raise ValueError(f"{path}: not a `brisk bench serve` result (no 'points' list)")
    return run


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


# (header, how to read it from a point, decimals)
COLUMNS: tuple[tuple[str, Any, int], ...] = (
    ("conc", lambda p: p["concurrency"] or "inf", 0),
    ("rate", lambda p: p["request_rate"] or "inf", 2),
    ("ok", lambda p: p["completed"], 0),
    ("fail", lambda p: p["failed"], 0),
    ("req/s", lambda p: p["request_throughput"], 2),
    ("out tok/s", lambda p: p["output_throughput"], 1),
    ("tok/s/gpu", lambda p: p["output_throughput_per_gpu"], 1),
    ("tok/s/user", lambda p: p["output_throughput_per_user"], 1),
    ("ttft p50", lambda p: p["ttft_ms"]["p50"], 1),
    ("ttft p99", lambda p: p["ttft_ms"]["p99"], 1),
    ("tpot mean", lambda p: p["tpot_ms"]["mean"], 2),
    ("itl p50", lambda p: p["itl_ms"]["p50"], 2),
    ("itl p99", lambda p: p["itl_ms"]["p99"], 2),
    ("e2e p50", lambda p: p["e2e_ms"]["p50"], 1),
    ("e2e p99", lambda p: p["e2e_ms"]["p99"], 1),
)


def format_table(points: list[dict[str, Any]]) -> str:
    """Aligned text, one row per point; latencies in ms."""
    rows = [[header for header, _, _ in COLUMNS]]
    rows += [[_fmt(read(p), digits) for _, read, digits in COLUMNS] for p in points]
    return _aligned(rows)


def _aligned(rows: list[list[str]]) -> str:
    """Right-aligned columns, the first row a header underlined."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_multi_turn(summary: dict[str, Any]) -> str:
    """A multi-turn point: the prompt tokens computed vs served from the prefix cache, the server's counters read,
    then one row per turn index (latencies in ms)."""
    cached = summary["cached_tokens"]
    lines = [
        f"{summary['conversations']} conversations x {summary['turns']} turns; prompt tokens {summary['prompt_tokens']:,}"
        + (
            f", computed {summary['computed_tokens']:,}, served from the prefix cache {cached:,}"
            if cached is not None
            else " (the server reports no cached tokens)"
        )
        + f"; mean TTFT {_fmt(summary['mean_ttft_ms'])} ms"
    ]
    counters = summary["server_counters"]
    if counters:
        lines.append("server /metrics over the point: " + ", ".join(f"{k} {v:,.0f}" for k, v in counters.items()))
    rows = [["turn", "requests", "ok", "prompt tok", "cached tok", "ttft mean", "ttft p50", "ttft p99"]]
    for t in summary["by_turn"]:
        rows.append(
            [
                str(t["turn"] + 1),
                str(t["requests"]),
                str(t["completed"]),
                _fmt(t["mean_prompt_tokens"]),
                _fmt(t["mean_cached_tokens"]),
                _fmt(t["ttft_ms"]["mean"]),
                _fmt(t["ttft_ms"]["p50"]),
                _fmt(t["ttft_ms"]["p99"]),
            ]
        )
    return "\n".join([*lines, "", _aligned(rows)])
