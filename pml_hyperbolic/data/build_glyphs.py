"""Builder for the bundled CJK glyph dataset (``cjk_glyphs.npz``).

Run as::

    sudo apt-get install unicode-data fonts-noto-cjk fonts-arphic-ukai ...   # see FONT_SPECS
    python -m pml_hyperbolic.data.build_glyphs [--install-fonts] [--image-size 40]

Why this dataset exists: the recipes must run end to end on a fresh machine that
holds none of the retrieval benchmarks and cannot download anything. A real
(not synthetic-noise) image set with a real two-level hierarchy is built from
material Debian ships:

* **classes** are Joyo kanji (Unihan ``kJoyoKanji``) taken from the Kangxi
  radicals (Unihan ``kRSUnicode``) that have the most Joyo characters; the
  hierarchy is radical -> character;
* **images** are renderings of each character in many typefaces from Debian's
  CJK font packages. The fonts are grouped into three style families
  (``serif`` = Mincho/Song/Ming, ``sans`` = Gothic/Hei, ``display`` = brush,
  rounded, handwriting and pixel faces); :class:`~pml_hyperbolic.data.GlyphDataset`
  uses the families for its hard query/gallery protocol.

Only characters that every selected font covers are kept, so every class has
exactly one image per font. Each radical's characters are split half/half
between train and test classes (seeded), so the radical level exists in both
splits while the character classes are disjoint.

The output is deterministic for a given font set, image size and seed. The
attribution file ``GLYPHS_LICENSES.md`` is regenerated from the Debian
``copyright`` files of the packages that were used.

Design note: docs/design/data.md
"""
from __future__ import annotations


import argparse
import bz2
import collections
import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

UNIHAN_DIR = "/usr/share/unicode"
FONT_ROOT = "/usr/share/fonts"

FontSpec = collections.namedtuple(
    "FontSpec", ["name", "debian_package", "relative_path", "face_index", "family"]
)

# Hand-picked so that near-identical derivatives (e.g. Takao = IPA, IPAex = IPA
# kanji, UmePlus = Ume, Komatuna = Konatu) are not counted twice.
FONT_SPECS = [
    # serif: Mincho / Song / Ming
    FontSpec("Noto Serif CJK JP", "fonts-noto-cjk", "opentype/noto/NotoSerifCJK-Regular.ttc", 0, "serif"),
    FontSpec("Noto Serif CJK JP Bold", "fonts-noto-cjk", "opentype/noto/NotoSerifCJK-Bold.ttc", 0, "serif"),
    FontSpec("IPAMincho", "fonts-ipafont-mincho", "opentype/ipafont-mincho/ipam.ttf", 0, "serif"),
    FontSpec("HanaMinA", "fonts-hanazono", "truetype/hanazono/HanaMinA.ttf", 0, "serif"),
    FontSpec("Ume Mincho", "fonts-horai-umefont", "truetype/horai-umefont/ume-tmo3.ttf", 0, "serif"),
    FontSpec("Ume Mincho S3", "fonts-horai-umefont", "truetype/horai-umefont/ume-tms3.ttf", 0, "serif"),
    FontSpec("Sawarabi Mincho", "fonts-sawarabi-mincho", "truetype/sawarabi-mincho/sawarabi-mincho-medium.ttf", 0, "serif"),
    FontSpec("AR PL UMing TW", "fonts-arphic-uming", "truetype/arphic/uming.ttc", 2, "serif"),
    FontSpec("UnBatang", "fonts-unfonts-core", "truetype/unfonts-core/UnBatang.ttf", 0, "serif"),
    FontSpec("Baekmuk Batang", "fonts-baekmuk", "truetype/baekmuk/batang.ttf", 0, "serif"),
    # sans: Gothic / Hei
    FontSpec("Noto Sans CJK JP", "fonts-noto-cjk", "opentype/noto/NotoSansCJK-Regular.ttc", 0, "sans"),
    FontSpec("Noto Sans CJK JP Bold", "fonts-noto-cjk", "opentype/noto/NotoSansCJK-Bold.ttc", 0, "sans"),
    FontSpec("IPAGothic", "fonts-ipafont-gothic", "opentype/ipafont-gothic/ipag.ttf", 0, "sans"),
    FontSpec("VL Gothic", "fonts-vlgothic", "truetype/vlgothic/VL-Gothic-Regular.ttf", 0, "sans"),
    FontSpec("Ume Gothic", "fonts-horai-umefont", "truetype/horai-umefont/ume-tgo4.ttf", 0, "sans"),
    FontSpec("Ume Gothic C4", "fonts-horai-umefont", "truetype/horai-umefont/ume-tgc4.ttf", 0, "sans"),
    FontSpec("Ume Gothic S4", "fonts-horai-umefont", "truetype/horai-umefont/ume-tgs4.ttf", 0, "sans"),
    FontSpec("WenQuanYi Zen Hei", "fonts-wqy-zenhei", "truetype/wqy/wqy-zenhei.ttc", 0, "sans"),
    FontSpec("WenQuanYi Micro Hei", "fonts-wqy-microhei", "truetype/wqy/wqy-microhei.ttc", 0, "sans"),
    FontSpec("Sawarabi Gothic", "fonts-sawarabi-gothic", "truetype/sawarabi-gothic/sawarabi-gothic-medium.ttf", 0, "sans"),
    FontSpec("MotoyaLCedar", "fonts-motoya-l-cedar", "truetype/motoya-l-cedar/MTLc3m.ttf", 0, "sans"),
    FontSpec("Baekmuk Gulim", "fonts-baekmuk", "truetype/baekmuk/gulim.ttf", 0, "sans"),
    FontSpec("UnDotum", "fonts-unfonts-core", "truetype/unfonts-core/UnDotum.ttf", 0, "sans"),
    # display: brush, rounded, handwriting, pixel
    FontSpec("AR PL UKai TW", "fonts-arphic-ukai", "truetype/arphic/ukai.ttc", 2, "display"),
    FontSpec("MotoyaLMaru", "fonts-motoya-l-maruberi", "truetype/motoya-l-maruberi/MTLmr3m.ttf", 0, "display"),
    FontSpec("Konatu", "fonts-konatu", "truetype/konatu/Konatu.ttf", 0, "display"),
    FontSpec("Misaki Gothic", "fonts-misaki", "truetype/misaki/misaki_gothic.ttf", 0, "display"),
    FontSpec("Misaki Mincho", "fonts-misaki", "truetype/misaki/misaki_mincho.ttf", 0, "display"),
    FontSpec("UnGungseo", "fonts-unfonts-core", "truetype/unfonts-core/UnGungseo.ttf", 0, "display"),
]
FAMILY_NAMES = ["serif", "sans", "display"]


def install_font_packages():
    """``apt-get install`` every package the builder reads (needs root)."""
    packages = sorted({spec.debian_package for spec in FONT_SPECS} | {"unicode-data"})
    subprocess.run(["apt-get", "update"], check=True)
    subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", *packages],
        check=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


UNIHAN_FIELD_FILES = {"kRSUnicode": "Unihan_IRGSources", "kJoyoKanji": "Unihan_OtherMappings"}


def read_unihan_field(field: str, unihan_dir: str = UNIHAN_DIR) -> Dict[int, str]:
    """Return ``{codepoint: value}`` for one Unihan field (each field lives in a single Unihan file).

    Raises:
        FileNotFoundError: no Unihan folder, or the field in none of its files.
    """
    values = {}
    if not os.path.isdir(unihan_dir):
        raise FileNotFoundError(f"{unihan_dir} missing; install Debian's 'unicode-data' package")
    paths = [os.path.join(unihan_dir, f) for f in sorted(os.listdir(unihan_dir)) if f.startswith("Unihan_")]
    hint = UNIHAN_FIELD_FILES.get(field)
    paths.sort(key=lambda p: 0 if hint and os.path.basename(p).startswith(hint) else 1)
    for path in paths:
        if values:
            break
        opener = bz2.open if path.endswith(".bz2") else open
        with opener(path, "rt", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("U+") and f"\t{field}\t" in line:
                    code, _, value = line.rstrip("\n").split("\t", 2)
                    values[int(code[2:], 16)] = value
    if not values:
        raise FileNotFoundError(
            f"Unihan field {field} not found under {unihan_dir}; install Debian's 'unicode-data' package"
        )
    return values


def read_radical_characters(path: str = os.path.join(UNIHAN_DIR, "CJKRadicals.txt")) -> Dict[int, str]:
    """Kangxi radical number -> the CJK unified ideograph of that radical."""
    radicals = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.split("#")[0].strip()
            if not line:
                continue
            number, _, ideograph = [part.strip() for part in line.split(";")]
            if number.isdigit():
                radicals[int(number)] = chr(int(ideograph, 16))
    return radicals


def font_codepoints(path: str, face_index: int) -> Set[int]:
    """The code points face ``face_index`` of the font file ``path`` maps (needs fontTools)."""
    from fontTools.ttLib import TTFont

    font = TTFont(path, fontNumber=face_index, lazy=True)
    return set(font.getBestCmap() or {})


def render_glyph(font: Any, character: str, image_size: int, rng: Optional[np.random.Generator] = None,
                 supersample: int = 4, max_rotation: float = 8.0, scale_range: Tuple[float, float] = (0.68, 1.0),
                 aspect_range: Tuple[float, float] = (0.87, 1.15),
                 stroke_change_prob: float = 0.5) -> Optional[np.ndarray]:
    """Render one character as ink intensity (0 = paper, 255 = ink).

    The glyph is drawn at a fixed em size per font (so relative glyph sizes in a
    typeface survive) and ``supersample`` times larger than the output, then
    box-filtered down for clean anti-aliasing.

    With ``rng`` given, each rendering gets a random *nuisance* transform baked
    in: uniform scale, aspect change, small rotation, stroke thickening or
    thinning and a random position inside the frame. This is what keeps the
    evaluation protocol from being solved by pixel matching: perfectly centred
    renderings of the same character in two similar typefaces correlate almost
    perfectly, jittered ones do not, while the character stays fully legible.
    Without ``rng`` the ink bounding box is centred and nothing else changes.
    """
    from PIL import Image, ImageDraw, ImageFilter

    big = image_size * supersample
    canvas = Image.new("L", (2 * big, 2 * big), 0)
    ImageDraw.Draw(canvas).text((big, big), character, fill=255, font=font, anchor="mm")
    bbox = canvas.getbbox()
    if bbox is None:
        return None
    if rng is not None:
        pad = supersample  # room for the stroke filter to grow the ink
        ink = canvas.crop((bbox[0] - pad, bbox[1] - pad, bbox[2] + pad, bbox[3] + pad))
        if rng.random() < stroke_change_prob:
            size = int(rng.choice([3, 5]))
            grow = rng.random() < 0.5
            ink = ink.filter(ImageFilter.MaxFilter(size) if grow else ImageFilter.MinFilter(size))
        scale = rng.uniform(*scale_range)
        aspect = rng.uniform(*aspect_range)
        new_size = (max(1, int(ink.width * scale * aspect)), max(1, int(ink.height * scale / aspect)))
        ink = ink.resize(new_size, Image.LANCZOS)
        ink = ink.rotate(rng.uniform(-max_rotation, max_rotation), resample=Image.BICUBIC, expand=True)
        if ink.getbbox() is not None:
            ink = ink.crop(ink.getbbox())
    else:
        ink = canvas.crop(bbox)
    limit = int(round(big * 0.96))
    if max(ink.size) > limit:  # oversized glyph: shrink uniformly to fit
        shrink = limit / max(ink.size)
        ink = ink.resize((max(1, int(ink.width * shrink)), max(1, int(ink.height * shrink))), Image.LANCZOS)
    slack_x, slack_y = big - ink.width, big - ink.height
    if rng is not None:
        offset = (int(rng.integers(0, slack_x + 1)), int(rng.integers(0, slack_y + 1)))
    else:
        offset = (slack_x // 2, slack_y // 2)
    out = Image.new("L", (big, big), 0)
    out.paste(ink, offset)
    return np.asarray(out.resize((image_size, image_size), Image.BOX), dtype=np.uint8)


def debian_license_summary(package: str, doc_root: str = "/usr/share/doc") -> Tuple[str, str]:
    """``(licence, copyright holders)`` from the first ``Files: *`` stanza of a Debian copyright file."""
    path = os.path.join(doc_root, package, "copyright")
    if not os.path.exists(path):
        return "(copyright file not found)", ""
    text = open(path, encoding="utf-8", errors="replace").read()
    stanzas = re.split(r"\n\s*\n", text)
    chosen = next((s for s in stanzas if re.search(r"^Files:\s*\*\s*$", s, re.M)), None)
    chosen = chosen or next((s for s in stanzas if "License:" in s), text[:400])
    license_match = re.search(r"^License:\s*(.+)$", chosen, re.M)
    copyright_match = re.search(r"^Copyright:\s*(.+(?:\n\s+.+)*)", chosen, re.M)
    licence = license_match.group(1).strip() if license_match else "see copyright file"
    body = re.search(r"^License:.*\n((?:[ \t].*\n?)+)", chosen, re.M)
    if license_match and body:
        # a licence written out in the Files stanza itself (e.g. fonts-misaki's "Original"): its
        # name alone says nothing, so quote the terms (first paragraph)
        terms = " ".join(body.group(1).split("\n .")[0].split())
        terms = terms if len(terms) <= 300 else terms[:297] + "..."
        licence = f"{licence}: \"{terms}\""
    holders = " ".join(copyright_match.group(1).split()) if copyright_match else ""
    if not license_match and "ARPHIC PUBLIC LICENSE" in text.upper():  # pre-DEP-5 copyright file
        licence, holders = "Arphic Public License", "1994-1999 Arphic Technology Co., Ltd."
    return licence, holders


def write_license_file(path: str, fonts: Sequence[Any], num_classes: int, image_size: int) -> None:
    """Write ``GLYPHS_LICENSES.md``: the data sources and every typeface's licence."""
    lines = [
        "# Bundled glyph dataset: sources and licences",
        "",
        "`cjk_glyphs.npz` holds %d-px greyscale renderings of %d Joyo kanji in %d typefaces,"
        % (image_size, num_classes, len(fonts)),
        "generated by `python -m pml_hyperbolic.data.build_glyphs` from Debian packages.",
        "The images are renderings (bitmaps) of the fonts below; no font file is redistributed.",
        "We credit every typeface and its licence as stated in the Debian `copyright` file",
        "(`/usr/share/doc/<package>/copyright`), which holds the full licence texts.",
        "",
        "Character data (Joyo list `kJoyoKanji`, radical `kRSUnicode`, `CJKRadicals.txt`) come from",
        "the Unicode Character Database / Unihan (Debian package `unicode-data`), Copyright",
        "Unicode, Inc., under the Unicode License (https://www.unicode.org/license.txt).",
        "",
        "| Typeface | Style family | Debian package | Licence | Copyright |",
        "|---|---|---|---|---|",
    ]
    for spec in fonts:
        licence, holders = debian_license_summary(spec.debian_package)
        holders = holders.replace("|", "/")
        if len(holders) > 200:
            holders = holders[:197] + "..."
        lines.append(f"| {spec.name} | {spec.family} | `{spec.debian_package}` | {licence} | {holders} |")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def select_characters(fonts_codepoints: Sequence[Set[int]], num_radicals: int, characters_per_radical: int,
                      seed: int) -> List[Tuple[int, int]]:
    """``[(code point, radical)]``: ``characters_per_radical`` Joyo kanji covered by every font from
    each of the ``num_radicals`` radicals with the most such characters (seeded choice).

    Raises:
        RuntimeError: fewer eligible radicals than ``num_radicals``.
    """
    joyo = read_unihan_field("kJoyoKanji")
    radical_stroke = read_unihan_field("kRSUnicode")
    covered = set.intersection(*fonts_codepoints)
    by_radical = collections.defaultdict(list)
    for code in sorted(joyo):
        if code not in covered or code not in radical_stroke:
            continue
        first = radical_stroke[code].split()[0]
        radical = int(first.split(".")[0].rstrip("'\""))
        by_radical[radical].append(code)
    eligible = [r for r, codes in by_radical.items() if len(codes) >= characters_per_radical]
    eligible.sort(key=lambda r: (-len(by_radical[r]), r))
    if len(eligible) < num_radicals:
        raise RuntimeError(
            f"only {len(eligible)} radicals have >= {characters_per_radical} covered Joyo kanji"
        )
    rng = np.random.default_rng(seed)
    chosen = []
    for radical in sorted(eligible[:num_radicals]):
        codes = rng.choice(by_radical[radical], size=characters_per_radical, replace=False)
        chosen.extend((int(code), radical) for code in sorted(codes))
    return chosen


def build(output: str, image_size: int = 40, num_radicals: int = 32, characters_per_radical: int = 10,
          min_joyo_coverage: float = 0.80, seed: int = 0, jitter: bool = True, license_path: Optional[str] = None,
          verbose: bool = True) -> str:
    """Render the glyph archive to ``output`` (and the licence file to ``license_path``); returns ``output``."""
    from PIL import ImageFont

    joyo = set(read_unihan_field("kJoyoKanji"))
    fonts, codepoint_sets = [], []
    for spec in FONT_SPECS:
        path = os.path.join(FONT_ROOT, spec.relative_path)
        if not os.path.exists(path):
            print(f"skip {spec.name}: {path} missing (apt-get install {spec.debian_package})", file=sys.stderr)
            continue
        codes = font_codepoints(path, spec.face_index)
        coverage = len(joyo & codes) / len(joyo)
        if coverage < min_joyo_coverage:
            print(f"skip {spec.name}: covers {coverage:.0%} of Joyo kanji", file=sys.stderr)
            continue
        fonts.append(spec)
        codepoint_sets.append(codes)
        if verbose:
            print(f"font {spec.name:28s} {spec.family:8s} Joyo coverage {coverage:.1%}")
    families_present = {spec.family for spec in fonts}
    if families_present != set(FAMILY_NAMES):
        raise RuntimeError(f"need fonts of every family {FAMILY_NAMES}, found {sorted(families_present)}")

    chosen = select_characters(codepoint_sets, num_radicals, characters_per_radical, seed)
    radical_chars = read_radical_characters()
    characters = "".join(chr(code) for code, _ in chosen)
    char_radicals = np.array([radical for _, radical in chosen], dtype=np.int16)

    rng = np.random.default_rng(seed + 1)
    char_is_test = np.zeros(len(chosen), dtype=bool)
    for radical in np.unique(char_radicals):
        members = np.flatnonzero(char_radicals == radical)
        test_members = rng.choice(members, size=len(members) // 2, replace=False)
        char_is_test[test_members] = True

    images = np.zeros((len(chosen), len(fonts), image_size, image_size), dtype=np.uint8)
    for font_id, spec in enumerate(fonts):
        font = ImageFont.truetype(
            os.path.join(FONT_ROOT, spec.relative_path), int(image_size * 4 * 0.86), index=spec.face_index
        )
        for char_id, character in enumerate(characters):
            glyph_rng = np.random.default_rng([seed, font_id, char_id]) if jitter else None
            glyph = render_glyph(font, character, image_size, rng=glyph_rng)
            if glyph is None:
                raise RuntimeError(f"{spec.name} renders {character!r} as an empty image")
            images[char_id, font_id] = glyph

    metadata = {
        "image_size": image_size,
        "seed": seed,
        "jitter": bool(jitter),
        "num_radicals": num_radicals,
        "characters_per_radical": characters_per_radical,
        "ink": "255 = ink, 0 = paper",
        "builder": "python -m pml_hyperbolic.data.build_glyphs",
    }
    np.savez_compressed(
        output,
        images=images,  # (characters, fonts, H, W)
        characters=np.array(list(characters)),
        char_radicals=char_radicals,
        radical_characters=np.array([radical_chars.get(int(r), "?") for r in char_radicals]),
        char_is_test=char_is_test,
        font_names=np.array([spec.name for spec in fonts]),
        font_families=np.array([spec.family for spec in fonts]),
        metadata=np.array(json.dumps(metadata)),
    )
    if license_path:
        write_license_file(license_path, fonts, len(chosen), image_size)
    if verbose:
        print(
            f"wrote {output}: {len(chosen)} characters x {len(fonts)} fonts at {image_size}px, "
            f"{os.path.getsize(output) / 1e6:.2f} MB"
        )
    return output


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line of ``python -m pml_hyperbolic.data.build_glyphs``."""
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=os.path.join(here, "cjk_glyphs.npz"))
    parser.add_argument("--license-output", default=os.path.join(here, "GLYPHS_LICENSES.md"))
    parser.add_argument("--image-size", type=int, default=40)
    parser.add_argument("--num-radicals", type=int, default=32)
    parser.add_argument("--characters-per-radical", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-jitter", action="store_true", help="centred renderings without nuisance transforms")
    parser.add_argument("--install-fonts", action="store_true", help="apt-get install the font packages first")
    args = parser.parse_args(argv)
    if args.install_fonts:
        install_font_packages()
    build(
        args.output,
        image_size=args.image_size,
        num_radicals=args.num_radicals,
        characters_per_radical=args.characters_per_radical,
        seed=args.seed,
        jitter=not args.no_jitter,
        license_path=args.license_output,
    )


if __name__ == "__main__":
    main()
