"""Tests find their input files through tests/data_files.py only, so a plain clone of the repository
(no ../shared beside it) passes: the data they need is in tests/data, the rest skips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from data_files import IOPDDL

TESTS = Path(__file__).resolve().parent
# a path climbing out of the repository from the tests' folder, or naming the ../shared folder
_OUTSIDE = re.compile(r"parents\[[2-9]\]|\.\./shared|[\"']shared[\"']")
_ALLOWED = {"data_files.py", Path(__file__).name}


def test_only_data_files_looks_outside_the_repository():
    offenders = [f"{path.name}:{n}" for path in sorted(TESTS.glob("*.py")) if path.name not in _ALLOWED
                 for n, line in enumerate(path.read_text().splitlines(), 1) if _OUTSIDE.search(line)]
    assert not offenders, f"read test inputs through tests/data_files.py, not from outside the repo: {offenders}"


@pytest.mark.data
def test_repository_holds_the_small_fixtures():
    readme = (TESTS / "data" / "README.md").read_text()
    for path in IOPDDL.iterdir():
        assert path.name in readme, f"tests/data/README.md does not name the source of {path.name}"
    assert (IOPDDL / "example.json").exists() and (IOPDDL / "asplos-2025-iopddl-B.json.gz").exists()
