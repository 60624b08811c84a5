"""HCL's bundled-glyph defaults: the trunk lr and hyperbolic weight chosen on validation characters
by ``bench/hcl_validation.py`` are what the recipe's parser gives; the paper's weight stays one flag
away and remains the default with --annotations."""
import pytest

from pml_hyperbolic.training import presets
from tests.recipes.test_recipe_end_to_end import load_recipe


def test_glyph_preset_gives_the_validation_choice(tmp_path):
    HCL = load_recipe("hcl").HCL
    args = HCL.parse(["--output-dir", str(tmp_path)])
    assert HCL.resolved_dataset(args) == "glyphs"
    assert args.lr == presets.HCL_GLYPH_TRUNK_LR
    assert args.hyperbolic_weight == presets.HCL_GLYPH_HYPERBOLIC_WEIGHT
    assert {"lr", "hyperbolic_weight"}.isdisjoint(args._explicit)  # from the preset, not a flag


def test_paper_setting_is_one_flag_away(tmp_path):
    HCL = load_recipe("hcl").HCL
    paper = presets.HCL_PAPER_HYPERBOLIC_WEIGHT
    args = HCL.parse(["--output-dir", str(tmp_path), "--hyperbolic-weight", f"{paper:g}", "--lr", "3e-4"])
    assert args.hyperbolic_weight == paper and args.lr == 3e-4
    # COCO-style data: the paper's weight and lr (annotation files are checked by preflight, not parse)
    coco = HCL.parse(["--output-dir", str(tmp_path), "--annotations", "a.json", "--images-dir", "img"])
    assert coco.hyperbolic_weight == paper and coco.lr == 0.03


def test_help_states_the_glyph_defaults_and_the_page_the_choice_command():
    HCL = load_recipe("hcl").HCL
    text = " ".join(HCL.make_parser().format_help().split())  # whatever the terminal width wraps
    assert f"(default: {presets.HCL_GLYPH_TRUNK_LR:g} on the bundled glyph scenes; 0.03 with --annotations)" in text
    assert f"(default: {presets.HCL_GLYPH_HYPERBOLIC_WEIGHT:g})" in text  # the same value with --annotations
    assert "docs/recipes/hcl.md" in text
    assert presets.HCL_GLYPH_CHOICE_COMMAND.startswith("python -m bench hcl_validation")
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "recipes" / "hcl.md"
    assert presets.HCL_GLYPH_CHOICE_COMMAND in " ".join(page.read_text(encoding="utf-8").split())


def test_validation_script_parses_the_chosen_command():
    from bench import hcl_validation

    argv = presets.HCL_GLYPH_CHOICE_COMMAND.split()[4:]
    a = hcl_validation.parse_args(argv)
    lrs = hcl_validation.floats(a.lrs, "--lrs")
    weights = hcl_validation.floats(a.weights, "--weights")
    assert presets.HCL_GLYPH_TRUNK_LR in lrs and presets.HCL_GLYPH_HYPERBOLIC_WEIGHT in weights
    assert hcl_validation.PAPER_WEIGHT == presets.HCL_PAPER_HYPERBOLIC_WEIGHT


def test_validation_table_scores_each_setting_against_its_own_carve():
    from bench import hcl_validation

    key = (presets.HCL_GLYPH_TRUNK_LR, presets.HCL_GLYPH_HYPERBOLIC_WEIGHT, presets.HCL_GLYPH_VIEW_AUGMENTATION)
    other = (1e-3, 1.0, "font")
    result = {"references": {0: 0.30, 1: 0.20}, "reference": 0.25,
              "runs": {key: {(0, 0): 0.31, (1, 0): 0.23, (0, 1): 0.32, (1, 1): 0.22},
                       other: {(0, 0): 0.29, (1, 0): 0.19}},
              "cpu": {key: [30.0] * 4, other: [31.0] * 2}, "chosen": key,
              "gain": {key: 0.02, other: -0.01}}
    text = hcl_validation.table(result)
    lines = text.splitlines()
    assert "carve 0: 30.0, carve 1: 20.0" in lines[2]
    mine = next(line for line in lines if "**chosen**" in line)
    # differences to the same carve's features: +1, +3, +2, +2 points -> mean +2.0, s.e. 0.8/sqrt(4) = 0.4
    assert "| +2.0 ± 0.4 |" in mine and "recipes/hcl.py glyph default" in mine
    assert "[0:0,0:1,1:0,1:1]" in mine
    assert "| -1.0 ± 0.0 |" in next(line for line in lines if "| font |" in line)


def test_validation_recipe_flags_reach_the_row_and_refuse_the_grid():
    from bench import hcl_validation

    extra = hcl_validation.recipe_flags('--temperature 0.5 --momentum 0.9')
    row = hcl_validation.hcl_row(3e-5, 0.1, "crop", extra)
    assert row.argv[-4:] == ["--temperature", "0.5", "--momentum", "0.9"] and "--temperature 0.5" in row.label
    assert row.argv[row.argv.index("--view-augmentation") + 1] == "crop"
    for bad in ("--lr 1e-3", "--view-augmentation=font", "--hyperbolic-weight 2"):
        with pytest.raises(SystemExit, match="must not set"):
            hcl_validation.recipe_flags(bad)
    with pytest.raises(SystemExit, match="--val-classes must be in"):
        hcl_validation.main(["--val-classes", "150"])


def test_validation_table_marks_the_default_only_without_extra_flags():
    from bench import hcl_validation

    key = (presets.HCL_GLYPH_TRUNK_LR, presets.HCL_GLYPH_HYPERBOLIC_WEIGHT, presets.HCL_GLYPH_VIEW_AUGMENTATION)
    result = {"references": {0: 0.30}, "reference": 0.30, "runs": {key: {(0, 0): 0.31, (0, 1): 0.29}},
              "cpu": {key: [30.0, 30.0]}, "chosen": key, "gain": {key: 0.0}}
    assert "glyph default" in hcl_validation.table(result)
    assert "glyph default" not in hcl_validation.table({**result, "extra": ["--temperature", "0.5"]})
