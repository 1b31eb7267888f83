"""`collective_rpc`: the methods RL frameworks call by name, vLLM's way, and their argument checks.

One table for both callers: `LLM.collective_rpc(method, args, kwargs)` in Python and the server's
`POST /collective_rpc`. `check(method, args, kwargs)` raises ValueError naming the method and the bad
argument (unknown method, wrong arity or keyword, wrong type); `call(target, ...)` then runs it on an
object with the engine's method names (an `LLM` or an `LLMEngine`). Each method runs once from rank 0
and reaches every tensor-parallel rank itself (through the engine's executor).
"""

import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any


def _sleep(target, level: int = 1, mode: str = "wait"):
    if mode not in ("wait", "abort", "keep"):
        raise ValueError(f"sleep: mode must be 'wait' (running requests finish first), 'abort' or 'keep' (they "
                         f"continue after the wake), got {mode!r}")
    return target.sleep(level, mode)  # positional: the engine's second parameter is the mode


def _wake_up(target, tags: list[str] | None = None):
    return target.wake_up(tags)


def _reload_weights(target, path: str | None = None):
    return target.reload_weights(path)


def _update_weights(target, named_tensors: Iterable):
    return target.update_weights(named_tensors)


def _is_sleeping(target):
    return target.is_sleeping()


def _update_weights_from_tensor(target, serialized_named_tensors: list[str] | None = None,
                                load_format: str | None = None, flush_cache: bool = True, named_tensors: Any = None):
    return target.update_weights_from_tensor(named_tensors, load_format, flush_cache, serialized_named_tensors)


def _init_weights_update_group(target, master_address: str, master_port: int, rank_offset: int, world_size: int,
                               group_name: str = "weight_update_group", backend: str | None = None,
                               timeout: float = 120.0):
    return target.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                            backend, timeout)


def _update_weights_from_distributed(target, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                     group_name: str = "weight_update_group", flush_cache: bool = True):
    return target.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)


def _destroy_weights_update_group(target, group_name: str = "weight_update_group"):
    return target.destroy_weights_update_group(group_name)


def _memory_usage(target):
    return target.memory_usage()


METHODS: dict[str, Callable] = {f.__name__[1:]: f for f in (
    _sleep, _wake_up, _reload_weights, _update_weights, _is_sleeping, _memory_usage, _update_weights_from_tensor,
    _init_weights_update_group, _update_weights_from_distributed, _destroy_weights_update_group)}


def public_methods(worker_cls) -> frozenset[str]:
    """The Worker methods collective_rpc offers by name from outside the engine: its readings and a worker
    extension's methods (`Worker.RPC_READINGS`, `extension_methods`)."""
    return worker_cls.RPC_READINGS | worker_cls.extension_methods


class RPCArgumentError(ValueError):
    """A collective_rpc call refused before it runs; `param` names the part at fault ("method", "args",
    "args.N", "kwargs" or "kwargs.NAME")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check(method: str, args: Iterable = (), kwargs: dict | None = None) -> inspect.BoundArguments:
    """The bound arguments of `method(*args, **kwargs)`; RPCArgumentError (a ValueError) names what is wrong."""
    function = METHODS.get(method) if isinstance(method, str) else None
    if function is None:
        raise RPCArgumentError(f"unknown collective_rpc method {method!r}; supported: {sorted(METHODS)}", "method")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RPCArgumentError(f"{method}: kwargs must be a dict, got {type(kwargs).__name__}", "kwargs")
    if isinstance(args, str | bytes | dict) or not isinstance(args, Iterable):
        raise RPCArgumentError(f"{method}: args must be a list or tuple, got {type(args).__name__}", "args")
    args, kwargs = list(args), dict(kwargs or {})
    names = list(inspect.signature(function).parameters)[1:]
    if len(args) > len(names):
        raise RPCArgumentError(f"{method} takes {len(names)} argument(s) {names}, got {len(args)} in args", "args")
    for name in kwargs:
        if name not in names:
            raise RPCArgumentError(f"{method}: unknown argument {name!r}; it takes {names}", f"kwargs.{name}")
        if names.index(name) < len(args):
            raise RPCArgumentError(f"{method}: argument {name!r} given in both args and kwargs", f"kwargs.{name}")
    try:
        bound = inspect.signature(function).bind(None, *args, **kwargs)
    except TypeError as exc:
        raise RPCArgumentError(f"{method}: bad arguments: {exc}", "args") from None
    hints = typing.get_type_hints(function)
    for name, value in list(bound.arguments.items())[1:]:
        if name in hints and not _matches(value, hints[name]):
            where = f"kwargs.{name}" if name in kwargs else f"args.{names.index(name)}"
            raise RPCArgumentError(f"{method}: {name} must be {_describe(hints[name])}, got {value!r:.60}", where)
    return bound


def call(target, method: str, args: Iterable = (), kwargs: dict | None = None) -> Any:
    """Check, then run `method` on `target` (an `LLM` or `LLMEngine`); returns its result."""
    bound = check(method, args, kwargs)
    return METHODS[method](target, *list(bound.args)[1:], **bound.kwargs)


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool):
        return isinstance(value, hint)
    return True  # e.g. Iterable of (name, tensor): the engine checks it


def _describe(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "None").replace("<class '", "").replace("'>", "")
