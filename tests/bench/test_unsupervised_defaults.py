"""bench/unsupervised_defaults.py's plumbing: the paired table against the features and the
argument checks (the training itself is the bench's, run by hand)."""
import pytest

from bench import unsupervised_defaults as ud


def rec(dataset, row, seed, r1, r8, at_clip=0.0):
    return {"dataset": dataset, "row": row, "seed": seed, "recall_at_1": r1, "recall_at_8": r8, "at_clip": at_clip}


def test_table_pairs_every_row_with_raw_seed_by_seed():
    results = [rec("glyphs", "raw", 0, 0.30, 0.60, float("nan")), rec("glyphs", "raw", 1, 0.20, 0.50, float("nan")),
               rec("glyphs", "unsup", 0, 0.31, 0.58, 0.0), rec("glyphs", "unsup", 1, 0.18, 0.52, 1.0)]
    lines = ud.table(results).splitlines()
    (unsup,) = [line for line in lines if "| unsup |" in line]
    # R@1 deltas +1 and −2: mean −0.5, worst −2.0; R@8 deltas −2, +2: mean 0.0, worst −2.0; half at the clip
    assert "| -0.5 (-2.0) |" in unsup and "| +0.0 (-2.0) |" in unsup and unsup.endswith("| 50% |")
    (raw,) = [line for line in lines if "| raw |" in line]
    assert "| — |" in raw


@pytest.mark.parametrize("argv,match", [(["--datasets", "mnist"], "--datasets"), (["--rows", "raw,foo"], "--rows"),
                                        (["--whiten-scale", "0"], "--whiten-scale"),
                                        (["--whiten-scale", "inf"], "--whiten-scale")])
def test_bad_arguments_are_named(argv, match, capsys):
    with pytest.raises(SystemExit):
        ud.parse_args(argv)
    assert match in capsys.readouterr().err


def test_every_bank_dataset_is_accepted():
    from bench import _quality_common as qc

    assert ud.parse_args(["--datasets", ",".join(qc.BANK_DATASETS)]).datasets.split(",") == list(qc.BANK_DATASETS)


def test_warm_start_uses_the_benchs_scale_unless_given():
    import torch

    feats = torch.randn(300, 1280, generator=torch.Generator().manual_seed(0)) + 3.0
    default = ud.warm_start(ud._head(), feats).linear.weight.detach().double().norm()
    given = ud.warm_start(ud._head(), feats, 10.0).linear.weight.detach().double().norm()
    assert float(default) == pytest.approx(ud.WHITEN_SCALE * 128 ** 0.5, rel=1e-5)
    assert ud.WHITEN_SCALE == 100.0  # the scale the recorded tables were measured at
    assert float(given) == pytest.approx(10 * 128 ** 0.5, rel=1e-5)


def test_keyword_options_take_literals_and_run_no_code():
    from bench.unsupervised_defaults import keyword_literals, parse_args

    assert keyword_literals("") == {}
    assert keyword_literals("gamma=0.2, margin_form='contrastive', level_gamma=None") == {
        "gamma": 0.2, "margin_form": "contrastive", "level_gamma": None}
    for bad in ("__import__('os').getcwd()", "gamma=len('x')", "0.2", "gamma="):
        with pytest.raises(SystemExit, match="name=literal"):
            keyword_literals(bad)
    assert parse_args(["--margin-kwargs", "gamma=0.2"]).margin_kwargs == "gamma=0.2"
