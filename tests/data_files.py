"""Where the tests find their input files: tests/data in the repository, and the larger IOPDDL
instances in ../shared/iopddl beside it (present in CI, absent from a plain clone)."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"
IOPDDL = DATA / "iopddl"
SHARED_IOPDDL = Path(__file__).resolve().parents[2] / "shared" / "iopddl"


def iopddl_instance(name: str) -> Path:
    """The contest instance `name` (e.g. "B"), from tests/data, else ../shared; skips when neither has it."""
    file = f"asplos-2025-iopddl-{name}.json.gz"
    for folder in (IOPDDL, SHARED_IOPDDL):
        if (folder / file).exists():
            return folder / file
    pytest.skip(f"IOPDDL instance {name} needs ../shared/iopddl beside the repository (absent here)")
