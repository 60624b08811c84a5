"""Builder for the bundled icon-theme dataset (``icon_themes.npz``).

Run as (a maintainer tool; nothing here runs at training or test time)::

    sudo apt-get install librsvg2-bin adwaita-icon-theme breeze-icon-theme ...   # see THEME_SPECS
    python -m pml_hyperbolic.data.build_icons [--install-themes] [--size 48]

What it builds: freedesktop.org icons drawn by many of Debian's icon themes.

* a **class** is an icon name of the freedesktop naming scheme (``edit-copy``,
  ``folder-music``, ``audio-x-generic``, ...); ``-symbolic`` variants count as the
  same name, the full-colour drawing is preferred;
* an **instance** is one theme's drawing of that name, rasterised to a square
  RGB image (transparent pixels composited over white);
* the **parent** is the icon's freedesktop context (``actions``, ``apps``,
  ``devices``, ``mimetypes``, ``places``, ``status``, ...): the majority of the
  ``Context=`` keys of the theme folders that hold the name (``index.theme``).

Kept classes are drawn by at least ``min_themes`` themes, at least one from each
theme group (the query group and the gallery group of the retrieval protocol).
Two guards keep the classes honest: within a class, a drawing pixel-identical to
one of an earlier theme (a theme re-using another's file) is dropped; across
classes, a drawing identical to one already used by another class in the same
theme (an alias such as ``gtk-save`` for ``document-save``) is dropped, so alias
names lose their images and fall under ``min_themes``. Classes are then split
half/half into train and test classes within each parent (seeded), so the parent
level exists on both sides while the icon classes are disjoint.

The output is deterministic for a given set of installed themes, image size and
seed. ``ICONS_LICENSES.md`` is regenerated from the Debian ``copyright`` files of
the theme packages used.

Design note: docs/design/icons-domain.md
"""
from __future__ import annotations

import argparse
import collections
import configparser
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ICON_ROOT = "/usr/share/icons"

ThemeSpec = collections.namedtuple("ThemeSpec", ["name", "debian_package", "folder", "group"])

# One theme per artwork family: variants that only recolour another theme (Papirus-Dark,
# Obsidian = Faenza recoloured, elementary-xfce, Numix-Light, ...) are left out, so that two
# "instances" are two drawings. Themes that share much artwork (gnome, mate and adwaita's full-colour
# icons; moka and faba) sit in the same group, so a query is never a near copy of its gallery match.
# The query group mixes flat, skeuomorphic and outline styles, like the gallery group.
THEME_SPECS = [
    ThemeSpec("adwaita", "adwaita-icon-theme", "Adwaita", "gallery"),
    ThemeSpec("breeze", "breeze-icon-theme", "breeze", "gallery"),
    ThemeSpec("papirus", "papirus-icon-theme", "Papirus", "query"),
    ThemeSpec("numix", "numix-icon-theme", "Numix", "gallery"),
    ThemeSpec("numix-circle", "numix-icon-theme-circle", "Numix-Circle", "gallery"),
    ThemeSpec("elementary", "elementary-icon-theme", "elementary", "query"),
    ThemeSpec("oxygen", "oxygen-icon-theme", "oxygen", "query"),
    ThemeSpec("moka", "moka-icon-theme", "Moka", "gallery"),
    ThemeSpec("faba", "faba-icon-theme", "Faba", "gallery"),
    ThemeSpec("tango", "tango-icon-theme", "Tango", "query"),
    ThemeSpec("gnome", "gnome-icon-theme", "gnome", "gallery"),
    ThemeSpec("mate", "mate-icon-theme", "mate", "gallery"),
    ThemeSpec("suru", "suru-icon-theme", "suru", "gallery"),
    ThemeSpec("deepin-bloom", "deepin-icon-theme", "bloom", "gallery"),
    ThemeSpec("paper", "paper-icon-theme", "Paper", "query"),
    ThemeSpec("nuovext2", "lxde-icon-theme", "nuoveXT2", "gallery"),
    ThemeSpec("faenza", "faenza-icon-theme", "Faenza", "gallery"),
    ThemeSpec("nuovo", "gnome-icon-theme-nuovo", "Nuovo", "query"),
    ThemeSpec("gartoon", "gnome-icon-theme-gartoon", "gartoon", "gallery"),
    ThemeSpec("yasis", "gnome-icon-theme-yasis", "yasis", "gallery"),
    ThemeSpec("sugar", "sugar-icon-theme", "sugar", "query"),
]

# freedesktop contexts kept as parents, and the spellings themes use for them.
PARENTS = ("actions", "apps", "categories", "devices", "emblems", "mimetypes", "places", "status")
_CONTEXT_ALIASES = {
    "actions": "actions", "applications": "apps", "apps": "apps", "categories": "categories",
    "devices": "devices", "device": "devices", "hardware": "devices", "emblems": "emblems",
    "mimetypes": "mimetypes", "mimes": "mimetypes", "places": "places", "filesystems": "places",
    "filesytems": "places", "status": "status", "stxatus": "status", "notifications": "status",
    # faces and animations are not kept as classes
    "emotes": "emotes", "animations": "animations",
}
_EXCLUDED_CONTEXTS = ("emotes", "animations")
_IMAGE_SUFFIXES = (".svg", ".svgz", ".png")

Candidate = collections.namedtuple("Candidate", ["path", "context", "size", "scalable", "symbolic"])


def normalise_context(raw: Optional[str]) -> Optional[str]:
    """The freedesktop context a ``Context=`` value (or folder name) stands for.

    Args:
        raw: the value, e.g. ``"Applications"``, ``"MimeTypes"``, ``"FileSystems"``.

    Returns:
        One of :data:`PARENTS`, ``"emotes"``, ``"animations"``, or None for an unknown context.
    """
    if not raw:
        return None
    return _CONTEXT_ALIASES.get(raw.strip().lower())


def normalise_name(file_name: str) -> Tuple[str, bool]:
    """``(icon name, is symbolic)`` of an icon file name (suffix and ``-symbolic`` stripped).

    Args:
        file_name: e.g. ``"edit-copy-symbolic.svg"``.

    Returns:
        The name and whether it was the symbolic variant.
    """
    stem = file_name
    for suffix in _IMAGE_SUFFIXES:
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    symbolic = stem.endswith("-symbolic")
    if symbolic:
        stem = stem[: -len("-symbolic")]
    return stem, symbolic


def _theme_directories(theme_dir: str):
    """``(relative folder, section dict)`` for every folder listed in the theme's ``index.theme``."""
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    index = os.path.join(theme_dir, "index.theme")
    with open(index, encoding="utf-8", errors="replace") as handle:
        parser.read_file(handle)
    listed = []
    for key in ("Directories", "ScaledDirectories"):
        if parser.has_option("Icon Theme", key):
            listed += [d.strip() for d in parser.get("Icon Theme", key).split(",") if d.strip()]
    seen = set()
    for folder in listed:
        if folder in seen:
            continue
        seen.add(folder)
        section = dict(parser.items(folder)) if parser.has_section(folder) else {}
        yield folder, section


def scan_theme(theme_dir: str) -> Dict[str, List[Candidate]]:
    """Every icon file of one theme (not of the themes it inherits from), by normalised name.

    Folders are those listed in ``index.theme``; scaled (HiDPI, ``Scale`` > 1) folders are skipped.
    A folder's context is its ``Context=`` key, else the first path component that names a
    context (``48x48/apps`` -> apps).

    Args:
        theme_dir: the theme's folder (holding ``index.theme``).

    Returns:
        Icon name -> candidate files (path, context, nominal size, scalable, symbolic).
    """
    found: Dict[str, List[Candidate]] = collections.defaultdict(list)
    for folder, section in _theme_directories(theme_dir):
        if int(float(section.get("Scale", "1") or 1)) != 1:
            continue
        path = os.path.join(theme_dir, folder)
        if not os.path.isdir(path):
            continue
        context = normalise_context(section.get("Context"))
        if context is None:
            context = next((normalise_context(part) for part in folder.split("/")
                            if normalise_context(part)), None)
        try:
            size = int(section.get("Size", "0") or 0)
        except ValueError:
            size = 0
        scalable = section.get("Type", "Threshold").strip().lower() == "scalable"
        for file_name in sorted(os.listdir(path)):
            if not file_name.lower().endswith(_IMAGE_SUFFIXES):
                continue
            file_path = os.path.join(path, file_name)
            if not os.path.isfile(file_path):  # dangling link
                continue
            name, symbolic = normalise_name(file_name)
            found[name].append(Candidate(file_path, context, size, scalable, symbolic))
    return dict(found)


def choose_source(candidates: Sequence[Candidate], size: int) -> Candidate:
    """The file to rasterise for one theme's icon at ``size`` px.

    Full-colour before symbolic; then vector art (scalable folders, or SVG drawn for a size of at
    least ``size``), then the smallest bitmap of at least ``size`` px, then the largest smaller one.
    Ties go to the path, so the choice is deterministic.

    Args:
        candidates: the theme's files for one icon name (non-empty).
        size: target image side in pixels.

    Returns:
        The chosen candidate.
    """
    def rank(candidate: Candidate):
        vector = candidate.path.lower().endswith((".svg", ".svgz"))
        if candidate.scalable and vector:
            tier, distance = 0, 0
        elif candidate.size >= size:
            tier, distance = 1, candidate.size - size
        else:
            tier, distance = 2, size - candidate.size
        return (candidate.symbolic, tier, distance, not vector, candidate.path)

    return min(candidates, key=rank)


def _composite_square(rgba, size: int) -> np.ndarray:
    """An RGBA PIL image fitted (aspect kept) and centred in ``size`` x ``size``, over white, as RGB."""
    from PIL import Image

    rgba = rgba.convert("RGBA")
    # composite at native resolution first: resizing premultiplied-over-white RGB has no alpha fringe
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    rgb = Image.alpha_composite(white, rgba).convert("RGB")
    width, height = rgb.size
    scale = size / max(width, height)
    new_size = (max(1, round(width * scale)), max(1, round(height * scale)))
    if new_size != rgb.size:
        rgb = rgb.resize(new_size, Image.LANCZOS)
    canvas = Image.new("RGB", (size, size), (255, 255, 255))
    canvas.paste(rgb, ((size - new_size[0]) // 2, (size - new_size[1]) // 2))
    return np.asarray(canvas, dtype=np.uint8)


def rasterise(path: str, size: int, rsvg: Optional[str] = None) -> np.ndarray:
    """One icon file as a ``(size, size, 3)`` uint8 RGB array, transparency composited over white.

    SVG (and gzipped SVGZ) goes through ``rsvg-convert`` (Debian ``librsvg2-bin``), fitted into the
    square with its aspect ratio kept; PNG is read by PIL and resampled (Lanczos).

    Args:
        path: an ``.svg``, ``.svgz`` or ``.png`` file.
        size: output side in pixels.
        rsvg: the ``rsvg-convert`` executable; default: looked up on ``PATH``.

    Returns:
        The RGB image.

    Raises:
        RuntimeError: an SVG but no ``rsvg-convert``, or it failed on the file.
    """
    from PIL import Image

    if path.lower().endswith((".svg", ".svgz")):
        rsvg = rsvg or shutil.which("rsvg-convert")
        if rsvg is None:
            raise RuntimeError("rasterising SVG needs rsvg-convert (Debian package librsvg2-bin)")
        result = subprocess.run([rsvg, "-w", str(size), "-h", str(size), "-a", "-f", "png", path],
                                capture_output=True, timeout=60)
        if result.returncode != 0 or not result.stdout:
            raise RuntimeError(f"rsvg-convert failed on {path}: {result.stderr.decode(errors='replace')[:200]}")
        image = Image.open(io.BytesIO(result.stdout))
    else:
        image = Image.open(path)
    image.load()
    return _composite_square(image, size)


def debian_package_info(package: str, doc_root: str = "/usr/share/doc") -> Dict[str, str]:
    """Version (``dpkg-query``), licence and copyright holders (``copyright`` file) of a package.

    The ``Files: *`` stanza of a machine-readable copyright file is read; older free-form files are
    summarised from their ``Copyright``/``License`` lines and the licence named in their text.

    Args:
        package: Debian package name.
        doc_root: folder holding ``<package>/copyright``.

    Returns:
        ``{"package", "version", "license", "copyright"}`` (empty strings where unknown).
    """
    info = {"package": package, "version": "", "license": "", "copyright": ""}
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
        info["version"] = out.stdout.strip() if out.returncode == 0 else ""
    except OSError:
        pass
    path = os.path.join(doc_root, package, "copyright")
    if not os.path.exists(path):
        info["license"] = "(copyright file not found)"
        return info
    with open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    stanza = next((block for block in re.split(r"\n\s*\n", text)
                   if re.search(r"^Files:\s*(\*|\S*\*\S*|src/\*\.svg|suru/\*)\s*$", block, re.M)), None)
    if stanza is not None:
        licence = re.search(r"^License:\s*(.+)$", stanza, re.M)
        holders = re.search(r"^Copyright:(.*(?:\n[ \t]+.*)*)", stanza, re.M)
        info["license"] = licence.group(1).strip() if licence else ""
        if holders:
            lines = [line.strip(" .") for line in holders.group(1).split("\n")]
            lines = [line for line in lines if line and not set(line) <= set("=")]
            info["copyright"] = "; ".join(lines)
    if not info["license"]:
        upper = text.upper()
        if "GNU GENERAL PUBLIC LICENSE" in upper and "VERSION 2 OF THE LICENSE, OR" in upper:
            info["license"] = "GPL-2+"
        elif "LESSER GENERAL PUBLIC" in upper:
            info["license"] = "LGPL"
    if not info["copyright"]:
        match = re.search(r"^(?:Copyright(?: Holders)?|Upstream Author):\s*(.+)$", text, re.M)
        info["copyright"] = match.group(1).strip() if match else ""
    if len(info["copyright"]) > 240:
        info["copyright"] = info["copyright"][:237] + "..."
    return info


def write_license_file(path: str, themes: Sequence[ThemeSpec], packages: Dict[str, Dict[str, str]],
                       counts: Dict[str, int], num_classes: int, size: int) -> None:
    """Write ``ICONS_LICENSES.md``: the source of every image and its theme's licence.

    Args:
        path: the Markdown file to write.
        themes: the themes used, in table order.
        packages: theme name -> :func:`debian_package_info` of its package.
        counts: theme name -> images kept.
        num_classes: classes in the archive.
        size: image side in pixels.
    """
    lines = [
        "# Bundled icon dataset: sources and licences",
        "",
        f"`icon_themes.npz` holds {size}-px RGB rasterisations of {num_classes} freedesktop.org icon names",
        f"as drawn by {len(themes)} icon themes, generated by `python -m pml_hyperbolic.data.build_icons`",
        "from Debian packages (SVG rendered with `rsvg-convert`, PNG resampled with Pillow, transparency",
        "composited over white). The images are small renderings of the themes' artwork; they keep the",
        "licence of the theme they come from, as stated in the Debian `copyright` file",
        "(`/usr/share/doc/<package>/copyright`), which holds the full licence texts. All are free",
        "licences that allow redistribution of modified works (GPL, LGPL, CC-BY-SA, public domain);",
        "the CC-BY-SA and GPL/LGPL terms apply to `icon_themes.npz` as a derived work of the artwork.",
        "Long lists of copyright holders are cut short here (`...`); the copyright file lists them all.",
        "",
        "| Theme | Debian package | Version | Images | Licence | Copyright |",
        "|---|---|---|---|---|---|",
    ]
    for theme in themes:
        info = packages[theme.name]
        holders = info["copyright"].replace("|", "/") or "see copyright file"
        lines.append(f"| {theme.folder} | `{theme.debian_package}` | {info['version']} | {counts.get(theme.name, 0)} "
                     f"| {info['license']} | {holders} |")
    lines += ["", "Icon names follow the freedesktop.org Icon Naming Specification and the themes' own",
              "names; the parent of each class is the theme folders' `Context` (Icon Theme Specification).", ""]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))


def install_theme_packages(themes: Sequence[ThemeSpec] = THEME_SPECS) -> None:
    """``apt-get install`` the rasteriser and the theme packages (needs root).

    Args:
        themes: the themes whose packages to install.

    Raises:
        subprocess.CalledProcessError: apt-get failed.
    """
    packages = sorted({"librsvg2-bin", *(theme.debian_package for theme in themes)})
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *packages], check=True)


def _majority(votes: Sequence[Optional[str]]) -> Optional[str]:
    counted = collections.Counter(vote for vote in votes if vote is not None)
    if not counted:
        return None
    best = max(counted.values())
    return min(context for context, count in counted.items() if count == best)  # ties: alphabetical


def ink_fraction(image: np.ndarray, threshold: int = 48) -> float:
    """Share of pixels at least ``threshold`` grey levels darker than white in some channel.

    Args:
        image: ``(H, W, 3)`` uint8 RGB over white.
        threshold: least darkening counted as ink.

    Returns:
        A fraction in [0, 1].
    """
    return float(((255 - image.min(axis=-1)) >= threshold).mean())


def near_duplicate(first: np.ndarray, second: np.ndarray, tolerance: float) -> bool:
    """Whether two drawings differ by at most ``tolerance`` grey levels on average (mean absolute).

    Args:
        first: ``(H, W, 3)`` uint8 image.
        second: an image of the same shape.
        tolerance: largest mean absolute difference still counted as a copy.

    Returns:
        True for a (near) copy.
    """
    return float(np.abs(first.astype(np.int16) - second.astype(np.int16)).mean()) <= tolerance


def split_classes(parents: np.ndarray, test_fraction: float = 0.5, seed: int = 0) -> np.ndarray:
    """Boolean "is a test class" per class: a seeded ``test_fraction`` of every parent's classes.

    Args:
        parents: parent index per class.
        test_fraction: share of each parent's classes held out (rounded half up, at most all but one
            class of a parent with two or more classes).
        seed: permutation seed.

    Returns:
        ``(C,)`` bool array.
    """
    rng = np.random.default_rng(seed)
    is_test = np.zeros(len(parents), dtype=bool)
    for parent in np.unique(parents):
        members = np.flatnonzero(parents == parent)
        members = members[rng.permutation(len(members))]
        count = int(np.floor(len(members) * test_fraction + 0.5))
        if len(members) >= 2:
            count = min(max(count, 1), len(members) - 1)
        is_test[members[:count]] = True
    return is_test


def build(output: str, size: int = 48, min_themes: int = 5, max_classes: Optional[int] = None,
          seed: int = 0, icon_root: str = ICON_ROOT, themes: Sequence[ThemeSpec] = THEME_SPECS,
          license_output: Optional[str] = None, workers: int = 2, min_ink: float = 0.02,
          duplicate_tolerance: float = 4.0, verbose: bool = True) -> Dict[str, object]:
    """Scan the installed themes, select classes, rasterise and write the ``.npz`` archive.

    Args:
        output: the ``.npz`` file to write.
        size: image side in pixels.
        min_themes: least number of themes (after duplicate removal) drawing a kept class.
        max_classes: keep at most this many classes (those drawn by the most themes; ties by name).
        seed: seed of the train/test class split.
        icon_root: folder holding the theme folders.
        themes: the themes to read; those not installed are skipped.
        license_output: where to write the licence table (``None``: not written).
        workers: rasterising threads.
        min_ink: least share of non-white pixels (:func:`ink_fraction`) of a kept drawing.
        duplicate_tolerance: mean absolute difference (grey levels) at or under which two drawings of
            one class count as copies (:func:`near_duplicate`); the later theme's is dropped.
        verbose: print progress to stderr.

    Returns:
        The archive's metadata (also stored in it as JSON).

    Raises:
        ValueError: fewer than two installed themes, or no class left.
    """
    def log(message):
        if verbose:
            print(message, file=sys.stderr, flush=True)

    installed = [t for t in themes if os.path.isfile(os.path.join(icon_root, t.folder, "index.theme"))]
    if len(installed) < 2:
        raise ValueError(f"fewer than two of the themes are installed under {icon_root}")
    scans = {theme.name: scan_theme(os.path.join(icon_root, theme.folder)) for theme in installed}
    log(f"scanned {len(installed)} themes: " + ", ".join(f"{t.name}={len(scans[t.name])}" for t in installed))

    groups = {theme.name: theme.group for theme in installed}
    drawn_by = collections.defaultdict(list)
    for theme in installed:
        for name in scans[theme.name]:
            drawn_by[name].append(theme.name)

    def enough(theme_names):
        return (len(theme_names) >= min_themes and {groups[t] for t in theme_names} >= {"query", "gallery"})

    candidates = {}
    for name in sorted(drawn_by):
        if not enough(drawn_by[name]) or name.startswith("face-"):
            continue
        votes = [c.context for t in drawn_by[name] for c in [choose_source(scans[t][name], size)]]
        parent = _majority(votes)
        if parent is None or parent in _EXCLUDED_CONTEXTS:
            continue
        candidates[name] = parent
    log(f"{len(candidates)} candidate names drawn by >= {min_themes} themes")

    jobs = [(name, theme.name) for name in candidates for theme in installed if name in scans[theme.name]]
    rsvg = shutil.which("rsvg-convert")

    def work(job):
        name, theme_name = job
        source = choose_source(scans[theme_name][name], size)
        try:
            return rasterise(source.path, size, rsvg)
        except Exception:  # an unreadable file: this theme does not draw the icon
            return None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        images = dict(zip(jobs, pool.map(work, jobs)))
    log(f"rasterised {sum(v is not None for v in images.values())} of {len(jobs)} drawings")

    theme_order = [theme.name for theme in installed]

    def digest(array):
        return hashlib.sha1(array.tobytes()).hexdigest()

    # Per class: drop unreadable and near-invisible drawings (e.g. white panel icons), and drawings that
    # nearly copy one kept from an earlier theme.
    per_class = {}
    for name in candidates:
        kept = []
        for theme_name in theme_order:
            image = images.get((name, theme_name))
            if image is None or ink_fraction(image) < min_ink:
                continue
            if any(near_duplicate(image, other, duplicate_tolerance) for _, other, _ in kept):
                continue
            kept.append((theme_name, image, digest(image)))
        per_class[name] = kept

    # Across classes: most-drawn names first, then names drawn by real files rather than links (themes
    # link alias names to the canonical file); a drawing already used by an accepted class in the same
    # theme marks an alias and is dropped.
    def real_files(name):
        return sum(not os.path.islink(choose_source(scans[t][name], size).path) for t, _, _ in per_class[name])

    order = sorted(per_class, key=lambda n: (-len(per_class[n]), -real_files(n), n))
    used = set()
    accepted = []
    for name in order:
        kept = [(t, image, key) for t, image, key in per_class[name] if (t, key) not in used]
        if not enough([t for t, _, _ in kept]):
            continue
        used.update((t, key) for t, _, key in kept)
        accepted.append((name, kept))
        if max_classes is not None and len(accepted) >= max_classes:
            break
    if not accepted:
        raise ValueError("no icon name is drawn by enough themes")
    accepted.sort(key=lambda item: (PARENTS.index(candidates[item[0]]), item[0]))
    log(f"{len(accepted)} classes kept")

    class_names = np.array([name for name, _ in accepted])
    class_parents = np.array([PARENTS.index(candidates[name]) for name, _ in accepted], dtype=np.int64)
    class_is_test = split_classes(class_parents, 0.5, seed)
    theme_index = {name: i for i, name in enumerate(theme_order)}
    item_images, item_classes, item_themes = [], [], []
    for class_id, (_, kept) in enumerate(accepted):
        for theme_name, image, _ in kept:
            item_images.append(image)
            item_classes.append(class_id)
            item_themes.append(theme_index[theme_name])

    counts = collections.Counter(theme_order[t] for t in item_themes)
    packages = {theme.name: debian_package_info(theme.debian_package) for theme in installed}
    rsvg_version = ""
    if rsvg:
        rsvg_version = subprocess.run([rsvg, "--version"], capture_output=True, text=True).stdout.strip()
    metadata = {
        "image_size": size,
        "min_themes": min_themes,
        "max_classes": max_classes,
        "seed": seed,
        "num_classes": len(class_names),
        "num_images": len(item_images),
        "themes": {theme.name: {"folder": theme.folder, "group": theme.group,
                                "package": theme.debian_package, "version": packages[theme.name]["version"],
                                "license": packages[theme.name]["license"], "images": counts.get(theme.name, 0)}
                   for theme in installed},
        "rasteriser": rsvg_version,
        "background": "white",
        "min_ink": min_ink,
        "duplicate_tolerance": duplicate_tolerance,
    }
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    np.savez_compressed(
        output,
        images=np.stack(item_images).astype(np.uint8),
        item_classes=np.array(item_classes, dtype=np.int16),
        item_themes=np.array(item_themes, dtype=np.int16),
        class_names=class_names,
        class_parents=class_parents.astype(np.int16),
        class_is_test=class_is_test,
        parent_names=np.array(PARENTS),
        theme_names=np.array(theme_order),
        theme_groups=np.array([groups[t] for t in theme_order]),
        metadata=np.array(json.dumps(metadata, sort_keys=True)),
    )
    if license_output:
        write_license_file(license_output, installed, packages, counts, len(class_names), size)
    log(f"wrote {output}: {len(item_images)} images, {os.path.getsize(output) / 1e6:.2f} MB")
    return metadata


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line: ``python -m pml_hyperbolic.data.build_icons --help``."""
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", "--output", dest="output", default=os.path.join(here, "icon_themes.npz"))
    parser.add_argument("--license-output", default=None,
                        help="licence table to write (default: ICONS_LICENSES.md next to --out)")
    parser.add_argument("--size", type=int, default=48, help="image side in pixels")
    parser.add_argument("--min-themes", type=int, default=5, help="least number of themes drawing a class")
    parser.add_argument("--max-classes", type=int, default=None, help="keep at most this many classes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/test class split")
    parser.add_argument("--icon-root", default=ICON_ROOT, help="folder holding the theme folders")
    parser.add_argument("--workers", type=int, default=2, help="rasterising threads")
    parser.add_argument("--install-themes", action="store_true", help="apt-get install the theme packages first")
    args = parser.parse_args(argv)
    if args.size < 8 or args.size > 512:
        parser.error(f"--size must be in [8, 512], got {args.size}")
    if args.min_themes < 2:
        parser.error(f"--min-themes must be at least 2, got {args.min_themes}")
    if args.max_classes is not None and args.max_classes < 2:
        parser.error(f"--max-classes must be at least 2, got {args.max_classes}")
    if args.install_themes:
        install_theme_packages()
    license_output = args.license_output or os.path.join(os.path.dirname(os.path.abspath(args.output)),
                                                         "ICONS_LICENSES.md")
    build(args.output, size=args.size, min_themes=args.min_themes, max_classes=args.max_classes, seed=args.seed,
          icon_root=args.icon_root, license_output=license_output, workers=args.workers)


if __name__ == "__main__":
    main()
