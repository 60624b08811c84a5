"""Every bad input of bench/bad_inputs.py gets one clear error: 0 silent, 0 opaque."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench")
sys.path.insert(0, BENCH)
import bad_inputs  # noqa: E402

sys.path.remove(BENCH)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("component, what, fn, pattern", bad_inputs.cases(),
                         ids=[f"{c}-{w}" for c, w, _, _ in bad_inputs.cases()])
def test_bad_input_gets_a_clear_error(component, what, fn, pattern):
    assert bad_inputs.verdict(fn, pattern) == "clear"
