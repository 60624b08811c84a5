"""Builder for the bundled Iconify icon-set dataset (``iconify_sets.npz``).

Run as (a maintainer tool; nothing here runs at training or test time)::

    sudo apt-get install librsvg2-bin nodejs npm
    python -m pml_hyperbolic.data.build_iconify --fetch [--size 48]

What it builds: one icon concept drawn by many monochrome icon sets, as published on the npm
registry in the ``@iconify-json/<prefix>`` packages (IconifyJSON: ``icons.json``, ``info.json``).

* a **class** is a normalised icon name (``bell``, ``arrow-left``, ``file-text``, ...) drawn by
  several sets. Each set's style suffixes are stripped (``-outline``, ``-line``, ``-fill``,
  ``-24-regular``, ...), one style is kept per set (its outline or default one, :data:`SET_SPECS`),
  and a numbered variant (``home-01``) stands for the base name when the set has no unnumbered one;
* an **instance** is one set's drawing of the name, its SVG ``body`` rendered black (``currentColor``)
  on white into a square greyscale image, aspect ratio kept;
* the **parent** is a topic (arrows, files, media, weather, ...) read from the name's tokens through a
  fixed lexicon (:data:`TOPICS`): the first token that the lexicon knows decides, so ``arrow-*`` and
  ``file-*`` keep their head-noun family and ``cloud-upload`` is weather-and-sky, not arrows.

Kept classes are drawn by at least ``min_sets`` sets, at least one from each group (the query and
gallery groups of the retrieval protocol). The same two guards as the freedesktop icon builder keep
the classes honest: within a class, a drawing that nearly copies one kept from an earlier set is
dropped (sets that fork another's artwork); across classes, a drawing identical to one already used
by another class of the same set (two names for one drawing) is dropped. Names of brands and logos
are never classes; emoji, flag and logo sets are never read (:func:`check_set_allowed`). Classes are
split half/half into train and test within each topic (seeded); topics with fewer than
``min_topic_classes`` classes are merged into ``other``.

The output is deterministic for the pinned package versions, image size and seed.
``ICONIFY_LICENSES.md`` is regenerated from the packages' ``info.json``.

Design note: docs/design/iconify-domain.md
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .build_icons import near_duplicate, split_classes

SetSpec = collections.namedtuple("SetSpec", ["prefix", "version", "group", "styles", "keep"])

_FLUENT_STYLES = tuple(f"{size}-{kind}" for size in (10, 12, 16, 20, 24, 28, 32, 48)
                       for kind in ("regular", "filled", "light", "color"))


def _spec(prefix: str, version: str, group: str, styles: Tuple[str, ...] = (), keep: Tuple[str, ...] = ("",)):
    return SetSpec(prefix, version, group, styles, keep)


# One style per set: ``styles`` are the suffixes that mark a style variant in the set, ``keep`` the
# accepted ones in order of preference ("" = the unsuffixed name). Sets of one lineage (mdi and
# material-symbols, both Google Material; tabler and lucide, both stroke-2 24-px line icons) sit in the
# same group, so a query is not a near copy of its gallery match. About a third of the sets form the
# query group, mixing filled, line and geometric styles like the gallery group.
SET_SPECS = [
    _spec("tabler", "1.2.41", "gallery", ("filled",)),
    _spec("lucide", "1.2.137", "gallery"),
    _spec("mdi", "1.2.3", "gallery", ("outline",), ("outline", "")),
    _spec("material-symbols", "1.2.98", "gallery",
          ("outline", "rounded", "sharp", "outline-rounded", "outline-sharp", "rounded-filled", "sharp-filled"),
          ("outline", "")),
    _spec("fluent", "1.2.60", "gallery", _FLUENT_STYLES,
          tuple(f"{size}-regular" for size in (24, 20, 28, 32, 16, 48, 12, 10))),
    _spec("hugeicons", "1.2.35", "gallery"),
    _spec("mingcute", "1.2.8", "gallery", ("line", "fill"), ("line",)),
    _spec("bi", "1.2.7", "gallery", ("fill",)),
    _spec("carbon", "1.2.29", "gallery", ("filled",)),
    _spec("icon-park-outline", "1.2.4", "gallery"),
    _spec("solar", "1.2.13", "gallery",
          ("linear", "bold", "broken", "outline", "line-duotone", "bold-duotone", "duotone"), ("linear",)),
    _spec("tdesign", "1.2.19", "gallery", ("filled",)),
    _spec("ion", "1.2.7", "gallery", ("outline", "sharp"), ("outline", "")),
    _spec("heroicons", "1.2.3", "gallery", ("solid", "20-solid", "16-solid", "outline"), ("", "outline")),
    _spec("majesticons", "1.2.5", "gallery", ("line",), ("line", "")),
    _spec("humbleicons", "1.2.20", "gallery"),
    _spec("ph", "1.2.2", "query", ("bold", "light", "thin", "duotone", "fill")),
    _spec("ri", "1.2.10", "query", ("line", "fill"), ("line", "")),
    _spec("iconoir", "1.2.11", "query", ("solid",)),
    _spec("uil", "1.2.3", "query"),
    _spec("jam", "1.2.3", "query", ("f",)),
    _spec("clarity", "1.2.4", "query",
          ("line", "solid", "outline-badged", "solid-badged", "outline-alerted", "solid-alerted",
           "line-badged", "line-alerted"), ("line", "")),
    _spec("akar-icons", "1.2.7", "query", ("fill",)),
    _spec("octicon", "1.2.36", "query", ("16", "24", "12", "fill-16", "fill-24", "fill-12"), ("24", "16", "12")),
]

#: Licences (SPDX) accepted: permissive ones that allow redistributing modified works with attribution.
PERMISSIVE_LICENSES = ("MIT", "ISC", "Apache-2.0", "CC-BY-4.0", "CC-BY-3.0", "CC0-1.0", "OFL-1.1",
                       "Unlicense", "BSD-2-Clause", "BSD-3-Clause")
#: Set prefixes and ``info.json`` categories never read: emoji artwork is reserved for evaluation
#: elsewhere, flags and logos are brand or national marks, not icon concepts.
EXCLUDED_CATEGORIES = ("emoji", "flags / maps", "flags", "brands / social", "logos", "brands")
_EXCLUDED_PREFIX_WORDS = ("emoji", "twemoji", "openmoji", "emojione", "fxemoji", "noto", "flag", "logos",
                          "brand", "logo", "circle-flags", "cif", "fa-brands", "fa6-brands", "simple-icons")

#: Name tokens that mark a brand, a company or a logo: such names are never classes.
BRAND_TOKENS = frozenset(
    "logo brand google github gitlab bitbucket apple android windows microsoft linux ubuntu facebook twitter "
    "instagram linkedin youtube slack discord figma dribbble behance chrome firefox safari opera whatsapp "
    "telegram reddit pinterest tiktok twitch spotify amazon paypal stripe codepen dropbox medium skype snapchat "
    "vimeo wordpress npm react vue angular python javascript typescript html5 css3 docker kubernetes xbox "
    "playstation steam tumblr yahoo mastodon messenger wechat weibo qq alipay meta threads bluesky notion "
    "trello jira confluence gmail outlook teams zoom vk unsplash product-hunt patreon kickstarter stackoverflow "
    "angellist airbnb uber lyft netflix hulu soundcloud deezer bandcamp shazam evernote onedrive icloud "
    "sketch adobe photoshop illustrator framer webflow vercel netlify heroku firebase mongodb mysql postgres "
    "redis nodejs deno bun rust golang java kotlin swift php ruby rails laravel django flask svelte tailwind "
    "bootstrap sass less webpack vite babel eslint prettier jest graphql ethereum bitcoin litecoin dogecoin "
    "visa mastercard amex discover-card klarna shopify woocommerce magento ebay etsy aliexpress openai "
    "chatgpt anthropic claude gemini copilot vscode intellij sublime atom vim emacs ios macos finder "
    "huawei xiaomi samsung nokia sony nintendo switch-logo steam-logo epic ea blender unity unreal godot "
    "codesandbox replit glitch jsfiddle jsdelivr unpkg cdnjs x-logo".split())

#: Topic lexicon: the parent of a class is the topic of the first of its name's tokens found here.
TOPICS: Dict[str, Tuple[str, ...]] = {
    "arrows": ("arrow", "arrows", "chevron", "chevrons", "caret", "corner", "direction", "move", "redo", "undo",
               "rotate", "refresh", "reload", "repeat", "sync", "expand", "collapse", "maximize", "minimize",
               "external", "back", "forward", "reply", "switch", "swap", "transfer", "exchange",
               "login", "logout", "enter", "exit", "sort", "shuffle", "route", "fork", "merge", "split", "replay",
               "restart", "flip"),
    "files": ("file", "files", "folder", "folders", "document", "documents", "clipboard", "note", "notes",
              "notebook", "archive", "page", "pages", "copy", "paste", "attachment", "paperclip", "save",
              "download", "upload", "import", "export", "inbox", "zip", "pdf", "csv", "doc", "report", "license",
              "certificate", "receipt", "sticky", "stamp", "form", "scroll", "box", "package", "stack", "layers", "album", "library"),
    "communication": ("mail", "email", "envelope", "message", "messages", "chat", "chats", "comment", "comments",
                      "phone", "call", "send", "bell", "notification", "notifications", "megaphone", "speakerphone",
                      "at", "contact", "contacts", "voicemail", "broadcast", "rss", "feed", "share", "forum",
                      "inbox", "mailbox", "postcard", "announcement", "talk", "conversation", "reply"),
    "media": ("play", "pause", "stop", "record", "music", "song", "video", "camera", "film", "movie", "image",
              "images", "photo", "photos", "picture", "gallery", "microphone", "mic", "volume", "headphones",
              "headset", "speaker", "radio", "disc", "cd", "player", "skip", "rewind", "fast", "playlist",
              "track", "audio", "sound", "mute", "unmute", "live", "podcast", "slideshow", "clapperboard",
              "aperture", "focus", "flash", "flashlight", "brightness", "contrast", "hdr", "hd", "gif", "eject",
              "screenshot", "shutter", "cast", "screencast", "subtitles", "closed", "captions",
              "equalizer", "waveform", "vinyl", "cassette", "metronome", "piano", "guitar", "drum", "tv",
              "television", "projector", "theater", "ticket"),
    "devices": ("device", "devices", "laptop", "desktop", "computer", "monitor", "screen", "display", "mobile",
                "smartphone", "cellphone", "tablet", "keyboard", "mouse", "printer", "server", "cpu", "chip",
                "battery", "plug", "usb", "bluetooth", "wifi", "router", "drive", "harddrive", "hard", "database",
                "sd", "sim", "smartwatch", "gamepad", "joystick", "controller", "memory", "ram", "disk",
                "save", "cable", "ethernet", "antenna", "signal", "satellite", "webcam", "scanner", "fax",
                "calculator", "charger", "charging", "power", "socket", "outlet", "nfc", "cellular", "network",
                "hdd", "ssd", "floppy", "circuit", "robot", "airplay", "wireless", "modem",
                "lightbulb", "bulb", "lamp", "fan", "thermostat", "remote", "gpu", "vr", "print", "radar",
                "drone", "washing", "dialpad"),
    "people": ("user", "users", "person", "people", "account", "profile", "group", "team", "baby", "child",
               "man", "woman", "male", "female", "gender", "accessibility", "accessible", "wheelchair",
               "face", "smile", "mood", "handshake", "hand", "hands", "thumb", "thumbs", "walk", "run", "running",
               "swim", "body", "id", "identification", "graduation", "badge", "vcard", "friends", "family", "pregnant",
               "crowd", "customer", "student", "teacher", "worker", "incognito", "spy", "ghost",
               "skull", "brain", "ear", "eye", "mouth", "nose", "tooth", "finger", "fingerprint", "footprint"),
    "text": ("text", "align", "bold", "italic", "underline", "strikethrough", "heading", "font", "letter",
             "list", "indent", "outdent", "paragraph", "quote", "blockquote", "pen", "pencil", "edit", "eraser",
             "highlight", "highlighter", "format", "type", "typography", "subscript", "superscript", "spell",
             "border", "table", "columns", "column", "row", "rows", "layout", "grid", "h1", "h2", "h3", "h4",
             "abc", "translate", "language", "signature", "caption", "wrap", "line", "spacing", "clear",
             "writing", "write", "keyboard", "backspace", "emphasis", "ruler", "scribble", "cursor", "markdown", "article",
             "news", "newspaper", "book", "books", "bookmark", "bookmarks", "library"),
    "charts": ("chart", "charts", "graph", "pie", "bar", "trend", "trending", "analytics", "presentation",
               "statistics", "stats", "diagram", "activity", "dashboard", "gauge", "speedometer", "funnel",
               "timeline", "histogram", "scatter", "kanban"),
    "commerce": ("shopping", "cart", "bag", "basket", "currency", "money", "coin", "coins", "wallet", "credit",
                 "card", "creditcard", "receipt", "tag", "tags", "ticket", "dollar", "euro", "pound", "yen", "rupee",
                 "bitcoin", "bank", "store", "shop", "storefront", "gift", "percent", "percentage", "discount",
                 "cash", "price", "sale", "invoice", "barcode", "qrcode", "qr", "scale", "calculator", "building",
                 "buildings", "briefcase", "business", "safe", "piggy", "coupon", "truck", "delivery", "package",
                 "bill", "label", "shirt", "t-shirt", "handbag", "backpack"),
    "security": ("lock", "unlock", "locked", "unlocked", "key", "keys", "shield", "security", "password",
                 "fingerprint", "scan", "eye", "visibility", "hide", "view", "verified", "secure", "privacy",
                 "alarm", "siren", "cctv", "firewall", "bug", "virus", "keyhole", "passkey"),
    "nature": ("cloud", "clouds", "cloudy", "sun", "sunny", "moon", "rain", "snow", "snowflake", "wind", "storm",
               "thunderstorm", "thunder", "lightning", "bolt", "umbrella", "leaf", "leaves", "tree", "trees",
               "flower", "plant", "seedling", "water", "droplet", "drop", "fire", "flame", "temperature",
               "thermometer", "mountain", "mountains", "planet", "earth", "globe", "world",
               "sunrise", "sunset", "fog", "haze", "tornado", "hurricane", "rainbow", "wave", "waves", "weather",
               "cactus", "feather", "paw", "bird", "cat", "dog", "fish", "bug", "butterfly", "horse", "rabbit",
               "turtle", "spider", "snail", "shell", "campfire", "volcano", "meteor", "comet", "galaxy", "snowman",
               "recycle", "eco", "solar", "wind-turbine", "sprout", "clover", "mushroom", "bone"),
    "places": ("map", "maps", "pin", "location", "compass", "navigation", "navigate", "home", "house", "building",
               "car", "bus", "train", "plane", "airplane", "bike", "bicycle", "ship", "boat", "sailboat", "truck",
               "taxi", "road", "flag", "anchor", "parking", "gas", "fuel", "hotel", "hospital", "school",
               "church", "castle", "tent", "camping", "bridge", "factory", "warehouse", "office",
               "city", "tower", "lighthouse", "rocket", "helicopter", "scooter", "motorcycle", "tram", "subway",
               "traffic", "direction", "directions", "walk", "step", "steps", "door", "elevator", "stairs",
               "window", "bed", "bath", "shower", "toilet", "sofa", "armchair", "chair", "lamp", "fireplace",
               "garage", "fence", "globe", "planet", "trip", "travel", "luggage", "suitcase", "passport",
               "ambulance", "firetruck", "tractor", "caravan", "kayak", "ufo", "satellite", "gps", "signpost",
               "mosque", "engine"),
    "time": ("calendar", "clock", "time", "alarm", "timer", "hourglass", "history", "stopwatch", "watch",
             "date", "schedule", "event", "events", "snooze", "countdown", "today", "week", "month", "year",
             "recent", "hours"),
    "symbols": ("circle", "square", "triangle", "hexagon", "octagon", "pentagon", "diamond", "shape", "shapes",
                "heart", "plus", "minus", "check", "checks", "checkbox", "checkmark", "x", "close", "cross",
                "question", "exclamation", "info", "information", "help", "alert", "warning", "error", "ban", "cancel",
                "block", "forbid", "dot", "dots", "hash", "hashtag", "infinity", "asterisk", "number", "numbers",
                "sigma", "math", "divide", "equal", "equals", "percent", "radio", "toggle", "badge", "cube",
                "box", "sphere", "cone", "cylinder", "pyramid", "polygon", "spiral", "slash", "brackets",
                "braces", "parentheses", "ampersand", "copyright", "trademark", "registered", "sum", "function",
                "variable", "pi", "omega", "alpha", "beta", "lambda", "section", "pilcrow", "tilde", "plus-minus",
                "add", "remove", "subtract", "multiply", "square-root", "sqrt", "octahedron", "star", "sparkle", "rectangle",
                "copyleft", "creative",
                "sparkles", "award", "medal", "trophy", "crown", "like", "dislike", "favorite"),
    "interface": ("menu", "settings", "setting", "gear", "cog", "cogs", "toggle", "switch", "slider", "sliders",
                  "adjustments", "filter", "filters", "search", "zoom", "magnifier", "sidebar", "panel", "window",
                  "windows", "app", "apps", "application", "tab", "tabs", "button", "pointer", "click", "drag",
                  "grip", "link", "unlink", "trash", "delete", "bin", "select", "selection", "frame", "crop",
                  "resize", "fullscreen", "loader", "loading", "spinner", "more", "ellipsis", "hamburger",
                  "dock", "widget", "widgets", "browser", "web", "website", "carousel", "modal", "popup",
                  "notification", "category", "categories", "section", "components", "component", "view",
                  "list", "login", "logout", "sign", "signin", "signout", "power", "refresh", "shortcut",
                  "command", "option", "keyboard", "zoom-in", "zoom-out", "pin", "pushpin", "thumbtack",
                  "archive", "inbox", "outbox", "flag", "layers", "stack", "split", "template",
                  "preview", "visible", "invisible", "focus", "target", "crosshair", "scan", "qrcode", "magic",
                  "wand", "history", "undo", "redo", "reset", "help", "support", "feedback", "bug", "tool",
                  "tools", "wrench", "screwdriver", "hammer", "scissors", "cut", "paint", "palette", "brush",
                  "color", "colors", "dropper", "eyedropper", "fill", "bucket", "magnet", "compass", "ruler",
                  "puzzle", "extension", "plugin", "flask", "beaker", "microscope", "test", "lab", "artboard", "aspect",
                  "lasso", "slice", "axe", "shovel", "toolbox", "nut", "ladder", "broom"),
    "development": ("code", "terminal", "git", "branch", "commit", "merge", "pull", "push", "api", "brackets",
                    "command", "console", "binary", "variable", "function", "source", "repo", "repository",
                    "html", "css", "json", "xml", "regex", "sql", "webhook", "bug", "debug", "deploy", "container",
                    "server", "database", "devices", "cpu", "hierarchy", "sitemap", "tree", "schema",
                    "structure", "workflow", "pipeline", "flow", "integration", "plugin", "component", "package",
                    "bracket", "curly", "prompt", "shell", "script", "query", "index", "table", "cube", "codepen"),
    "games": ("chess", "dice", "game", "games", "gamepad", "ball", "football", "soccer", "basketball",
              "baseball", "tennis", "golf", "volleyball", "bowling", "pingpong", "trophy", "medal", "target",
              "dart", "puzzle", "cards", "spade", "club", "hearts", "diamonds", "sword", "swords", "shield",
              "joystick", "controller", "boxing", "dumbbell", "barbell", "gym", "fitness", "sport", "sports",
              "run", "swim", "ski", "skiing", "surf", "skateboard", "skateboarding", "yoga", "karate", "bike", "bicycle",
              "weight", "podium"),
    "food": ("food", "coffee", "cup", "mug", "tea", "pizza", "beer", "wine", "glass", "cocktail", "cake",
             "cookie", "bread", "cheese", "egg", "apple", "cherry", "lemon", "carrot", "pepper", "burger",
             "hamburger", "fries", "sandwich", "salad", "soup", "bowl", "restaurant", "utensils", "cutlery", "fork",
             "knife", "spoon", "chef", "cooking", "kitchen", "fridge", "refrigerator", "oven", "microwave",
             "ice", "icecream", "ice-cream", "candy", "lollipop", "donut", "milk", "bottle", "grape", "banana",
             "meat", "drumstick", "fish", "shrimp", "sushi", "noodles", "popcorn", "baguette", "croissant",
             "pretzel", "avocado", "watermelon", "strawberry", "juice", "soda", "teapot", "kettle", "chopsticks"),
    "health": ("medical", "medicine", "hospital", "pill", "pills", "capsule", "stethoscope", "bandage", "syringe",
               "vaccine", "virus", "heartbeat", "heart-rate", "pulse", "ambulance", "dna", "brain", "tooth",
               "lungs", "first", "aid", "firstaid", "health", "healthcare", "doctor", "nurse", "thermometer",
               "mask", "bacteria", "microbe", "clinic", "prescription", "wheelchair", "crutch", "blood",
               "droplet", "emergency", "cross", "heart"),
}
_TOPIC_OF = {}
for _topic, _words in TOPICS.items():
    for _word in _words:
        _TOPIC_OF.setdefault(_word, _topic)  # the first topic listing a word owns it
OTHER_TOPIC = "other"

_DEFAULT_VIEWBOX = 16  # IconifyJSON's default width and height


def topic_of(name: str) -> str:
    """The topic (parent) of a normalised icon name: that of the first token the lexicon knows.

    Args:
        name: e.g. ``"cloud-upload"`` (tokens split at ``-``).

    Returns:
        A key of :data:`TOPICS`, or ``"other"``.
    """
    for token in name.split("-"):
        topic = _TOPIC_OF.get(token)
        if topic is not None:
            return topic
    return OTHER_TOPIC


def is_brand_name(name: str) -> bool:
    """Whether a normalised icon name names a brand, company or logo (:data:`BRAND_TOKENS`).

    Args:
        name: e.g. ``"brand-github"``.

    Returns:
        True when any token (or the whole name) is a brand token.
    """
    return name in BRAND_TOKENS or any(token in BRAND_TOKENS for token in name.split("-"))


def check_set_allowed(info: Dict[str, object], prefix: str) -> None:
    """Refuse a set that is emoji, flag or logo artwork, or not permissively licensed.

    Args:
        info: the package's ``info.json``.
        prefix: the set prefix (e.g. ``"tabler"``).

    Raises:
        ValueError: the set is excluded, naming the reason.
    """
    category = str(info.get("category", "")).strip().lower()
    if category in EXCLUDED_CATEGORIES or "emoji" in category:
        raise ValueError(f"icon set {prefix!r} has category {info.get('category')!r}: emoji, flag and logo "
                         "sets are excluded")
    lowered = prefix.lower()
    if any(word in lowered for word in _EXCLUDED_PREFIX_WORDS):
        raise ValueError(f"icon set {prefix!r} looks like an emoji, flag or logo set: excluded")
    licence = info.get("license") or {}
    spdx = licence.get("spdx") if isinstance(licence, dict) else None
    if spdx not in PERMISSIVE_LICENSES:
        raise ValueError(f"icon set {prefix!r} has licence {spdx!r}, not one of {PERMISSIVE_LICENSES}")


def normalise_names(names: Sequence[str], spec: SetSpec) -> Dict[str, str]:
    """One icon of the set per normalised name, in the set's kept style.

    A name's longest style suffix of ``spec.styles`` is stripped; names whose style is not in
    ``spec.keep`` are left out, and of several kept styles the earlier in ``spec.keep`` wins. A
    numbered name (``home-01``, ``home-2``) stands for its base (``home``) when the set has no
    unnumbered base; the lowest number wins. Ties go to the icon name, so the choice is deterministic.

    Args:
        names: the set's icon names (not hidden, not aliases).
        spec: the set's style rule.

    Returns:
        Normalised name -> the set's icon name.
    """
    by_stem: Dict[str, Tuple[int, str]] = {}
    for name in sorted(names):
        style = ""
        for suffix in spec.styles:
            if name.endswith("-" + suffix) and len(suffix) > len(style):
                style = suffix
        if style not in spec.keep:
            continue
        stem = name[: -len(style) - 1] if style else name
        rank = (spec.keep.index(style), name)
        if stem not in by_stem or rank < by_stem[stem]:
            by_stem[stem] = rank
    chosen: Dict[str, Tuple[int, str]] = {}
    for stem in sorted(by_stem):
        key, number = stem, -1
        match = re.fullmatch(r"(.+)-0*(\d+)", stem)
        if match and match.group(1) not in by_stem:
            key, number = match.group(1), int(match.group(2))
        icon = by_stem[stem][1]
        if key not in chosen or (number, icon) < chosen[key]:
            chosen[key] = (number, icon)
    return {key: icon for key, (_, icon) in chosen.items()}


def icon_svg(icon_set: Dict[str, object], name: str) -> str:
    """A standalone SVG document of one IconifyJSON icon, drawn black (``currentColor`` = black).

    Args:
        icon_set: the parsed ``icons.json``.
        name: a key of its ``icons``.

    Returns:
        The SVG text, its ``viewBox`` from the icon's (else the set's) ``left``, ``top``, ``width``,
        ``height``, with the icon's ``rotate`` (quarter turns), ``hFlip`` and ``vFlip`` applied.
    """
    icon = icon_set["icons"][name]

    def field(key, default):
        return icon.get(key, icon_set.get(key, default))

    left, top = field("left", 0), field("top", 0)
    width, height = field("width", _DEFAULT_VIEWBOX), field("height", _DEFAULT_VIEWBOX)
    body = icon["body"]
    transforms = []
    cx, cy = left + width / 2, top + height / 2
    if icon.get("hFlip"):
        transforms.append(f"translate({2 * cx} 0) scale(-1 1)")
    if icon.get("vFlip"):
        transforms.append(f"translate(0 {2 * cy}) scale(1 -1)")
    turns = int(icon.get("rotate", 0)) % 4
    if turns:
        transforms.insert(0, f"rotate({90 * turns} {cx} {cy})")
    if transforms:
        body = f'<g transform="{" ".join(transforms)}">{body}</g>'
    return (f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
            f'viewBox="{left} {top} {width} {height}" width="{width}" height="{height}" '
            f'style="color:#000000" color="#000000">{body}</svg>')


def rasterise_svg(svg: str, size: int, rsvg: Optional[str] = None) -> np.ndarray:
    """An SVG document as a ``(size, size)`` uint8 greyscale array, transparency over white.

    Rendered by ``rsvg-convert`` (Debian ``librsvg2-bin``) fitted into the square with the aspect
    ratio kept and centred.

    Args:
        svg: the SVG text.
        size: output side in pixels.
        rsvg: the ``rsvg-convert`` executable; default: looked up on ``PATH``.

    Returns:
        The greyscale image (255 = white).

    Raises:
        RuntimeError: no ``rsvg-convert``, or it failed on the document.
    """
    from PIL import Image

    rsvg = rsvg or shutil.which("rsvg-convert")
    if rsvg is None:
        raise RuntimeError("rasterising SVG needs rsvg-convert (Debian package librsvg2-bin)")
    result = subprocess.run([rsvg, "-w", str(size), "-h", str(size), "-a", "-f", "png"], input=svg.encode(),
                            capture_output=True, timeout=60)
    if result.returncode != 0 or not result.stdout:
        raise RuntimeError(f"rsvg-convert failed: {result.stderr.decode(errors='replace')[:200]}")
    rgba = Image.open(io.BytesIO(result.stdout)).convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    grey = Image.alpha_composite(white, rgba).convert("L")
    canvas = Image.new("L", (size, size), 255)
    canvas.paste(grey, ((size - grey.size[0]) // 2, (size - grey.size[1]) // 2))
    return np.asarray(canvas, dtype=np.uint8)


def ink_fraction(image: np.ndarray, threshold: int = 48) -> float:
    """Share of pixels at least ``threshold`` grey levels darker than white.

    Args:
        image: ``(H, W)`` uint8 greyscale over white.
        threshold: least darkening counted as ink.

    Returns:
        A fraction in [0, 1].
    """
    return float(((255 - image.astype(np.int16)) >= threshold).mean())


def fetch_packages(specs: Sequence[SetSpec], destination: str, npm: Optional[str] = None) -> None:
    """``npm pack`` each set's pinned ``@iconify-json/<prefix>`` version and unpack it.

    Args:
        specs: the sets to fetch.
        destination: folder receiving ``<prefix>/icons.json`` and ``<prefix>/info.json``.
        npm: the ``npm`` executable; default: looked up on ``PATH``.

    Raises:
        RuntimeError: no ``npm``, or a package could not be fetched.
    """
    npm = npm or shutil.which("npm")
    if npm is None:
        raise RuntimeError("fetching the icon sets needs npm (Debian package npm)")
    os.makedirs(destination, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for spec in specs:
            package = f"@iconify-json/{spec.prefix}@{spec.version}"
            result = subprocess.run([npm, "pack", package, "--silent"], cwd=scratch, capture_output=True, text=True)
            tarball = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
            if result.returncode != 0 or not os.path.isfile(os.path.join(scratch, tarball)):
                raise RuntimeError(f"npm pack {package} failed: {result.stderr[:200]}")
            target = os.path.join(destination, spec.prefix)
            os.makedirs(target, exist_ok=True)
            with tarfile.open(os.path.join(scratch, tarball)) as archive:
                for member in ("icons.json", "info.json", "package.json"):
                    handle = archive.extractfile(f"package/{member}")
                    with open(os.path.join(target, member), "wb") as out:
                        out.write(handle.read())


def load_set(source: str, spec: SetSpec) -> Tuple[Dict[str, object], Dict[str, object], str]:
    """``(icons.json, info.json, package version)`` of one set unpacked under ``source``.

    Args:
        source: folder holding ``<prefix>/icons.json`` and ``<prefix>/info.json``.
        spec: the set.

    Returns:
        The parsed files and the npm package version read from ``package.json`` (else ``spec.version``).

    Raises:
        FileNotFoundError: the set is not unpacked there.
        ValueError: the set is excluded (:func:`check_set_allowed`) or its version is not the pinned one.
    """
    folder = os.path.join(source, spec.prefix)
    with open(os.path.join(folder, "icons.json"), encoding="utf-8") as handle:
        icon_set = json.load(handle)
    with open(os.path.join(folder, "info.json"), encoding="utf-8") as handle:
        info = json.load(handle)
    check_set_allowed(info, spec.prefix)
    version = spec.version
    package_json = os.path.join(folder, "package.json")
    if os.path.isfile(package_json):
        with open(package_json, encoding="utf-8") as handle:
            version = json.load(handle).get("version", spec.version)
        if version != spec.version:
            raise ValueError(f"{spec.prefix}: unpacked version {version} is not the pinned {spec.version}; "
                             "fetch again with --fetch")
    return icon_set, info, version


def write_license_file(path: str, specs: Sequence[SetSpec], infos: Dict[str, Dict[str, object]],
                       counts: Dict[str, int], num_classes: int, size: int) -> None:
    """Write ``ICONIFY_LICENSES.md``: the source of every image and its set's licence.

    Args:
        path: the Markdown file to write.
        specs: the sets used, in table order.
        infos: prefix -> the set's ``info.json``.
        counts: prefix -> images kept.
        num_classes: classes in the archive.
        size: image side in pixels.
    """
    lines = [
        "# Bundled Iconify icon-set dataset: sources and licences",
        "",
        f"`iconify_sets.npz` holds {size}-px greyscale rasterisations of {num_classes} icon concepts as drawn",
        f"by {len(specs)} open monochrome icon sets, generated by `python -m pml_hyperbolic.data.build_iconify`",
        "from the npm packages `@iconify-json/<prefix>` (the sets' SVG artwork in IconifyJSON form, rendered",
        "black on white with `rsvg-convert`). The images are small renderings of the sets' artwork; they keep",
        "the licence of the set they come from, as stated in the package's `info.json` (linked below). All are",
        "permissive licences that allow redistribution of modified works with attribution (MIT, ISC,",
        "Apache-2.0, CC-BY-4.0); the attribution is this table. No emoji, flag or logo set is used, and icon",
        "names of brands and logos are left out.",
        "",
        "| Set (prefix) | Name | npm package, version | Artwork version | Images | Licence | Author |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in specs:
        info = infos[spec.prefix]
        licence = info.get("license") or {}
        author = info.get("author") or {}
        author_text = str(author.get("name", "")).replace("|", "/")
        if author.get("url"):
            author_text = f"[{author_text}]({author['url']})"
        licence_text = str(licence.get("spdx") or licence.get("title", ""))
        if licence.get("url"):
            licence_text = f"[{licence_text}]({licence['url']})"
        lines.append(f"| `{spec.prefix}` | {info.get('name', '')} | `@iconify-json/{spec.prefix}` {spec.version} "
                     f"| {info.get('version', '')} | {counts.get(spec.prefix, 0)} | {licence_text} | {author_text} |")
    lines += ["", "Icon names are the sets' own; a class joins the names that normalise to the same string",
              "(style suffixes such as `-outline`, `-line`, `-24-regular` stripped).", ""]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))


def build(output: str, source: str, size: int = 48, min_sets: int = 6, max_classes: Optional[int] = None,
          seed: int = 0, specs: Sequence[SetSpec] = SET_SPECS, license_output: Optional[str] = None,
          workers: int = 2, min_ink: float = 0.01, duplicate_tolerance: float = 3.0, min_topic_classes: int = 4,
          verbose: bool = True) -> Dict[str, object]:
    """Read the unpacked sets, select classes, rasterise and write the ``.npz`` archive.

    Args:
        output: the ``.npz`` file to write.
        source: folder holding each set's ``<prefix>/icons.json`` and ``info.json`` (:func:`fetch_packages`).
        size: image side in pixels.
        min_sets: least number of sets (after duplicate removal) drawing a kept class.
        max_classes: keep at most this many classes (those drawn by the most sets; ties by name).
        seed: seed of the train/test class split.
        specs: the sets to read.
        license_output: where to write the licence table (``None``: not written).
        workers: rasterising threads.
        min_ink: least share of inked pixels (:func:`ink_fraction`) of a kept drawing.
        duplicate_tolerance: mean absolute difference (grey levels) at or under which two drawings of one
            class count as copies; the later set's is dropped.
        min_topic_classes: topics with fewer classes are merged into ``other`` (so every topic can give
            at least two classes to each side of the split).
        verbose: print progress to stderr.

    Returns:
        The archive's metadata (also stored in it as JSON).

    Raises:
        ValueError: fewer than two sets, a set excluded or at the wrong version, or no class left.
    """
    def log(message):
        if verbose:
            print(message, file=sys.stderr, flush=True)

    if len(specs) < 2:
        raise ValueError(f"need at least two icon sets, got {len(specs)}")
    loaded, infos, names = {}, {}, {}
    for spec in specs:
        icon_set, info, _ = load_set(source, spec)
        loaded[spec.prefix], infos[spec.prefix] = icon_set, info
        visible = [n for n, icon in icon_set["icons"].items() if not icon.get("hidden")]
        names[spec.prefix] = {k: v for k, v in normalise_names(visible, spec).items() if not is_brand_name(k)}
    log("read " + ", ".join(f"{s.prefix}={len(names[s.prefix])}" for s in specs))

    groups = {spec.prefix: spec.group for spec in specs}
    order = [spec.prefix for spec in specs]
    drawn_by = collections.defaultdict(list)
    for prefix in order:
        for name in names[prefix]:
            drawn_by[name].append(prefix)

    def enough(prefixes):
        return len(prefixes) >= min_sets and {groups[p] for p in prefixes} >= {"query", "gallery"}

    candidates = sorted(name for name, prefixes in drawn_by.items() if enough(prefixes))
    log(f"{len(candidates)} candidate names drawn by >= {min_sets} sets")
    jobs = [(name, prefix) for name in candidates for prefix in drawn_by[name]]
    rsvg = shutil.which("rsvg-convert")

    def work(job):
        name, prefix = job
        try:
            return rasterise_svg(icon_svg(loaded[prefix], names[prefix][name]), size, rsvg)
        except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError):
            return None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        images = dict(zip(jobs, pool.map(work, jobs)))
    log(f"rasterised {sum(v is not None for v in images.values())} of {len(jobs)} drawings")

    def digest(array):
        return hashlib.sha1(array.tobytes()).hexdigest()

    per_class = {}
    for name in candidates:
        kept = []
        for prefix in order:
            image = images.get((name, prefix))
            if image is None or ink_fraction(image) < min_ink:
                continue
            if any(near_duplicate(image, other, duplicate_tolerance) for _, other, _ in kept):
                continue
            kept.append((prefix, image, digest(image)))
        per_class[name] = kept

    # Across classes: most-drawn names first; a drawing already used by an accepted class of the same set
    # is a second name for one drawing and is dropped.
    ranked = sorted(per_class, key=lambda n: (-len(per_class[n]), n))
    used, accepted = set(), []
    for name in ranked:
        kept = [(p, image, key) for p, image, key in per_class[name] if (p, key) not in used]
        if not enough([p for p, _, _ in kept]):
            continue
        used.update((p, key) for p, _, key in kept)
        accepted.append((name, kept))
        if max_classes is not None and len(accepted) >= max_classes:
            break
    if not accepted:
        raise ValueError("no icon name is drawn by enough sets")

    topics = {name: topic_of(name) for name, _ in accepted}
    sizes = collections.Counter(topics.values())
    topics = {name: (t if sizes[t] >= min_topic_classes else OTHER_TOPIC) for name, t in topics.items()}
    parent_names = sorted(set(topics.values()))
    accepted.sort(key=lambda item: (parent_names.index(topics[item[0]]), item[0]))
    log(f"{len(accepted)} classes kept in {len(parent_names)} topics")

    class_names = np.array([name for name, _ in accepted])
    class_parents = np.array([parent_names.index(topics[name]) for name, _ in accepted], dtype=np.int64)
    class_is_test = split_classes(class_parents, 0.5, seed)
    set_index = {prefix: i for i, prefix in enumerate(order)}
    item_images, item_classes, item_sets, item_icons = [], [], [], []
    for class_id, (name, kept) in enumerate(accepted):
        for prefix, image, _ in kept:
            item_images.append(image)
            item_classes.append(class_id)
            item_sets.append(set_index[prefix])
            item_icons.append(names[prefix][name])

    counts = collections.Counter(order[s] for s in item_sets)
    rsvg_version = subprocess.run([rsvg, "--version"], capture_output=True, text=True).stdout.strip() if rsvg else ""
    metadata = {
        "image_size": size,
        "min_sets": min_sets,
        "max_classes": max_classes,
        "seed": seed,
        "num_classes": len(class_names),
        "num_images": len(item_images),
        "sets": {spec.prefix: {"package": f"@iconify-json/{spec.prefix}", "version": spec.version,
                               "artwork_version": infos[spec.prefix].get("version", ""),
                               "name": infos[spec.prefix].get("name", ""), "group": spec.group,
                               "license": (infos[spec.prefix].get("license") or {}).get("spdx", ""),
                               "styles_kept": list(spec.keep), "images": counts.get(spec.prefix, 0)}
                 for spec in specs},
        "rasteriser": rsvg_version,
        "background": "white",
        "ink": "black",
        "min_ink": min_ink,
        "duplicate_tolerance": duplicate_tolerance,
        "min_topic_classes": min_topic_classes,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    np.savez_compressed(
        output,
        images=np.stack(item_images).astype(np.uint8),
        item_classes=np.array(item_classes, dtype=np.int16),
        item_sets=np.array(item_sets, dtype=np.int16),
        item_icons=np.array(item_icons),
        class_names=class_names,
        class_parents=class_parents.astype(np.int16),
        class_is_test=class_is_test,
        parent_names=np.array(parent_names),
        set_names=np.array(order),
        set_groups=np.array([groups[p] for p in order]),
        metadata=np.array(json.dumps(metadata, sort_keys=True)),
    )
    if license_output:
        write_license_file(license_output, specs, infos, counts, len(class_names), size)
    log(f"wrote {output}: {len(item_images)} images, {os.path.getsize(output) / 1e6:.2f} MB")
    return metadata


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line: ``python -m pml_hyperbolic.data.build_iconify --help``."""
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", "--output", dest="output", default=os.path.join(here, "iconify_sets.npz"))
    parser.add_argument("--license-output", default=None,
                        help="licence table to write (default: ICONIFY_LICENSES.md next to --out)")
    parser.add_argument("--source", default=os.path.join(tempfile.gettempdir(), "iconify-json"),
                        help="folder of the unpacked sets (<prefix>/icons.json, info.json)")
    parser.add_argument("--fetch", action="store_true", help="npm pack the pinned set versions into --source first")
    parser.add_argument("--size", type=int, default=48, help="image side in pixels")
    parser.add_argument("--min-sets", type=int, default=6, help="least number of sets drawing a class")
    parser.add_argument("--max-classes", type=int, default=None, help="keep at most this many classes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/test class split")
    parser.add_argument("--workers", type=int, default=2, help="rasterising threads")
    args = parser.parse_args(argv)
    if args.size < 8 or args.size > 512:
        parser.error(f"--size must be in [8, 512], got {args.size}")
    if args.min_sets < 2:
        parser.error(f"--min-sets must be at least 2, got {args.min_sets}")
    if args.max_classes is not None and args.max_classes < 2:
        parser.error(f"--max-classes must be at least 2, got {args.max_classes}")
    if args.fetch:
        fetch_packages(SET_SPECS, args.source)
    license_output = args.license_output or os.path.join(os.path.dirname(os.path.abspath(args.output)),
                                                         "ICONIFY_LICENSES.md")
    build(args.output, args.source, size=args.size, min_sets=args.min_sets, max_classes=args.max_classes,
          seed=args.seed, license_output=license_output, workers=args.workers)


if __name__ == "__main__":
    main()
