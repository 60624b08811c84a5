"""Recipe.run's garbage-collector handling: long-lived objects frozen during the run, none after."""
import argparse
import gc

import pytest

from pml_hyperbolic.training import runner


class Probe(runner.Recipe):
    name = "probe"
    seen = []

    def _run(self, t0):
        Probe.seen.append(gc.get_freeze_count())
        if self.args.fail:
            raise RuntimeError("the run failed")
        return {"ok": True}


def probe_args(fail=False):
    return argparse.Namespace(quiet=True, threads="auto", device="cpu", dist_backend="gloo", fail=fail)


def test_freeze_long_lived_objects_freezes_what_is_alive():
    gc.unfreeze()
    try:
        runner.freeze_long_lived_objects()
        assert gc.get_freeze_count() > 1000  # at least the imported modules' objects
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_run_freezes_then_unfreezes_even_when_the_run_fails():
    gc.unfreeze()
    Probe.seen.clear()
    recipe = Probe(probe_args())
    assert recipe.run() == {"ok": True}
    assert Probe.seen[0] > 1000 and gc.get_freeze_count() == 0
    recipe.args = probe_args(fail=True)
    with pytest.raises(RuntimeError, match="the run failed"):
        recipe.run()
    assert Probe.seen[1] > 1000 and gc.get_freeze_count() == 0


def test_training_class_count_declared_inferred_and_bad_labels():
    """Per-class parameters (ProxyAnchor's proxies) are sized by the declared ``num_classes``, else by
    1 + the largest first-level label; labels that cannot index classes get one clear error."""
    from types import SimpleNamespace

    from pml_hyperbolic.training.cli import ConfigError
    from pml_hyperbolic.training.runner import training_class_count

    assert training_class_count(SimpleNamespace(num_classes=7, labels=[0, 1])) == 7
    assert training_class_count(SimpleNamespace(labels=[3, 0, 5, 5])) == 6
    assert training_class_count(SimpleNamespace(labels=[[4, 0], [9, 1]])) == 10  # N x K: the first level
    for labels, shown in (([], "none"), ([2, -1], "-1")):
        with pytest.raises(ConfigError, match=f"non-negative class indices.*got {shown}"):
            training_class_count(SimpleNamespace(labels=labels))


def test_pseudo_label_options_from_flags():
    """The unsupervised recipe's flags on top of the base policy: levels become a tuple, --whiten 0
    turns whitening off, unset flags keep the base value, the base dict is not modified."""
    from types import SimpleNamespace

    from pml_hyperbolic.training.recipe_data import pseudo_label_options

    unset = dict(levels=None, linkage=None, pseudo_source=None, whiten=None, min_cluster_size=None)
    assert pseudo_label_options(SimpleNamespace(**unset)) == {}
    base = {"levels": (100, 70), "linkage": "ward", "whiten": 64}
    flags = SimpleNamespace(**{**unset, "levels": [40, 10], "pseudo_source": "embeddings", "whiten": 0,
                               "min_cluster_size": 3})
    assert pseudo_label_options(flags, base) == {"levels": (40, 10), "linkage": "ward", "whiten": None,
                                                 "source": "embeddings", "min_cluster_size": 3}
    assert base == {"levels": (100, 70), "linkage": "ward", "whiten": 64}
    assert pseudo_label_options(SimpleNamespace(**{**unset, "whiten": 32}))["whiten"] == 32
