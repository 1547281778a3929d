"""Reading a plan for a report: a plan file or a runtime `dump_debug_info` folder, checked on load
(one clear PlanValidationError naming the file; never a traceback)."""

from __future__ import annotations

from pathlib import Path

from meshplan.errors import PlanValidationError
from meshplan.plan import Plan

PLAN_FILE = "plan.json"


def load_plan(path: str | Path) -> Plan:
    """The Plan in `path`: a JSON plan file (`meshplan simulate --out`, `meshplan intra --out`) or a
    folder written by `dump_debug_info` (its plan.json).

    Raises:
        PlanValidationError: no such file, not a plan, a schema version this meshplan does not
            read, or a truncated or malformed file; the message names the file.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / PLAN_FILE).is_file():
            raise PlanValidationError(f"{path} is a folder without {PLAN_FILE}; give a plan file or a folder written "
                                      "by dump_debug_info")
        path = path / PLAN_FILE
    if not path.is_file():
        raise PlanValidationError(f"no plan file {str(path)!r}; write one with `meshplan simulate --out FILE`")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanValidationError(f"cannot read plan file {str(path)!r} ({exc})") from None
    try:
        return Plan.from_json(text)
    except PlanValidationError as exc:
        raise PlanValidationError(f"{path}: {exc}") from None
