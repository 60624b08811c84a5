"""The recipe pages (docs/recipes/) and the recipes' --help agree with the preset dictionaries:
every preset table cell is checked against ``presets.py`` / the recipe classes, so the docs cannot
drift from what a run uses."""
import os
import re

import pytest

from pml_hyperbolic.training import presets
from pml_hyperbolic.training.cli import show_value
from tests.recipes.test_recipe_end_to_end import load_recipe

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
DOCS = os.path.join(ROOT, "docs", "recipes")
PAGES = {"hyp-uml.md": ("hyp_uml_cars", "HypUML"), "hyp-vit.md": ("hyp_vit", "HypViT"),
         "hyp-mix.md": ("hyp_mix", "HypMix"), "unsupervised.md": ("unsupervised_hyperbolic", "UnsupervisedHyperbolic"),
         "hcl.md": ("hcl", "HCL"), "hier.md": ("hier", "HIER")}


def read(name):
    with open(os.path.join(DOCS, name), encoding="utf-8") as handle:
        return handle.read()


def presets_table(text):
    """(header, {flag: cells}) of the first Markdown table after '## Presets'."""
    section = text[text.index("## Presets"):]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    body = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header):
            break
        body[cells[0].strip("`")] = cells[1:]
    return header, body


@pytest.mark.parametrize("page", sorted(PAGES))
def test_preset_table_matches_the_presets(page):
    recipe, cls_name = PAGES[page]
    cls = getattr(load_recipe(recipe), cls_name)
    parser = cls.make_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    columns = [(where[4:] if where.startswith("the ") else where, preset)
               for _, where, preset in cls.preset_columns() if preset]
    header, body = presets_table(read(page))
    assert header == ["setting", "flag default"] + [name for name, _ in columns]
    expected_rows = [flag for flag, a in actions.items() if any(a.dest in p for _, p in columns)]
    assert list(body) == expected_rows  # every preset key has a row, in --help's order
    for flag, cells in body.items():
        action = actions[flag]
        want = [show_value(action.default)] + [show_value(p.get(action.dest, action.default)) for _, p in columns]
        assert cells == want, (page, flag)


def test_paper_presets_come_from_presets_py():
    """The tables read the recipe classes; the classes hold presets.py's dicts, not copies."""
    assert load_recipe("hyp_vit").HypViT.paper_presets is presets.HYP_VIT_PRESETS
    assert load_recipe("hyp_mix").HypMix.paper_presets is presets.HYP_MIX_PRESETS
    assert load_recipe("hyp_uml_cars").HypUML.paper_presets["cars196"] is presets.HYP_UML_PRESETS["cars196"]
    hier = load_recipe("hier").HIER
    for name, preset in presets.HYP_VIT_PRESETS.items():
        assert {k: v for k, v in hier.paper_presets[name].items() if k in preset} == preset


def test_index_links_every_recipe_page_and_command():
    text = read("index.md")
    for page, (recipe, cls_name) in PAGES.items():
        assert f"]({page})" in text and f"python recipes/{recipe}.py" in text
        assert getattr(load_recipe(recipe), cls_name).docs_page == page


def test_hcl_page_quotes_the_choice_command():
    text = " ".join(read("hcl.md").split())
    assert presets.HCL_GLYPH_CHOICE_COMMAND in text


def test_code_blocks_hold_no_python():
    """Shell commands sit in bash blocks, outputs in text blocks (python blocks are executed)."""
    for name in list(PAGES) + ["index.md"]:
        for lang in re.findall(r"^```(\w*)", read(name), flags=re.M):
            assert lang in ("", "bash", "text"), (name, lang)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_help_lists_each_preset_default(page):
    recipe, cls_name = PAGES[page]
    cls = getattr(load_recipe(recipe), cls_name)
    text = " ".join(cls.make_parser().format_help().split())
    assert f"docs/recipes/{page}" in text
    glyph_label = cls.preset_columns()[0][1]
    glyph_epochs = show_value(cls.glyph_preset["epochs"])
    assert f"(default: {glyph_epochs} on {glyph_label};" in text


def test_hyp_uml_help_shows_bundled_and_paper_defaults():
    text = " ".join(load_recipe("hyp_uml_cars").HypUML.make_parser().format_help().split())
    assert "(default: 3 on the bundled glyphs and icons; 10 on cub200, sop, inshop; 300 on cars196)" in text
    assert "(default: 48 on the bundled glyphs and icons; 224 on the benchmarks)" in text
    assert "(default: 120 on the bundled glyphs and icons; 900 on cub200, sop, inshop; 294 on cars196)" in text


@pytest.mark.parametrize("page", sorted(PAGES))
def test_option_help_is_short_and_holds_no_measurements(page):
    recipe, cls_name = PAGES[page]
    parser = getattr(load_recipe(recipe), cls_name).make_parser()
    for action in parser._actions:
        text = action.help or ""
        assert len(text) <= 160, (action.dest, text)  # two lines of a standard terminal
        for word in ("bench/", "R@1", "AUROC", "±", "validation"):
            assert word not in text, (action.dest, word)
        assert not re.search(r"\b(stop|issue)[ _-]?\d", text), (action.dest, text)
    assert "bench/" not in (parser.description or "") and "±" not in (parser.description or "")
