"""Plumbing of ``python -m bench knn --scale`` at a toy size: one row per factory setting, with the
cosine baseline and the ratios of the same run."""
from bench import knn


def test_scale_rows_at_a_toy_size():
    rows = knn.main(["--scale", "--n", "3000", "--queries", "40", "--dim", "16", "--nlist", "16",
                     "--ef", "8", "--nprobe", "1,16", "--train-sample", "2000", "--threads", "1"])
    assert [(r["factory"], r["setting"]) for r in rows] == [
        ("Flat", "exact"), ("HNSW32", "ef_search=8"), ("IVF16,Flat", "nprobe=1"), ("IVF16,Flat", "nprobe=16")]
    for r in rows:
        assert 0.0 <= r["recall10"] <= 1.0 and 0.0 <= r["cos_recall10"] <= 1.0
        assert r["qps"] > 0 and r["cos_qps"] > 0 and r["bytes"] > 0 and r["cos_bytes"] > 0
        assert abs(r["qps_ratio_to_cosine"] - r["qps"] / r["cos_qps"]) < 1e-9 * r["qps_ratio_to_cosine"]
        assert "load_1min" in r
    assert rows[0]["recall10"] == 1.0
    assert all(r["coarse"] == "directions" and r["imbalance"] >= 1.0 and r["cos_imbalance"] >= 1.0 for r in rows[2:])
    assert rows[-1]["recall10"] == 1.0  # every list probed: the exact neighbours
    assert rows[-1]["coordinate_bytes"] == 3000 * 16 * 4  # float32 coordinates kept for exact distances


def test_scale_rows_without_kept_coordinates():
    rows = knn.main(["--scale", "--n", "3000", "--queries", "40", "--dim", "16", "--nlist", "16",
                     "--ef", "", "--nprobe", "16", "--pq", "4", "--train-sample", "2000", "--threads", "1",
                     "--keep-coordinates", "true,false"])
    ivf = [(r["factory"], r["keep_coordinates"]) for r in rows[1:]]
    assert ivf == [("IVF16,Flat", True), ("IVF16,Flat", False), ("IVF16,PQ4", True)]
    kept, stored = rows[1], rows[2]
    assert stored["coordinate_bytes"] == 0 and stored["bytes"] == stored["faiss_bytes"]
    assert kept["coordinate_bytes"] == 3000 * 16 * 4
    assert stored["recall10"] == 1.0  # every list probed: the exact neighbours from the stored vectors
    assert stored["bytes_ratio_to_cosine"] < kept["bytes_ratio_to_cosine"]
