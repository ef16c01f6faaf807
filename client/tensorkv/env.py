"""The ``TENSORKV_*`` environment variables, each checked where it is read: a value that is
not of its kind raises InvalidArgumentError naming the variable and the value (never a bare
ValueError from ``int()``).

>>> import os
>>> os.environ["TENSORKV_EXAMPLE"] = "abc"
>>> integer("TENSORKV_EXAMPLE", 0)
Traceback (most recent call last):
...
tensorkv.errors.InvalidArgumentError: TENSORKV_EXAMPLE='abc' is not a whole number
>>> del os.environ["TENSORKV_EXAMPLE"]
"""
import math
import numbers
import os

from .errors import InvalidArgumentError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def integer(name, default, low=None, given=None, argument=None):
    """``given`` when it is not None (the keyword ``argument`` the variable stands for, by
    default its name: rank= for TENSORKV_RANK), else ``name``'s whole number (surrounding
    spaces allowed), else ``default``; InvalidArgumentError, naming the argument or the
    variable, when it is not a whole number or is below ``low``."""
    if given is not None:
        source = argument or name.removeprefix("TENSORKV_").lower()
        if isinstance(given, bool) or not isinstance(given, numbers.Real) or not math.isfinite(given) \
                or given != int(given):
            raise InvalidArgumentError(f"{source}={given!r} is not a whole number")
        value = int(given)
    else:
        source, value = name, _variable(name, int, "whole number")
        if value is None:
            return default
    if low is not None and value < low:
        raise InvalidArgumentError(f"{source}={value} is below its least value, {low}")
    return value


def number(name, default, given=None, argument=None):
    """``given`` when it is not None, else ``name``'s number, else ``default``, as a float;
    InvalidArgumentError, naming the argument or the variable, when it is not a number above 0."""
    source, value = argument or name.removeprefix("TENSORKV_").lower(), given
    if value is None:
        source, value = name, _variable(name, float, "number")
        if value is None:
            return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{source}={value!r} is not a number")
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{source}={value!r} is not a number of seconds above 0")
    return float(value)


def _variable(name, convert, kind):
    """``convert`` of ``name``'s value (surrounding spaces allowed); None when it is unset or
    empty; InvalidArgumentError naming the variable when it is not a ``kind``."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return convert(text)
    except ValueError:
        raise InvalidArgumentError(f"{name}={text!r} is not a {kind}") from None


def flag(name):
    """Whether ``name`` is set to a true value: 1, true, yes or on (any case); unset, empty,
    0, false, no and off are false; anything else raises InvalidArgumentError."""
    text = os.environ.get(name, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgumentError(f"{name}={os.environ[name]!r} is neither true (1, true, yes, on) "
                               "nor false (0, false, no, off, empty)")


def choice(name, given, choices, default, argument=None):
    """``given`` when it is not None, else ``name``'s value, else ``default``; checked to be one
    of ``choices`` (InvalidArgumentError naming the ``argument``, by default the variable's
    name in lower case, or the variable it came from)."""
    source, value = argument or name.removeprefix("TENSORKV_").lower(), given
    if value is None:
        source, value = name, os.environ.get(name, "").strip() or None
    if value is None:
        return default
    if value not in choices:
        raise InvalidArgumentError(f"unknown {source} {value!r}; use one of {', '.join(map(repr, choices))}")
    return value
