"""Every bad input of bench/bad_inputs.py gets one clear error: 0 silent, 0 opaque."""
import pytest

from bench import bad_inputs


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("component, what, fn, pattern", bad_inputs.cases(),
                         ids=[f"{c}-{w}" for c, w, _, _ in bad_inputs.cases()])
def test_bad_input_gets_a_clear_error(component, what, fn, pattern):
    assert bad_inputs.verdict(fn, pattern) == "clear"
