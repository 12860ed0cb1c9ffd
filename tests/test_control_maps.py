import numpy as np
import pytest

from sdxl.engine import control_maps


def _box() -> np.ndarray:
    picture = np.zeros((64, 96, 3), np.uint8)
    picture[16:48, 24:72] = (200, 180, 40)
    return picture


def test_canny_draws_the_edges_of_a_box_white_on_black_in_three_equal_channels():
    edges = control_maps.control_map(_box(), "canny")
    assert edges.shape == (64, 96, 3) and edges.dtype == np.uint8
    assert set(np.unique(edges)) == {0, 255}
    assert (edges == edges[..., :1]).all()
    assert edges[30, 10:20].max() == 0 and edges[30, 40:60].max() == 0  # nothing off the border
    assert edges[14:50, 22:26].any() and edges[14:18, 40:60].any()  # the left and top edges


def test_none_passes_the_picture_as_it_is():
    picture = _box()
    assert control_maps.control_map(picture, "none") is picture
    floats = picture / np.float32(255)
    assert control_maps.control_map(floats, "none") is floats, "floats in [0, 1] stay floats, as diffusers reads them"


def test_a_weak_edge_needs_low_thresholds():
    faint = np.zeros((64, 96, 3), np.uint8)
    faint[:, 48:] = 20
    assert not control_maps.control_map(faint, "canny").any()  # below A1111's default 100, 200
    assert control_maps.control_map(faint, "canny", (10, 20)).any()


@pytest.mark.parametrize(
    "text, reason",
    [("100", "LOW,HIGH"), ("0,200", "low threshold must be an integer from 1 to 255"),
     ("200,100", "must not be above its high threshold"), ("a,b", "low threshold must be an integer")],
)
def test_bad_thresholds_are_one_sentence(text, reason):
    with pytest.raises(ValueError, match=reason):
        control_maps.parse_thresholds(text)
    with pytest.raises(ValueError, match="preprocessor must be one of canny, none"):
        control_maps.control_map(_box(), "depth")
