"""The README's table of PML losses and miners that take PoincareDistance / PoincareSimilarity is what they do today."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench")


@pytest.mark.filterwarnings("ignore")
def test_readme_compatibility_table_is_regenerated_from_the_losses():
    sys.path.insert(0, BENCH)
    try:
        import pml_compatibility
    finally:
        sys.path.remove(BENCH)
    table = pml_compatibility.table()
    with open(os.path.join(BENCH, os.pardir, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert table in readme, "README's compatibility table is stale: paste `python bench/pml_compatibility.py`"
    # the losses the README's examples use must work, with the distance and with the similarity
    for name in ("TripletMarginLoss", "SupConLoss", "MultiSimilarityLoss", "ContrastiveLoss"):
        assert f"| loss | `{name}` | works | works |" in table
    assert "| miner | `MultiSimilarityMiner` | works | works |" in table
