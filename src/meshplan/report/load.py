"""Reading a plan for a report: a plan file or a runtime `dump_debug_info` folder, checked on load
(one clear PlanValidationError naming the file; never a traceback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshplan.errors import PlanValidationError
from meshplan.plan import Plan

PLAN_FILE = "plan.json"
COLLECTIVES_FILE = "collectives.json"


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


def load_collectives(path: str | Path) -> dict[str, Any] | None:
    """The planned-vs-compiled collectives a `dump_debug_info` folder holds (collectives.json);
    None for a plan file or a folder without one (pipelined functions, older dumps).

    Raises:
        PlanValidationError: the file is there but truncated, malformed or missing a field.
    """
    path = Path(path) / COLLECTIVES_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        for key in ("backend", "agrees", "normalisation", "rows", "missing", "unplanned"):
            data[key]  # noqa: B018  (a KeyError names the missing field)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PlanValidationError(f"{path}: not a collectives file written by dump_debug_info "
                                  f"({type(exc).__name__}: {exc}); write it again with dump_debug_info") from None
    return data
