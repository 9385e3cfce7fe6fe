"""argparse value types shared by the ``tandem`` subcommands: a bad value is rejected
while parsing, before anything loads."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {value}")
    return value


def unit_fraction(text: str) -> float:
    """A share in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value
