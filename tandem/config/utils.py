"""What the config groups share: field docs read from the source, and the check of
``Literal`` fields.

A field's doc is the string literal right below it (an attribute docstring, as vLLM's
``vllm/config/utils.py:get_attr_docs``): one text serves the reader of the source, the API
docs and ``--help`` (:mod:`tandem.engine.arg_utils`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import fields
from typing import Any, Literal


@functools.cache
def get_attr_docs(cls: type) -> dict[str, str]:
    """Field name -> the cleaned string literal that follows the field in ``cls``'s source.

    Raises:
        OSError: the class's source is not available (``inspect.getsource``).
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def literal_choices(tp: Any) -> tuple | None:
    """The values of a ``Literal[...]`` type (or of ``Literal[...] | None``), else None."""
    tp, _ = unwrap_optional(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def check_choices(obj: Any) -> None:
    """Every ``Literal`` field of the dataclass ``obj`` holds one of its values.

    Raises:
        ValueError: naming the field, its allowed values and the value given.
    """
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        choices = literal_choices(hints[f.name])
        value = getattr(obj, f.name)
        if choices is None or value in choices:
            continue
        if value is None and unwrap_optional(hints[f.name])[1]:
            continue
        allowed = ", ".join(map(str, choices)) + (" or None" if unwrap_optional(hints[f.name])[1] else "")
        raise ValueError(f"{f.name} must be one of {allowed}, got {value!r}.")
