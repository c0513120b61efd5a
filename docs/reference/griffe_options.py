"""A griffe extension of the docs site (``extensions:`` in mkdocs.yml): a class whose ``__init__``
is decorated with ``@takes_options(SomeConfig, ...)`` takes ``SomeConfig``'s options, which is
what ``inspect.signature``, ``help()``, IDEs and mypy show; griffe reads the source without
running it and would show ``__init__(self, *args, **options)``. Here ``__init__`` gets the
parameters of the config dataclass's ``__init__`` (made by griffe's ``dataclasses`` extension,
listed before this one)."""

from __future__ import annotations

from typing import Any

import griffe


class TakesOptions(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            init = cls.members.get("__init__")
            if init is None or init.is_alias or not isinstance(init, griffe.Function):
                continue
            for decorator in init.decorators:
                call = decorator.value
                if isinstance(call, griffe.ExprCall) and str(call.function).rpartition(".")[2] == "takes_options":
                    config = pkg.modules_collection.get_member(call.arguments[0].canonical_path)
                    init.parameters = griffe.Parameters(*config.members["__init__"].parameters)


def _classes(obj: griffe.Module | griffe.Class) -> Any:
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Class):
            yield member
            yield from _classes(member)
        elif isinstance(member, griffe.Module):
            yield from _classes(member)
