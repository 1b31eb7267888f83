"""Numbers as the commands print them: a unit chosen for the magnitude, a few significant digits."""

from __future__ import annotations

import math

KiB, MiB, GiB = 2**10, 2**20, 2**30


def seconds(value: float) -> str:
    """0.000123 -> "123 µs", 0.0123 -> "12.3 ms", 0.5 -> "500 ms", 12.3 -> "12.3 s"."""
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"  # (a clock's resolution: no decimals)
    if value < 1:
        return f"{number(value * 1e3)} ms"
    return f"{number(value)} s"


def size(nbytes: float, unit: int | None = None) -> str:
    """Bytes in binary units: "512 B", "3.2 KiB", "16.0 MiB", "1.41 GiB"; `unit` forces one (a column)."""
    unit = unit or size_unit(nbytes)
    name = {1: "B", KiB: "KiB", MiB: "MiB", GiB: "GiB"}[unit]
    return f"{number(nbytes / unit)} {name}"


def size_unit(nbytes: float) -> int:
    """The unit `size` uses for `nbytes`."""
    return next((u for u in (GiB, MiB, KiB) if abs(nbytes) >= u), 1)


def number(value: float) -> str:
    """3 significant digits (all of a larger integer part), never an exponent: 0 -> "0", 0.0413 -> "0.0413",
    4.41 -> "4.41", 16 -> "16.0", 278.4 -> "278", 1234.5 -> "1234"."""
    if value == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def rate(nbytes: float, value_s: float) -> str | None:
    """A copy's rate as links are quoted (decimal): "51.3 GB/s", "380 MB/s", "12 kB/s"; None when nothing
    was copied or no time passed."""
    if nbytes <= 0 or value_s <= 0:
        return None
    per_s = nbytes / value_s
    for unit, name in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if per_s >= unit:
            return f"{number(per_s / unit)} {name}"
    return f"{per_s:.0f} B/s"


def goal(text: str, met: bool, applies: bool) -> str:
    """A goal beside a figure: "(goal >= 1.5x: met)" where the run is the one the goal is for (a GPU run of
    the goal's workload), "(CPU smoke run: no goal)" elsewhere, so that a smoke run's figure never reads as a
    failure."""
    if not applies:
        return "(CPU smoke run: no goal)"
    return f"(goal {text}: {'met' if met else 'NOT met'})"


def percent(fraction: float) -> str:
    """0.701 -> "70.1%", 0.00462 -> "0.462%"."""
    return f"{number(100 * fraction)}%"
