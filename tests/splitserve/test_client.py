"""The Python client's request building (no server: what it puts in the message)."""

import pytest

from splitserve.client import build_request


@pytest.mark.parametrize("stop, expected", [("the", ["the"]), (["the", "a"], ["the", "a"]),
                                            (None, [])])
def test_a_lone_stop_string_is_one_stop_string_not_its_characters(stop, expected):
    assert list(build_request([1, 2], stop=stop).sampling.stop) == expected


def test_an_unknown_sampling_parameter_is_a_type_error():
    with pytest.raises(TypeError, match="stop_strings"):
        build_request("hi", stop_strings=["x"])
