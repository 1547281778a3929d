"""On-disk profile cache: one JSON file per segment structure, entries keyed by mesh and device.

`<folder>/<structure hash>.json` holds {"schema": 1, "structure": ..., "entries": [profile, ...]};
an entry matches when its segment key (structure and candidates), mesh shape, device kind and
mode (measured or analytic) all match. `<folder>/runs.json` lists which graphs were profiled on
which mesh and device, so a search pointed at a cache made for another mesh says so (a graph's
segments themselves depend on the mesh). Files are written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.errors import PlanValidationError
from meshplan.files import write_json_atomic

if TYPE_CHECKING:
    from meshplan.cfp.profile import SegmentProfile

SCHEMA = 1


class ProfileCache:
    """Profiles kept in `folder` between runs."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, structure: str) -> Path:
        return self.folder / f"{structure}.json"

    def load(self, structure: str, key: str, mesh: tuple[int, ...], device: str, mode: str
             ) -> SegmentProfile | None:
        """The matching profile, or None when this mesh and device have none yet.

        Raises:
            PlanValidationError: the file is unreadable or of another schema.
        """
        for entry in self._entries(structure):
            if (entry.key, entry.mesh, entry.device, entry.mode) == (key, tuple(mesh), device, mode):
                return entry
        return None

    def require(self, structure: str, key: str, mesh: tuple[int, ...], device: str, mode: str,
                what: str) -> SegmentProfile:
        """The matching profile; a missing one is an error that says what the cache holds."""
        hit = self.load(structure, key, mesh, device, mode)
        if hit is not None:
            return hit
        raise PlanValidationError(f"the profile cache {self.folder} has no profile of {what} for "
                                  f"{_describe(mesh, device, mode)}; run --mode profile (or all) first, with the "
                                  f"same model, batch, mesh and --cache")

    def record_run(self, graph: str, name: str, mesh: tuple[int, ...], device: str, mode: str) -> None:
        """Note that every segment of graph `graph` (its structural hash) is profiled for this key."""
        runs = self._runs()
        entry = {"graph": graph, "name": name, "mesh": list(mesh), "device": device, "mode": mode}
        if entry not in runs:
            write_json_atomic(self.folder / "runs.json", {"schema": SCHEMA, "runs": [*runs, entry]})

    def check_run(self, graph: str, name: str, mesh: tuple[int, ...], device: str, mode: str) -> None:
        """Raise unless graph `graph` was profiled into this cache for this mesh, device and mode."""
        runs = [r for r in self._runs() if r["graph"] == graph]
        here = _describe(mesh, device, mode)
        if any((tuple(r["mesh"]), r["device"], r["mode"]) == (tuple(mesh), device, mode) for r in runs):
            return
        if runs:
            others = ", ".join(sorted({_describe(r["mesh"], r["device"], r["mode"]) for r in runs}))
            raise PlanValidationError(
                f"the profile cache {self.folder} holds profiles of {name} for {others}, not for {here}: it was "
                f"made for another mesh or device. Profile this mesh first (--mode profile or all), or point "
                f"--cache at a folder profiled for {here}")
        raise PlanValidationError(f"the profile cache {self.folder} has no profiles of {name} for {here}; run "
                                  f"--mode profile (or all) first, with the same model, batch, mesh and --cache")

    def store(self, profile: SegmentProfile) -> None:
        """Add `profile`, replacing an entry with the same key, mesh, device and mode."""
        same = lambda e: (e.key, e.mesh, e.device, e.mode) == (profile.key, profile.mesh, profile.device,
                                                               profile.mode)
        entries = [e for e in self._entries(profile.structure) if not same(e)] + [profile]
        write_json_atomic(self.path(profile.structure), {"schema": SCHEMA, "structure": profile.structure,
                                                         "entries": [e.to_dict() for e in entries]})

    def _runs(self) -> list[dict]:
        return self._read(self.folder / "runs.json").get("runs", [])

    def _entries(self, structure: str) -> list[SegmentProfile]:
        from meshplan.cfp.profile import SegmentProfile

        return [SegmentProfile.from_dict(e) for e in self._read(self.path(structure)).get("entries", [])]

    @staticmethod
    def _read(path: Path) -> dict:
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanValidationError(f"profile cache file {path} is unreadable ({exc}); delete it to "
                                      f"profile again") from None
        if data.get("schema") != SCHEMA:
            raise PlanValidationError(f"profile cache file {path} has schema {data.get('schema')!r}, this "
                                      f"meshplan reads {SCHEMA}; delete it to profile again")
        return data


def _describe(mesh, device: str, mode: str) -> str:
    where = " (analytic)" if mode == "analytic" else f" on {device} (measured)"
    return f"mesh {'x'.join(map(str, mesh))}{where}"
