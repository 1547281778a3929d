"""How a parallelized function is called: `f(*args, **kwargs)` -> the *slots* that are traced, planned and cached.

A call is bound to the function's signature, as `jax.jit` binds it, and becomes one tuple of
slots in a fixed order: the positional parameters, the keyword-only parameters, then extra
`*args` and extra `**kwargs` (sorted by name). Whether an argument came by position or by keyword
does not matter: `step(state, batch=b)` and `step(state, b)` give the same slots. A parameter the
caller left out is a `Missing` slot (its default applies inside the trace), a static argument a
`Static` slot; both are pytree nodes without leaves whose value is part of the tree structure,
so a new static value is a new input signature, hence a new plan and compile (cached like any
other), while the traced function (`CallForm.traced`) stays one function for every call. Flax nnx
objects among the arguments become their state (meshplan.parallel.nnx_objects); the traced
function then returns `(new states, results)` and `BoundCall.finish` writes the states back.

Positions given to `parallelize` (`static_argnums`, `batch_argnums`, `donate_argnums`) count
positional parameters, as in `jax.jit`; names (`static_argnames`, `batch_argnames`,
`donate_argnames`) name parameters; `CallForm.slot` turns either into a slot index.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax

from meshplan.errors import OptionsError
from meshplan.parallel.nnx_objects import check_no_objects, merge_objects, split_objects, states_of, write_back


@dataclass(frozen=True, slots=True, eq=False)
class Static:
    """A static argument's slot: no leaves; the value (hashable) keys the plan cache."""

    value: Any

    def __eq__(self, other: object) -> bool:  # 1, 1.0 and True trace differently: the type counts too
        return isinstance(other, Static) and type(other.value) is type(self.value) and other.value == self.value

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))


@dataclass(frozen=True, slots=True)
class Missing:
    """The slot of a parameter the caller left out: its default applies."""


@dataclass(frozen=True, slots=True)
class Keyword:
    """The slot of an extra keyword argument (one the function takes through `**kwargs`)."""

    name: str
    value: Any


jax.tree_util.register_static(Static)
jax.tree_util.register_static(Missing)
jax.tree_util.register_pytree_with_keys(
    Keyword, lambda k: (((jax.tree_util.GetAttrKey(k.name), k.value),), k.name),
    lambda name, children: Keyword(name, children[0]), flatten_func=lambda k: ((k.value,), k.name))
MISSING = Missing()


@dataclass(frozen=True, slots=True)
class BoundCall:
    """One call as slots.

    Attributes:
        slots: what the parallelized program takes (`CallForm.traced(*slots)`).
        objects: the caller's nnx objects, whose new state the program returns first.
    """

    slots: tuple[Any, ...]
    objects: tuple[Any, ...]

    def finish(self, result: Any) -> Any:
        """The caller's result: with nnx objects, their new state written back and the step's own results."""
        if not self.objects:
            return result
        states, result = result
        write_back(self.objects, states)
        return result


@dataclass(frozen=True, slots=True)
class CallForm:
    """A function's call signature and its static arguments.

    Attributes:
        fn: the Python function (a `jax.jit`/`nnx.jit` wrapper already unwrapped).
        name: its name, for messages.
        positional: names of its positional parameters (the first slots).
        keyword_only: names of its keyword-only parameters (the next slots).
        signature: its signature; None when Python cannot tell it (every argument is then an
            extra positional or keyword slot).
        static_argnums, static_argnames: the static arguments, by position and by name.
    """

    fn: Callable[..., Any]
    name: str
    positional: tuple[str, ...]
    keyword_only: tuple[str, ...]
    signature: inspect.Signature | None
    static_argnums: frozenset[int]
    static_argnames: frozenset[str]

    @classmethod
    def of(cls, fn: Callable[..., Any], static_argnums: Iterable[int] | int = (),
           static_argnames: Iterable[str] | str = ()) -> CallForm:
        """The call form of `fn`; a `jax.jit`- or `nnx.jit`-decorated function is unwrapped and its
        own static arguments kept.

        Raises:
            OptionsError: a static position or name that `fn` does not have.
        """
        fn, jit_nums, jit_names = _unwrap_jit(fn)
        nums, names = frozenset(_ints(static_argnums) + jit_nums), frozenset(_strs(static_argnames) + jit_names)
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # e.g. some builtins: every argument is an extra one
            signature = None
        params = () if signature is None else tuple(signature.parameters.values())
        form = cls(fn, getattr(fn, "__name__", "parallelized"),
                   tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
                   tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY), signature, nums, names)
        form._check_static()
        return form

    def slot(self, key: int | str, option: str) -> int:
        """The slot index of a parameter given by position (a positional argument, counted from 0)
        or by name, for `parallelize(..., option=...)`.

        Raises:
            OptionsError: a negative position, or a name that is not a parameter.
        """
        if isinstance(key, str):
            if key in self.positional:
                return self.positional.index(key)
            if key in self.keyword_only:
                return len(self.positional) + self.keyword_only.index(key)
            raise OptionsError(f"parallelize(..., {option}=...): {self.name} has no parameter named {key!r}; "
                               f"its parameters are {self._parameters()}")
        if not isinstance(key, int) or key < 0:
            raise OptionsError(f"parallelize(..., {option}=...): {key!r} is not an argument position; positions "
                               f"count {self.name}'s positional arguments from 0")
        return key if key < len(self.positional) else key + len(self.keyword_only)

    def slot_indices(self, nums: Iterable[int] | int | None, names: Iterable[str] | str,
                     option: str) -> tuple[int, ...]:
        """Slot indices of the parameters given by position and by name (in that order, no repeats)."""
        found = [self.slot(n, option) for n in _ints(nums or ())] + [self.slot(n, option) for n in _strs(names)]
        return tuple(dict.fromkeys(found))

    def slot_name(self, index: int) -> str:
        """The parameter a slot index stands for ("args[3]" for an extra positional argument)."""
        named = self.positional + self.keyword_only
        return named[index] if index < len(named) else f"args[{index - len(self.keyword_only)}]"

    def static_slots(self) -> tuple[int, ...]:
        """Slot indices of the static parameters that have one (not extra `**kwargs`)."""
        names = [n for n in self.static_argnames if n in self.positional or n in self.keyword_only]
        return self.slot_indices(tuple(self.static_argnums), names, "static_argnums")

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BoundCall:
        """One call's slots.

        Raises:
            OptionsError: the arguments do not fit the signature, or a static one is not hashable.
        """
        if self.signature is None:
            given, extra_args, extra_kwargs = {}, args, kwargs
        else:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise OptionsError(f"{self.name}{self.signature} cannot be called with these arguments: {e}") from None
            given, extra_args, extra_kwargs = dict(bound.arguments), (), {}
            for p in self.signature.parameters.values():
                if p.kind is p.VAR_POSITIONAL:
                    extra_args = given.pop(p.name, ())
                elif p.kind is p.VAR_KEYWORD:
                    extra_kwargs = given.pop(p.name, {})
        slots = [self._slot(given[n], i in self.static_argnums or n in self.static_argnames, n) if n in given
                 else MISSING for i, n in enumerate(self.positional)]
        slots += [self._slot(given[n], n in self.static_argnames, n) if n in given else MISSING
                  for n in self.keyword_only]
        first = len(self.positional)
        slots += [self._slot(v, first + j in self.static_argnums, f"positional argument {first + j}")
                  for j, v in enumerate(extra_args)]
        slots += [Keyword(n, self._slot(extra_kwargs[n], n in self.static_argnames, n)) for n in sorted(extra_kwargs)]
        slots, objects = split_objects(tuple(slots))
        return BoundCall(slots, objects)

    def traced(self, *slots: Any) -> Any:
        """The function that is traced: the original called with the arguments the slots hold."""
        slots, objects, graphdef = merge_objects(slots)
        args, kwargs = self._arguments(slots)
        result = self.fn(*args, **kwargs)
        check_no_objects(result, "result", self.name)
        return (states_of(objects, graphdef, self.name), result) if objects else result

    def _arguments(self, slots: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments from slots; after a left-out parameter, later ones go by name."""
        args, kwargs, by_name = [], {}, False
        for name, slot in zip(self.positional, slots, strict=False):
            if isinstance(slot, Missing):
                by_name = True
            elif by_name:
                kwargs[name] = _value(slot)
            else:
                args.append(_value(slot))
        rest = slots[len(self.positional):]
        for name, slot in zip(self.keyword_only, rest, strict=False):
            if not isinstance(slot, Missing):
                kwargs[name] = _value(slot)
        for slot in rest[len(self.keyword_only):]:
            if isinstance(slot, Keyword):
                kwargs[slot.name] = _value(slot.value)
            else:
                args.append(_value(slot))
        return args, kwargs

    def _slot(self, value: Any, static: bool, where: str) -> Any:
        if not static:
            return value
        try:
            hash(value)
        except TypeError:
            raise OptionsError(
                f"{self.name}'s static argument {where!r} is a {type(value).__name__}, which is not hashable; a static "
                f"argument keys the plan cache (a new value is a new plan), as in jax.jit: pass a hashable value "
                f"(a tuple instead of a list, a frozen dataclass), or make it a traced argument by dropping it from "
                f"static_argnums/static_argnames") from None
        return Static(value)

    def _check_static(self) -> None:
        var_positional = var_keyword = self.signature is None
        if self.signature is not None:
            kinds = {p.kind for p in self.signature.parameters.values()}
            var_positional = inspect.Parameter.VAR_POSITIONAL in kinds
            var_keyword = inspect.Parameter.VAR_KEYWORD in kinds
        for n in sorted(self.static_argnums):
            if n < 0 or (n >= len(self.positional) and not var_positional):
                raise OptionsError(f"parallelize(..., static_argnums={tuple(sorted(self.static_argnums))}): "
                                   f"{self.name} has no positional argument {n}; its parameters are "
                                   f"{self._parameters()} (positions count from 0)")
        for n in sorted(self.static_argnames):
            if n not in self.positional and n not in self.keyword_only and not var_keyword:
                raise OptionsError(f"parallelize(..., static_argnames=...): {self.name} has no parameter named {n!r}; "
                                   f"its parameters are {self._parameters()}")

    def _parameters(self) -> str:
        return f"({', '.join(self.signature.parameters)})" if self.signature is not None else "unknown"


def dynamic_slots(slots: tuple[Any, ...]) -> tuple[Any, ...]:
    """The slots that hold traced values (not static, not left out)."""
    return tuple(s for s in slots if not isinstance(s, (Static, Missing)))


def with_fixed_slots(fn: Callable[..., Any], slots: tuple[Any, ...]) -> Callable[..., Any]:
    """`fn` of the dynamic slots only: the static and left-out slots of `slots` put back in place."""
    def of_dynamic(*dynamic: Any) -> Any:
        values = iter(dynamic)
        return fn(*(s if isinstance(s, (Static, Missing)) else next(values) for s in slots))

    return of_dynamic


def _value(slot: Any) -> Any:
    return slot.value if isinstance(slot, Static) else slot


def _unwrap_jit(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[int, ...], tuple[str, ...]]:
    """The Python function inside a `jax.jit` or `nnx.jit` wrapper, with the wrapper's static
    arguments (parallelize compiles the step itself; a nested jit would hide the gradient)."""
    jitted = getattr(fn, "jitted_fn", fn)  # nnx.jit keeps the jax.jit of its pure function there
    info = getattr(jitted, "_jit_info", None)
    if info is None or not hasattr(fn, "__wrapped__"):
        return fn, (), ()
    return fn.__wrapped__, tuple(info.static_argnums), tuple(info.static_argnames)


def _ints(values: Iterable[int] | int) -> tuple[int, ...]:
    return (values,) if isinstance(values, int) else tuple(values)


def _strs(values: Iterable[str] | str) -> tuple[str, ...]:
    return (values,) if isinstance(values, str) else tuple(values)
