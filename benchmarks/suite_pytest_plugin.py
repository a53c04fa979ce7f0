"""A pytest plugin for benchmarks/gpu_suite.py's phase b: one JSON line per test outcome, written as each test
ends, so a pytest run stopped by the phase's time budget still leaves the results of every test that finished.

    python -m pytest -p suite_pytest_plugin --suite-results DIR/b_results.jsonl tests/...
"""

from __future__ import annotations

import json


def pytest_addoption(parser):
    parser.addoption("--suite-results", help="append one JSON line per test outcome to this file")


def pytest_configure(config):
    path = config.getoption("--suite-results")
    if path:
        config.pluginmanager.register(_Writer(path), "suite_results_writer")


class _Writer:
    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report):
        # A test's outcome: its call, or a setup that skipped or failed it, or a teardown that failed.
        if not (report.when == "call" or (report.when == "setup" and not report.passed) or report.failed):
            return
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        detail = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            detail = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or report.longreprtext or ""
            detail = crash.strip().splitlines()[0][:200] if crash.strip() else ""
        line = dict(test=report.nodeid, result=outcome, seconds=round(report.duration, 3), detail=detail)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
