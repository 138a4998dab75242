"""Numbers on the command line: every numeric option of every nanoq command
goes through one of these types, so that a value that overflows or is not
finite ("1e400", "nan", "inf", 10**30) is a usage error naming the option,
never a traceback further down (tests/test_cli.py checks every option)."""
from __future__ import annotations

import math

import click

INT_RANGE = (-(2**63), 2**64 - 1)  # what the core and numpy hold: int64, or uint64 for seeds


def _describe_bounds(number_type, base) -> str:
    """click's range text ("x>=1"), none for an unbounded type (click would say "x<=None")."""
    if number_type.min is None and number_type.max is None:
        return ""
    return base._describe_range(number_type)


class Integer(click.IntRange):
    """An integer within 64 bits (signed, or unsigned for seeds), and within
    [min, max] when given (as click.IntRange)."""

    name = "integer"

    def convert(self, value, param, ctx):
        number = click.INT.convert(value, param, ctx)
        if not INT_RANGE[0] <= number <= INT_RANGE[1]:
            self.fail(f"{value!r} does not fit in a 64-bit integer", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self):
        return _describe_bounds(self, click.IntRange)


class FiniteFloat(click.FloatRange):
    """A finite float (not nan, inf or a literal beyond the float range such
    as 1e400), and within [min, max] when given (as click.FloatRange)."""

    name = "float"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self):
        return _describe_bounds(self, click.FloatRange)


class Boolean(click.types.BoolParamType):
    """true/false (and click's other spellings: 1/0, yes/no, on/off), but not
    an empty value, which click takes for false: `--causal "$UNSET"` would
    change the model silently (a config file's "" is an error too)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty value is not true or false", param, ctx)
        return super().convert(value, param, ctx)
