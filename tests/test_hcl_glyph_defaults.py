"""HCL's bundled-glyph defaults (issue 13 item 4): the trunk lr and hyperbolic weight chosen on
validation characters by ``bench/hcl_validation.py`` are what the recipe's parser gives; the
paper's weight stays one flag away and remains the default with --annotations."""
import os
import sys

from pml_hyperbolic.training import presets
from test_recipe_end_to_end import load_recipe

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench")


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


def test_help_states_the_glyph_default_and_how_it_was_chosen():
    HCL = load_recipe("hcl").HCL
    text = " ".join(HCL.make_parser().format_help().split())  # whatever the terminal width wraps
    assert f"bundled glyphs: {presets.HCL_GLYPH_HYPERBOLIC_WEIGHT:g}" in text
    assert f"--lr {presets.HCL_GLYPH_TRUNK_LR:g}" in text
    assert presets.HCL_GLYPH_CHOICE_COMMAND in text
    assert presets.HCL_GLYPH_CHOICE_COMMAND.startswith("python bench/hcl_validation.py")
    assert presets.HCL_GLYPH_CHOICE_COMMAND in " ".join(HCL.description.split())


def test_validation_script_parses_the_chosen_command():
    sys.path.insert(0, BENCH)
    import hcl_validation

    argv = presets.HCL_GLYPH_CHOICE_COMMAND.split()[2:]
    a = hcl_validation.parse_args(argv)
    lrs = hcl_validation.floats(a.lrs, "--lrs")
    weights = hcl_validation.floats(a.weights, "--weights")
    assert presets.HCL_GLYPH_TRUNK_LR in lrs and presets.HCL_GLYPH_HYPERBOLIC_WEIGHT in weights
    assert hcl_validation.PAPER_WEIGHT == presets.HCL_PAPER_HYPERBOLIC_WEIGHT
