"""The kinds of value an option takes (shared/options.py): how each is parsed from a flag, a
variable or a YAML value, what is accepted (for the one-line errors), and how it is written back."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any


class Kind:
    """How one kind of value is parsed from text, checked, and written back."""
    accepted = "a string"
    metavar = "TEXT"
    repeatable = False          # Repeated: the flag may be given several times

    def parse(self, text: str) -> Any:
        return text

    def from_yaml(self, value: Any) -> Any:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{value!r} is a YAML {type(value).__name__}")
        return self.parse(str(value))

    def format(self, value: Any) -> str:
        return str(value)

    def to_yaml(self, value: Any) -> Any:
        return value


class Text(Kind):
    def __init__(self, accepted: str = "a string", metavar: str = "TEXT"):
        self.accepted, self.metavar = accepted, metavar


class Integer(Kind):
    def __init__(self, minimum: int | None = None, maximum: int | None = None, metavar: str = "N"):
        self.minimum, self.maximum, self.metavar = minimum, maximum, metavar
        bounds = [f">= {minimum}" if minimum is not None else "", f"<= {maximum}" if maximum is not None else ""]
        self.accepted = "an integer" + (" " + " and ".join(b for b in bounds if b) if any(bounds) else "")

    def parse(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            raise ValueError(f"{value} is out of range")
        return value

    def from_yaml(self, value: Any) -> int:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError(f"{value!r} is not an integer")
        return super().from_yaml(value)


class Port(Integer):
    def __init__(self):
        super().__init__(0, 65535, metavar="PORT")
        self.accepted = "a port number in 0..65535 (0 = any free port)"


class Number(Kind):
    metavar = "X"

    def __init__(self, minimum: float | None = None, exclusive: bool = False, maximum: float | None = None):
        self.minimum, self.exclusive, self.maximum = minimum, exclusive, maximum
        self.accepted = "a number" + ("" if minimum is None else f" {'>' if exclusive else '>='} {minimum:g}") \
            + ("" if maximum is None else f"{' and' if minimum is not None else ''} <= {maximum:g}")

    def parse(self, text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{text!r} is not a finite number")
        if self.minimum is not None and (value < self.minimum or (self.exclusive and value == self.minimum)):
            raise ValueError(f"{value:g} is out of range")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{value:g} is out of range")
        return value

    def format(self, value: float) -> str:
        return f"{value:g}"


class Flag(Kind):
    accepted = "true or false (also 1/0, yes/no, on/off)"
    metavar = "BOOL"
    _WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}

    def parse(self, text: str) -> bool:
        try:
            return self._WORDS[text.strip().lower()]
        except KeyError:
            raise ValueError(f"{text!r} is not a boolean") from None

    def from_yaml(self, value: Any) -> bool:
        return value if isinstance(value, bool) else self.parse(str(value))

    def format(self, value: bool) -> str:
        return "true" if value else "false"


class Choice(Kind):
    def __init__(self, *values: str):
        self.values = values
        self.accepted = "one of " + ", ".join(values)
        self.metavar = "{" + ",".join(values) + "}"

    def parse(self, text: str) -> str:
        value = text.strip().lower()
        if value not in self.values:
            raise ValueError(f"{text!r} is not a choice")
        return value


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'512MiB', '2GiB', '1.5G', '100MB', '67108864' to bytes (K/M/G/T alone are binary)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size")
    value = int(float(m[1]) * _UNITS[m[2].lower()])
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def format_size(value: int) -> str:
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


class Size(Kind):
    accepted = "a positive size in bytes, or with a unit: KiB, MiB, GiB, TiB (KB, MB, GB, TB), e.g. 512MiB"
    metavar = "SIZE"

    def parse(self, text: str) -> int:
        return parse_size(text)

    def format(self, value: int) -> str:
        return format_size(value)

    def to_yaml(self, value: int) -> str:
        return format_size(value)


class Address(Kind):
    accepted = "host:port, e.g. 127.0.0.1:50061"
    metavar = "HOST:PORT"

    def parse(self, text: str) -> str:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{text!r} is not host:port")
        return text.strip()


class FilePath(Kind):
    accepted = "the path of an existing file"
    metavar = "FILE"

    def parse(self, text: str) -> str:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"{text!r} is not an existing file")
        return str(path)


class Repeated(Kind):
    """An option given several times (`--model a --model b`, or a YAML list): its value is a tuple
    of the inner kind's values. One flag, variable or YAML scalar gives one element."""
    repeatable = True

    def __init__(self, inner: Kind):
        self.inner = inner
        self.accepted = f"{inner.accepted} (repeat the flag for several)"
        self.metavar = inner.metavar

    def parse(self, text: str) -> tuple:
        return (self.inner.parse(text),)

    def parse_all(self, texts: list[str]) -> tuple:
        return tuple(self.inner.parse(t) for t in texts)

    def from_yaml(self, value: Any) -> tuple:
        items = value if isinstance(value, list) else [value]
        return tuple(self.inner.from_yaml(v) for v in items)

    def format(self, value: tuple) -> str:
        return " ".join(self.inner.format(v) for v in value)

    def to_yaml(self, value: tuple) -> Any:
        items = [self.inner.to_yaml(v) for v in value]
        return items[0] if len(items) == 1 else items
