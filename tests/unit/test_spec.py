import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumagic.devices.model import GpuInfo, Inventory
from gpumagic.devices.spec import ACCEPTED_FORMS, SpecError, parse_spec, resolve


def inventory():
    names = ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"]
    uuids = ["GPU-aaaa1111-0000", "GPU-aaaa2222-0000", "GPU-bbbb0000-0000", "GPU-cccc0000-0000"]
    return Inventory(
        tuple(GpuInfo(i, u, n) for i, (u, n) in enumerate(zip(uuids, names, strict=True))), "nvml", time.time()
    )


def indices(text):
    return [g.nvml_index for g in resolve(parse_spec(text), inventory())]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0,2", [0, 2]),
        ("2, 0", [0, 2]),
        ("0 2", [0, 2]),
        ("GPU:1", [1]),
        ("gpu:3", [3]),
        ("/device:GPU:1", [1]),
        ("['GPU:0','GPU:1']", [0, 1]),
        ("['GPU:0', 'GPU:1']", [0, 1]),
        ("[0, 3]", [0, 3]),
        ("GPU:*", [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        ("*", [0, 1, 2, 3]),
        ("A100", [0, 1]),
        ("rtx.*4090", [2]),
        ("V100|4090", [2, 3]),
        ("GPU-bbbb", [2]),
        ("GPU-aaaa2222", [1]),
        ("none", []),
        ("cpu", []),
        ("'0,1'", [0, 1]),
        ("1,1", [1]),
    ],
)
def test_the_forms_users_write(text, expected):
    assert indices(text) == expected


def test_a_python_list_is_accepted_as_is():
    assert [g.nvml_index for g in resolve(parse_spec(["GPU:0", 2]), inventory())] == [0, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("7", "there is no GPU 7: this machine has GPUs 0-3"),
        ("GPU-aaaa", "several GPUs"),
        ("GPU-ffff", "no GPU has a UUID starting with GPU-ffff"),
        ("H100", "matches no GPU name"),
        ("[0, 'x']", "not a GPU index"),
        ("[1.5]", "is not a GPU"),
        ("[0", "not a valid list"),
        ("a(b", "neither a GPU list nor a valid name pattern"),
        ("", "empty device spec"),
        ("MIG-1234-5678", "MIG instance"),
    ],
)
def test_mistakes_get_one_line_naming_what_is_wrong(text, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace("[", r"\[")) as caught:
        indices(text)
    assert "\n" not in str(caught.value)


def test_malformed_specs_show_the_accepted_forms():
    with pytest.raises(SpecError) as caught:
        parse_spec("[0")
    assert ACCEPTED_FORMS in str(caught.value)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=40), st.text(alphabet="0123456789,:[]'\"* GPUgpu-abcdefMIG()|.\\", max_size=40)))
def test_random_text_parses_or_raises_spec_error(text):
    try:
        chosen = indices(text)
    except SpecError as err:
        assert str(err)
    else:
        assert chosen == sorted(set(chosen)) and all(0 <= i <= 3 for i in chosen)
