"""The JSON record a benchmark writes beside its table: when, where, with what arguments, and its figures."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path
from typing import Any


def write_record(out: str | Path, args: argparse.Namespace, **figures: Any) -> None:
    """Write {date (UTC), machine (the CPU's name), args, **figures} to `out` (its folder made) and say so."""
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "args": vars(args),
        **figures,
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
