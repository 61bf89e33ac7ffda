"""A measurement of this machine cached like a computed result (checkpoints.cached): a time on a clock, a
server under load. Its key also names this machine (the CPU's model and its cores), so that a time taken on
another CPU is never shown as this one's; a later run shows the same numbers and says when and where they
were measured, and the script's --remeasure measures again. What a measurement returns (dataclasses of code/,
tuples, arrays) is stored as plain data (pack) and rebuilt on load (unpack), building classes of code/ only.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import os
import time
from typing import Callable

import numpy as np
import torch

from .checkpoints import _canon, _import, _module_of, cached
from .render import wrap


def this_machine() -> str:
    """The CPU's model name and its cores: what a time measured here holds for (a measurement's key)."""
    from .report import cpu_name
    return f"{cpu_name()}, {os.cpu_count()} cores"


def cached_measurement(name: str, inputs: dict, measure: Callable[[], object], remeasure: bool = False, *,
                       tag: str = "cache", flag: str = "--remeasure") -> tuple[object, dict]:
    """A measurement of this machine (seconds on a clock, a server under load) cached like a computed result:
    keyed by `inputs`, the code of `measure` and this machine (this_machine(): a time taken on another CPU is
    not this one's). A later run shows the same numbers and says when and where they were measured; remeasure
    (the script's `flag`) measures again. measure() may return dataclasses of code/, tuples, dicts, numpy
    arrays and tensors: they are stored as plain data (pack) and rebuilt on load (unpack). Returns (the
    result, {"loaded", "when", "machine", "seconds"})."""
    def compute():
        return {"result": pack(measure()), "when": time.strftime("%Y-%m-%d %H:%M"), "machine": this_machine()}

    def use(blob, entry):
        info = {"loaded": entry["loaded"], "when": blob["when"], "machine": blob["machine"],
                "seconds": entry["seconds"]}
        if entry["loaded"]:
            print(wrap(f"[{tag}] {name}: measured on {blob['machine']} on {blob['when']} (in "
                       f"{entry['seconds']:.0f} s), loaded from code/checkpoints/; {flag} measures it again"))
        return unpack(blob["result"]), info

    return cached(name, {**inputs, "machine": this_machine()}, compute, remeasure, use=use, tag=tag)


def cached_computation(name: str, inputs: dict, compute: Callable[[], object], recompute: bool = False, *,
                       tag: str = "cache", flag: str = "--recompute"):
    """A computed result that is not plain data (dataclasses of code/, tuples, tensors, as a measurement's):
    checkpoints.cached under `inputs` and the code of compute, stored packed and rebuilt on load (unpack); a load
    says so in one line with the script's `flag`. No machine in its key: it is computed, not timed."""
    return cached(name, inputs, lambda: pack(compute()), recompute, tag=tag, flag=flag,
                  use=lambda result, entry: unpack(result))


def fingerprint(value) -> str:
    """A hash of a value (arrays, tensors and dataclasses of them included) for a cache's inputs: it changes
    when the value does."""
    return hashlib.sha256(_canon(value, lambda obj: None).encode()).hexdigest()[:16]


def measured_note(info: dict, flag: str = "--remeasure") -> str:
    """One line for a page: when and where a cached measurement was taken (cached_measurement's info)."""
    if not info["loaded"]:
        return f"Measured in this run on {info['machine']} ({info['seconds']:.0f} s); a later run shows it again."
    return (f"Measured on {info['machine']} on {info['when']} ({info['seconds']:.0f} s), loaded from "
            f"code/checkpoints/; {flag} measures it again.")


def pack(x):
    """x as data torch.save stores with weights_only: a dataclass of code/ (frozen or not) becomes its class's
    name and its fields, a tuple, an Enum, a dict with keys that are not strings and a numpy array are tagged;
    numbers, strings, lists and tensors stay. unpack(pack(x)) == x."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__dataclass__": _class_name(type(x)),
                "fields": {f.name: pack(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, enum.Enum):
        return {"__enum__": _class_name(type(x)), "value": pack(x.value)}
    if isinstance(x, tuple):
        return {"__tuple__": [pack(v) for v in x]}
    if isinstance(x, list):
        return [pack(v) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: pack(v) for k, v in x.items()}
        return {"__items__": [[pack(k), pack(v)] for k, v in x.items()]}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(x).copy())}
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str, bytes, torch.Tensor)):
        return x
    raise TypeError(f"a measurement cannot store a {type(x).__name__}")


def unpack(x):
    """pack's inverse: the classes are looked up in code/'s modules only (nothing else is ever built)."""
    if isinstance(x, list):
        return [unpack(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__dataclass__" in x:
        cls = _class_of(x["__dataclass__"])
        obj = object.__new__(cls)
        for k, v in x["fields"].items():
            object.__setattr__(obj, k, unpack(v))
        return obj
    if "__enum__" in x:
        return _class_of(x["__enum__"])(unpack(x["value"]))
    if "__tuple__" in x:
        return tuple(unpack(v) for v in x["__tuple__"])
    if "__items__" in x:
        return {unpack(k): unpack(v) for k, v in x["__items__"]}
    if "__ndarray__" in x:
        return x["__ndarray__"].numpy()
    return {k: unpack(v) for k, v in x.items()}


def _class_name(cls) -> str:
    if _module_of(cls) is None or cls.__module__ == "__main__":
        raise TypeError(f"a measurement stores classes of code/'s modules only, not {cls.__qualname__}")
    return f"{cls.__module__}:{cls.__qualname__}"


def _class_of(name: str):
    module, qualname = name.split(":")
    obj = _import(module)
    if obj is None:
        raise ValueError(f"{module} is not a module of code/")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise ValueError(f"{name} is not a class")
    return obj
