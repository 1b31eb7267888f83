"""How the commands print numbers: a unit for the magnitude, never an exponent, no rate of nothing, and a
goal stated only where the run is the one it is for."""

from torpor.cli import units


def test_units_follow_the_magnitude():
    assert [units.seconds(s) for s in (0.000123, 0.0123, 0.5, 12.3, 250)] == [
        "123 µs", "12.3 ms", "500 ms", "12.3 s", "250 s"]
    assert [units.size(b) for b in (512, 3300, 16 * 2**20, 1.41 * 2**30)] == ["512 B", "3.22 KiB", "16.0 MiB",
                                                                               "1.41 GiB"]
    assert units.size(3 * 2**20, unit=2**30) == "0.00293 GiB"  # a column's unit: digits, no exponent
    assert [units.rate(n, 1) for n in (51.3e9, 380e6, 12e3, 9)] == ["51.3 GB/s", "380 MB/s", "12.0 kB/s", "9 B/s"]
    assert units.rate(0, 1) is None and units.rate(10, 0) is None  # nothing copied: no "0.00 GB/s"
    assert units.percent(0.00462) == "0.462%" and units.number(1234.5) == "1234"


def test_a_goal_is_a_goal_only_where_it_applies():
    assert units.goal(">= 1.5x", False, applies=False) == "(CPU smoke run: no goal)"
    assert units.goal(">= 1.5x", True, applies=True) == "(goal >= 1.5x: met)"
    assert units.goal("<= 0.6 s", False, applies=True) == "(goal <= 0.6 s: NOT met)"
