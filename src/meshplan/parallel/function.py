"""ParallelizedFunction: the skeleton every parallelized function shares.

A call is first bound to the function's signature (meshplan.parallel.call: keyword arguments,
static arguments, nnx objects as their state); the bound slots are planned and compiled once per
input signature (pytree structure with the static values, shapes, dtypes) and the result
cached; `get_plan` returns the last call's plan and `dump_debug_info` writes what the last call
planned and compiled. Subclasses say how to run the slots (`_run`), how to build (`_build`),
what the plan is (`_plan_of`) and which debug files to write (`_debug_files`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from meshplan.cluster.costs import DeviceCosts
from meshplan.errors import OptionsError
from meshplan.files import write_json_atomic, write_text_atomic
from meshplan.launch.progress import building, report_call
from meshplan.parallel.call import CallForm
from meshplan.runtime.abstract import signature

Compiled = TypeVar("Compiled")
DebugFile = str | dict[str, Any]  # text, or a JSON-ready value


class ParallelizedFunction(Generic[Compiled]):
    """A function planned and compiled per input signature; call it like the original.

    Attributes:
        call: how calls bind (signature, static arguments).
        fn: the function that is traced, of the bound slots (`call.traced`).
    """

    def __init__(self, fn: Callable[..., Any] | CallForm, method: Any, devices: Sequence[Any] | None,
                 costs: DeviceCosts | None = None) -> None:
        self.call = fn if isinstance(fn, CallForm) else CallForm.of(fn)
        self.fn, self.method = self.call.traced, method
        self.costs = costs or DeviceCosts()
        self.devices = None if devices is None else tuple(devices)
        self._cache: dict[Any, Compiled] = {}
        self._last: Compiled | None = None
        self.__name__ = self.call.name
        self.__doc__ = getattr(self.call.fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run as the original would be called: positional and keyword arguments, static ones as
        given to parallelize; nnx objects passed in are updated in place."""
        call = self.call.bind(args, kwargs)
        return call.finish(self._run(call.slots))

    def get_plan(self) -> Any:
        """The plan of the last call.

        Raises:
            OptionsError: the function has not been called yet.
        """
        return self._plan_of(self._require_last())

    def dump_debug_info(self, folder: str | Path) -> tuple[Path, ...]:
        """Write what the last call planned and compiled into `folder` (each file atomically);
        return the paths."""
        folder = Path(folder)
        paths = []
        for name, content in self._debug_files(self._require_last()).items():
            paths.append(folder / name)
            if isinstance(content, str):
                write_text_atomic(paths[-1], content)
            else:
                write_json_atomic(paths[-1], content)
        return tuple(paths)

    def _require_last(self) -> Compiled:
        if self._last is None:
            raise OptionsError(f"{self.__name__} has no plan yet; call it once with example arguments first")
        return self._last

    def _compiled(self, args: tuple[Any, ...]) -> Compiled:
        """The cached build for `args`' signature, built on first sight; it becomes the last."""
        key = signature(args)
        report_call()  # under `meshplan launch`, progress for its hang watch (every call, in every process)
        if key not in self._cache:
            with building():
                self._cache[key] = self._build(args)
        self._last = self._cache[key]
        return self._last

    def _run(self, slots: tuple[Any, ...]) -> Any:
        """The results of `self.fn(*slots)`, run as planned."""
        raise NotImplementedError

    def _build(self, args: tuple[Any, ...]) -> Compiled:
        raise NotImplementedError

    def _plan_of(self, compiled: Compiled) -> Any:
        raise NotImplementedError

    def _debug_files(self, compiled: Compiled) -> dict[str, DebugFile]:
        raise NotImplementedError
