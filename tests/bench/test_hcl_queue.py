"""bench/hcl_queue.py: both MoCo-branch losses run on a full queue and the table pairs them."""
import pytest

from bench import hcl_queue


def test_measure_both_losses_in_process():
    for name in hcl_queue.LOSSES:
        got = hcl_queue.measure(name, batch=4, queue=32, dim=8, device="cpu", repeats=2, threads=1)
        assert set(got) == {"ms", "mib"} and got["ms"] > 0 and got["mib"] >= 0


def test_table_pairs_the_two_losses(capsys):
    rows = hcl_queue.main(["--batch", "4", "--queues", "16", "--dim", "8", "--repeats", "1"])
    assert [r["loss"] for r in rows] == list(hcl_queue.LOSSES)
    assert all("ms" in r for r in rows), rows
    out = capsys.readouterr().out
    assert "| 4 | 16 | PML NTXentLoss |" in out and "×," in out  # the NTXent row carries the ratio


@pytest.mark.parametrize("argv, match", [(["--batch", "0"], "--batch"), (["--queues", "a"], "--queues"),
                                         (["--repeats", "0"], "at least 1")])
def test_bad_arguments_exit_with_one_message(argv, match):
    with pytest.raises(SystemExit, match=match):
        hcl_queue.main(argv)
