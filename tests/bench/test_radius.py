"""bench/radius.py: one table per development domain, the same protocol for each, on synthetic banks;
the degraded-image path on the bundled Iconify sets (greyscale) with a stand-in backbone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import _quality_common as qc
from bench import radius as R

DIM = 16


def _bank(dataset, seed):
    """80 training classes (16 parents) with two views and query/gallery styles, 20 test classes (10 parents)."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(100, DIM, generator=gen)
    yt = torch.arange(80).repeat_interleave(4)
    xt = centers[yt] + 0.8 * torch.randn(len(yt), DIM, generator=gen)
    xt = torch.stack([xt, xt + 0.1 * torch.randn(xt.shape, generator=gen)], 1)
    styles = np.array([qc.QUERY_SIDE[dataset] if i % 4 == 0 else "other" for i in range(len(yt))])
    yq, yg = torch.arange(20).repeat_interleave(2), torch.arange(20).repeat_interleave(3)
    xq = centers[80 + yq] + 0.8 * torch.randn(len(yq), DIM, generator=gen)
    xg = centers[80 + yg] + 0.8 * torch.randn(len(yg), DIM, generator=gen)
    return qc.Bank(dataset, qc.Split(xt, yt, yt // 5, styles), qc.Split(xq, yq, yq // 2), qc.Split(xg, yg, yg // 2),
                   torch.nn.Identity(), DIM)


@pytest.fixture
def synthetic_domains(monkeypatch):
    banks = {d: _bank(d, seed) for seed, d in enumerate(qc.DEVELOPMENT_DOMAINS)}
    monkeypatch.setattr(R.qc, "build_bank", lambda cfg, dataset, **kw: banks[dataset])
    monkeypatch.setattr(R.qc, "pooled_bank", lambda bank, cfg, **kw: bank)

    def degraded(cfg, split="query", indices=None, kinds=("blur", "noise", "occlude"), use_cache=True,
                 dataset="glyphs"):
        bank = banks[dataset]
        clean = bank.query.acts if split == "query" else bank.train.acts[torch.as_tensor(indices), 0]
        gen = torch.Generator().manual_seed(len(kinds))
        return {kind: clean + 3 * torch.randn(clean.shape, generator=gen) for kind in kinds}

    def views(cfg, kinds=("blur", "noise", "occlusion"), views=2, use_cache=True, dataset="glyphs"):
        acts = banks[dataset].train.acts[:, :1]
        return acts.repeat(1, views, 1) + 3 * torch.randn(len(acts), views, DIM, generator=torch.Generator().manual_seed(3))

    monkeypatch.setattr(R, "degraded_features", degraded)
    monkeypatch.setattr(R, "package_degraded_views", views)
    return banks


ARGS = ["--seeds", "0", "--steps", "3", "--heads", "polar,sphere", "--losses", "pce,supcon,pce+cal+copies",
        "--threads", "1"]


def test_every_domain_gets_its_own_rows(synthetic_domains, capsys):
    rows = R.main(ARGS)  # default --datasets: every development domain
    assert [r["dataset"] for r in rows] == [d for d in qc.DEVELOPMENT_DOMAINS for _ in range(3)]
    assert {(r["head"], r["loss"]) for r in rows} == {("polar", "pce"), ("polar", "pce+cal+copies"), ("sphere", "supcon")}
    for row in rows:
        for key in ("r1", "val_r1", "parent_r1", "auroc_fail_top1", "auroc_degraded_top1", "sibling_auroc"):
            assert 0 <= row[key] <= 1, (row, key)
        # the radius columns exist on the ball only; the top-1 distance (the gallery-based baseline) everywhere
        assert ("auroc_fail" in row) == ("auroc_degraded" in row) == (row["head"] == "polar")
    printed = capsys.readouterr().out
    assert all(f"## {d}" in printed for d in qc.DEVELOPMENT_DOMAINS)


def test_glyph_rows_do_not_depend_on_the_other_domains(synthetic_domains):
    alone = R.main(["--datasets", "glyphs", *ARGS])
    beside = [r for r in R.main(["--datasets", "iconify,glyphs,icons", *ARGS]) if r["dataset"] == "glyphs"]
    assert alone == beside


def test_parents_come_from_each_domains_hierarchy(synthetic_domains):
    data = R.load_data(qc.BenchConfig(trainable="head"), dataset="icons")
    bank = synthetic_domains["icons"]
    assert torch.equal(data["q_parent"], bank.query.super_labels)
    assert torch.equal(data["g_parent"], bank.gallery.super_labels)
    val_q_idx, _ = R.validation_indices(bank, num_val_classes=R.VAL_CLASSES)
    assert torch.equal(data["val_q_parent"], bank.train.super_labels[val_q_idx])
    assert len(torch.unique(data["val_q"].labels)) == R.VAL_CLASSES


def test_bad_datasets_are_refused():
    with pytest.raises(SystemExit):
        R.main(["--datasets", "glyphs,fashion-mnist"])
    with pytest.raises(ValueError, match="development domains|must be one of"):
        R.load_data(qc.BenchConfig(trainable="head"), dataset="fashion-mnist")
    with pytest.raises(ValueError, match="must be one of"):
        qc.image_dataset("hcl", "query")


def _stand_in_backbone(monkeypatch):
    """A cheap frozen 'backbone': 4x4 average pool as the prefix, flatten as the tail (3*16*16 features)."""
    prefix = torch.nn.AvgPool2d(4)
    tail = torch.nn.Flatten()
    monkeypatch.setattr(qc, "split_backbone", lambda name: (prefix, tail, 3 * 16 * 16))


def test_iconify_queries_go_through_the_degradation_path(monkeypatch, tmp_path):
    from bench import uncertainty as bu

    _stand_in_backbone(monkeypatch)
    found = bu._image_split("iconify", "query")
    assert found is not None
    data, clean = found
    assert data[0][0].mode == "L"  # the archive stores greyscale drawings
    assert clean(data[0][0]).shape == (3, 64, 64)
    cfg = qc.BenchConfig(backbone="stand-in", trainable="head")
    cfg.cache_dir = str(tmp_path)
    out = bu.degraded_query_features(cfg, "iconify", max_classes=3, use_cache=False, log=lambda *a: None)
    n = int((np.asarray(data.labels) < 3).sum())
    assert n > 0 and set(out) == set(bu.DEGRADATIONS)
    images = torch.stack([clean(data[int(i)][0]) for i in np.flatnonzero(np.asarray(data.labels) < 3)])
    reference = torch.nn.Flatten()(torch.nn.AvgPool2d(4)(images))
    for kind, feats in out.items():
        assert feats.shape == (n, 3 * 16 * 16) and torch.isfinite(feats).all()
        assert not torch.allclose(feats, reference), kind  # the degradation changed the input


def test_radius_degraded_features_read_every_domain(monkeypatch, tmp_path):
    _stand_in_backbone(monkeypatch)
    cfg = qc.BenchConfig(backbone="stand-in", trainable="head")
    cfg.cache_dir = str(tmp_path)
    for dataset in qc.DEVELOPMENT_DOMAINS:
        out = R.degraded_features(cfg, "train", indices=[0, 5, 9], dataset=dataset)
        assert {k: v.shape for k, v in out.items()} == {k: (3, 3 * 16 * 16) for k in ("blur", "noise", "occlude")}
        cached = R.degraded_features(cfg, "train", indices=[0, 5, 9], dataset=dataset)  # from the cache
        assert all(torch.equal(out[k], cached[k]) for k in out)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("_")[1] for n in names] == sorted(qc.DEVELOPMENT_DOMAINS)  # one cache file per domain
