"""ParallelOptions refuses settings that cannot work, naming the value and the choices."""

import pytest

from titan_parallel import ParallelConfigError, ParallelOptions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"reshard_after_forward": "sometimes"},
            r"reshard_after_forward='sometimes' is unknown; choose one of \['default'",
        ),
        ({"ac_mode": "partial"}, r"ac_mode='partial' is unknown"),
        (
            {"ac_mode": "selective", "ac_selective": "matmul"},
            r"ac_selective must be 'op' or a positive integer, got 'matmul'",
        ),
        ({"ac_mode": "selective", "ac_selective": 0}, "ac_selective must be >= 1, got 0"),
        ({"pp_schedule": "DualPipe"}, r"pp_schedule='DualPipe' is unknown; choose one of \['1F1B', 'GPipe'"),
        ({"cp_rotate_method": "ring"}, r"cp_rotate_method='ring' is unknown"),
        ({"float8": "mxfp8"}, r"float8='mxfp8' is unknown; choose one of \['tensorwise', 'rowwise'\]"),
        ({"pp_microbatch_size": 0}, "pp_microbatch_size must be >= 1, got 0"),
        ({"pp_layers_per_stage": 2, "pp_split_points": ("layers.2",)}, "not both"),
    ],
)
def test_invalid_options_are_refused(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelOptions(**kwargs)


def test_selective_every_n_blocks_accepts_torchtitans_string_form():
    assert ParallelOptions(ac_mode="selective", ac_selective="2").selective_every == 2
    assert ParallelOptions(ac_mode="selective").selective_every is None
