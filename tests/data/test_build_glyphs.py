"""The glyph-dataset builder end to end, on fonts every install has (matplotlib's DejaVu) and a
small Unihan-shaped fixture, since the CJK font packages and unicode-data are not on CI."""
import functools
import os

import matplotlib
import numpy as np
import pytest

from pml_hyperbolic.data import GlyphDataset
from pml_hyperbolic.data import build_glyphs as bg

FONT_DIR = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf")
# four "radicals" of 13 letters each: A-M, N-Z, a-m, n-z
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
RADICAL_OF = {ch: 1 + i // 13 for i, ch in enumerate(LETTERS)}


@pytest.fixture()
def fake_debian(tmp_path, monkeypatch):
    unihan = tmp_path / "unicode"
    unihan.mkdir()
    (unihan / "Unihan_OtherMappings.txt").write_text(
        "".join(f"U+{ord(ch):04X}\tkJoyoKanji\t2010\n" for ch in LETTERS), encoding="utf-8")
    (unihan / "Unihan_IRGSources.txt").write_text(
        "".join(f"U+{ord(ch):04X}\tkRSUnicode\t{RADICAL_OF[ch]}.{i % 5}\n" for i, ch in enumerate(LETTERS)),
        encoding="utf-8")
    (unihan / "CJKRadicals.txt").write_text(
        "# radical; CJK radical; ideograph\n1; 2F00; 0041\n2; 2F01; 004E\n3; 2F02; 0061\n4; 2F03; 006E\n",
        encoding="utf-8")
    monkeypatch.setattr(bg, "read_unihan_field", functools.partial(bg.read_unihan_field, unihan_dir=str(unihan)))
    monkeypatch.setattr(bg, "read_radical_characters",
                        functools.partial(bg.read_radical_characters, path=str(unihan / "CJKRadicals.txt")))
    monkeypatch.setattr(bg, "FONT_ROOT", FONT_DIR)
    monkeypatch.setattr(bg, "FONT_SPECS", [
        bg.FontSpec("DejaVu Serif", "fonts-dejavu-core", "DejaVuSerif.ttf", 0, "serif"),
        bg.FontSpec("DejaVu Serif Bold", "fonts-dejavu-core", "DejaVuSerif-Bold.ttf", 0, "serif"),
        bg.FontSpec("DejaVu Sans", "fonts-dejavu-core", "DejaVuSans.ttf", 0, "sans"),
        bg.FontSpec("DejaVu Sans Bold", "fonts-dejavu-core", "DejaVuSans-Bold.ttf", 0, "sans"),
        bg.FontSpec("DejaVu Sans Mono", "fonts-dejavu-core", "DejaVuSansMono.ttf", 0, "display"),
        bg.FontSpec("Not Installed", "fonts-missing", "no-such-font.ttf", 0, "display"),
    ])
    doc = tmp_path / "doc" / "fonts-dejavu-core"
    doc.mkdir(parents=True)
    (doc / "copyright").write_text(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
        "Files: *\nCopyright: 2003 Bitstream, Inc.\n 2006 DejaVu fonts team\nLicense: Own\n"
        " Permission is hereby granted, free of charge, to use these fonts.\n .\n Second paragraph.\n")
    monkeypatch.setattr(bg, "debian_license_summary",
                        functools.partial(bg.debian_license_summary, doc_root=str(tmp_path / "doc")))
    return tmp_path


def test_builder_writes_a_loadable_deterministic_dataset(fake_debian, capsys):
    out = fake_debian / "glyphs.npz"
    licences = fake_debian / "LICENSES.md"
    bg.build(str(out), image_size=24, num_radicals=4, characters_per_radical=6, license_path=str(licences))
    assert "skip Not Installed" in capsys.readouterr().err  # a missing font package is reported, not fatal
    with np.load(out) as z:
        images, chars, radicals = z["images"], z["characters"], z["char_radicals"]
        assert images.shape == (24, 5, 24, 24) and images.dtype == np.uint8
        assert (images.reshape(24 * 5, -1).max(axis=1) > 128).all()  # every rendering has ink
        assert [RADICAL_OF[c] for c in chars] == radicals.tolist()  # hierarchy from kRSUnicode
        assert z["radical_characters"].tolist() == [{1: "A", 2: "N", 3: "a", 4: "n"}[r] for r in radicals]
        for radical in range(1, 5):  # each radical's characters split half/half train/test
            assert z["char_is_test"][radicals == radical].sum() == 3
        first = {k: z[k].copy() for k in z.files}
    again = fake_debian / "again.npz"
    bg.build(str(again), image_size=24, num_radicals=4, characters_per_radical=6, verbose=False)
    with np.load(again) as z:
        for key, value in first.items():
            assert np.array_equal(z[key], value), key  # deterministic for a font set and seed
    # the dataset class reads it, with the display family as the query side
    query = GlyphDataset(split="query", root=str(out))
    gallery = GlyphDataset(split="gallery", root=str(out))
    assert set(query.font_families.tolist()) == {"display"} and len(gallery) == 4 * len(query)
    text = licences.read_text(encoding="utf-8")
    assert "| DejaVu Sans Mono | display | `fonts-dejavu-core` |" in text
    assert 'Own: "Permission is hereby granted, free of charge, to use these fonts."' in text
    assert "Second paragraph" not in text  # only the first paragraph of the terms is quoted


def test_builder_needs_every_family(fake_debian, monkeypatch):
    monkeypatch.setattr(bg, "FONT_SPECS", [s for s in bg.FONT_SPECS if s.family != "display"])
    with pytest.raises(RuntimeError, match="every family"):
        bg.build(str(fake_debian / "x.npz"), image_size=24, num_radicals=4, characters_per_radical=6,
                 verbose=False)


def test_render_glyph_jitter_is_seeded():
    from PIL import ImageFont

    font = ImageFont.truetype(os.path.join(FONT_DIR, "DejaVuSans.ttf"), 80)
    plain = bg.render_glyph(font, "K", 24)
    again = bg.render_glyph(font, "K", 24)
    a = bg.render_glyph(font, "K", 24, rng=np.random.default_rng(1))
    b = bg.render_glyph(font, "K", 24, rng=np.random.default_rng(1))
    c = bg.render_glyph(font, "K", 24, rng=np.random.default_rng(2))
    assert plain.shape == (24, 24) and np.array_equal(plain, again)
    assert np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(a, plain)
    assert bg.render_glyph(font, " ", 24) is None  # nothing to draw
