import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpumagic.units
from gpumagic.errors import InvalidArgument
from gpumagic.units import GIB, parse_duration, parse_percent, parse_size, parse_size_or_percent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20GB", 20 * GIB),
        ("20 GiB", 20 * GIB),
        ("20g", 20 * GIB),
        ("512MB", 512 << 20),
        ("1.5TB", int(1.5 * (1 << 40))),
        ("20", 20 * GIB),
        (".5G", GIB // 2),
        (1024, 1024),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "20 parsecs", "-1GB", "1e3GB", "20GBB", float("nan")])
def test_bad_sizes_say_how_to_write_one(text):
    with pytest.raises(InvalidArgument, match="size"):
        parse_size(text)


def test_percent_of_memory():
    assert parse_size_or_percent("50%") == (None, 50.0)
    assert parse_size_or_percent("8GB") == (8 * GIB, None)
    with pytest.raises(InvalidArgument):
        parse_size_or_percent("150%")


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("10m", 600), ("1h30m", 5400), ("90", 90), ("250ms", 0.25), (2.5, 2.5)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "10 minutes", "-5s", "5x", "m"])
def test_bad_durations(text):
    with pytest.raises(InvalidArgument, match="duration"):
        parse_duration(text)


NINES = "9" * 400


def short_id(value):
    """A test id for 400 digits (and an int str() refuses to write)."""
    text = f"{value.bit_length()}-bit" if isinstance(value, int) and value.bit_length() > 64 else str(value)
    return text if len(text) <= 20 else f"{text[:12]}...{len(text)}"


@pytest.mark.parametrize(
    "text", [NINES, NINES + "GB", NINES + ".5TB", "1" + "0" * 30 + "TB", 10**400, 1e300, 2**61], ids=short_id
)
def test_sizes_past_an_exabyte_are_refused_in_one_short_line(text):
    with pytest.raises(InvalidArgument, match="too large a size: at most 1 EiB") as caught:
        parse_size(text)
    assert len(str(caught.value)) < 150 and "\n" not in str(caught.value)
    assert parse_size(2**60) == 2**60


@pytest.mark.parametrize(
    "text", [NINES, NINES + "d", NINES + "ms", 10**400, 10**5000, 1e300, float("inf"), "36501d"], ids=short_id
)
def test_durations_past_a_century_are_refused_in_one_short_line(text):
    with pytest.raises(InvalidArgument, match="too long for a duration: at most 100 years") as caught:
        parse_duration(text)
    assert len(str(caught.value)) < 150
    assert parse_duration("36500d") == 36500 * 86400.0


@pytest.mark.parametrize("text", [float("nan"), "nan", "inf", "1e999", "1e3s", ""])
def test_durations_that_are_no_number_of_seconds(text):
    with pytest.raises(InvalidArgument, match="duration"):
        parse_duration(text)


def test_a_limit_of_ones_own():
    assert parse_duration("7d", at_most=7 * 86400) == 7 * 86400
    with pytest.raises(InvalidArgument, match="'8d' is too long for a timeout: at most 7d"):
        parse_duration("8d", at_most=7 * 86400, what="a timeout")
    with pytest.raises(InvalidArgument, match="at most 30m00s"):
        parse_duration("1h", at_most=1800)


@pytest.mark.parametrize(
    "text", [NINES, NINES + "%", 10**400, 10**5000, "1e999", "inf", "nan", float("nan"), -1], ids=short_id
)
def test_percentages_out_of_range_are_one_short_line(text):
    with pytest.raises(InvalidArgument) as caught:
        parse_percent(text)
    assert len(str(caught.value)) < 150


def test_a_percentage_of_memory_past_100_is_one_short_line():
    with pytest.raises(InvalidArgument, match=r"^'9+'\.\.\. \(401 characters\) is more than 100% of a GPU's memory$"):
        parse_size_or_percent(NINES + "%")


def test_percentages():
    assert parse_percent("80%") == 80.0
    with pytest.raises(InvalidArgument):
        parse_percent("101")


@given(st.text(max_size=30))
def test_any_text_is_a_value_or_a_clear_error(text):
    for parser in (parse_size, parse_duration, parse_percent):
        try:
            value = parser(text)
        except InvalidArgument as err:
            assert repr(text) in str(err)
        else:
            assert value >= 0


def test_the_size_units_are_defined_once_on_the_ground_floor():
    """MIB and GIB live in gpumagic.units; a module that divides by one imports it (four copies were written
    beside them: three MIB, as a float, a power and a shift, and a float GIB)."""
    package = Path(gpumagic.units.__file__).parent
    defined = sorted(
        f"{path.relative_to(package.parent)}:{target.id}"
        for path in package.rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and target.id in ("KIB", "MIB", "GIB", "TIB")
    )
    assert defined == ["gpumagic/units.py:GIB", "gpumagic/units.py:MIB"]
