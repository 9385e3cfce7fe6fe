"""Tandem's version: the installed distribution's."""

from __future__ import annotations


def tandem_version() -> str:
    """The version of the installed ``tandem`` distribution ("0.0.0" when run from a tree
    that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return "0.0.0"
