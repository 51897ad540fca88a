import pytest
from hypothesis import given
from hypothesis import strategies as st

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
