"""The exception tree: one module defines every `StreamtallyError`, and its docstring draws
them all, each under its base (so the picture cannot drift from the code)."""

from __future__ import annotations

import importlib
import pkgutil
import re

import streamtally
from streamtally import errors
from streamtally.errors import StreamtallyError


def _every_module() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(streamtally.__path__, "streamtally.")
        # Entry points: importing one runs it.
        if not info.name.endswith(("__main__", "sender_child"))
    ]


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


def test_every_streamtally_error_is_defined_in_errors() -> None:
    for name in _every_module():
        importlib.import_module(name)
    elsewhere = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _subclasses(StreamtallyError)
        if cls.__module__ != "streamtally.errors" and cls.__module__.startswith("streamtally.")
    )
    assert elsewhere == []


def test_the_drawn_tree_is_the_class_tree() -> None:
    doc = errors.__doc__ or ""
    drawn: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        # "    StreamtallyError", "    ├── InputError", "    │   ├── InvalidEvent", ...
        match = re.match(r"^ {4}([│├└─ ]*)([A-Z]\w+)", line)
        if match is None:
            continue
        depth = len(match.group(1)) // 4
        while stack and stack[-1][0] >= depth:
            stack.pop()
        drawn[match.group(2)] = stack[-1][1] if stack else ""
        stack.append((depth, match.group(2)))
    defined = {
        name: cls.__bases__[0].__name__ if cls is not StreamtallyError else ""
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, StreamtallyError)
    }
    assert drawn == defined
    assert sorted(errors.__all__) == sorted(defined)
