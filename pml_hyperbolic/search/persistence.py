"""One-file persistence of :class:`~pml_hyperbolic.evaluation.HyperbolicIndex`.

Layout: 8 magic bytes ``PMLHYPIX``, the header length (little-endian uint64), a UTF-8 JSON header
(format version, curvature and floats as exact hex strings, constructor options, shapes, byte counts,
CRC-32 of the payload), the reference ball coordinates (raw little-endian float32 or float64, row
major; none with ``keep_coordinates=False``), then ``faiss.serialize_index`` of the CPU faiss index. Nothing is unpickled: loading parses
JSON, copies arrays and lets faiss read its own format.

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

import json
import math
import os
import struct
import zlib

import numpy as np
import torch

from .. import poincare_ball as pb
from .lift import _conformal_terms

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None

MAGIC = b"PMLHYPIX"
FORMAT_VERSION = 1
_OPTIONS = ("rtol", "batch_size", "margin", "use_gpu", "error_model", "hnsw_m", "ef_search", "project",
            "post_threads", "exact_ranks", "ef_construction", "factory", "nprobe", "coarse",
            "keep_coordinates")
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _options(index) -> dict:
    out = {name: getattr(index, name) for name in _OPTIONS}
    out["exact_ranks"] = None if index.exact_ranks is None else list(index.exact_ranks)
    return out


def save(index, path) -> None:
    if index.ntotal == 0:
        raise ValueError("save(): the index is empty; add points first")
    fx = index._index
    if index._on_gpu:
        fx = faiss.index_gpu_to_cpu(fx)
    faiss_bytes = faiss.serialize_index(fx).tobytes()
    if index.keep_coordinates:
        ball = np.ascontiguousarray(index._ball.cpu().numpy())
        ball = ball.astype(ball.dtype.newbyteorder("<"), copy=False)
    else:  # the distances come from faiss's own vectors
        ball = np.empty((0, index._dim), dtype="<f4")
    ball_bytes = ball.tobytes()
    header = {
        "format": "pml-hyperbolic HyperbolicIndex",
        "version": FORMAT_VERSION,
        "c": float(index.c).hex(),
        "options": _options(index),
        "ntotal": int(index.ntotal),
        "dim": int(index._dim),
        "ball_dtype": str(ball.dtype.name),
        "distance_dtype": str(index._dtype).replace("torch.", ""),
        "norm_max": float(index._norms.max()).hex(),
        "mips_m": None if index._mips_m is None else float(index._mips_m).hex(),
        "pad": int(index._pad),
        "ball_bytes": len(ball_bytes),
        "faiss_bytes": len(faiss_bytes),
        "crc32": zlib.crc32(faiss_bytes, zlib.crc32(ball_bytes)),
    }
    head = json.dumps(header, sort_keys=True).encode("utf-8")
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(MAGIC + struct.pack("<Q", len(head)) + head)
        fh.write(ball_bytes)
        fh.write(faiss_bytes)
    os.replace(tmp, path)


def _read(path):
    """(header, ball array, faiss bytes) of an index file; one clear error for anything else."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"HyperbolicIndex.load: no index file at {path!r}")
    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < 16 or data[:8] != MAGIC:
        raise ValueError(f"HyperbolicIndex.load: {path!r} is not a HyperbolicIndex file "
                         "(written by HyperbolicIndex.save)")
    bad = f"HyperbolicIndex.load: {path!r} is truncated or corrupt"
    (hlen,) = struct.unpack("<Q", data[8:16])
    try:
        header = json.loads(data[16:16 + hlen].decode("utf-8"))
        version = header["version"]
        nb, nf = int(header["ball_bytes"]), int(header["faiss_bytes"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise ValueError(f"{bad} (unreadable header)") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"HyperbolicIndex.load: {path!r} has format version {version!r}; this "
                         f"pml-hyperbolic reads version {FORMAT_VERSION}")
    start = 16 + hlen
    if len(data) != start + nb + nf:
        raise ValueError(f"{bad}: {len(data)} bytes, the header describes {start + nb + nf}")
    ball_bytes, faiss_bytes = data[start:start + nb], data[start + nb:]
    if zlib.crc32(faiss_bytes, zlib.crc32(ball_bytes)) != header.get("crc32"):
        raise ValueError(f"{bad} (checksum mismatch)")
    try:
        dtype = np.dtype(header["ball_dtype"]).newbyteorder("<")
        if dtype.name not in _DTYPES:
            raise ValueError
        rows = int(header["ntotal"]) if header["options"].get("keep_coordinates", True) else 0
        ball = np.frombuffer(ball_bytes, dtype=dtype).reshape(rows, int(header["dim"]))
    except (ValueError, TypeError, KeyError, AttributeError):
        raise ValueError(f"{bad} (coordinates do not match the header)") from None
    return header, ball, faiss_bytes


def load(cls, path, c=None):
    header, ball, faiss_bytes = _read(path)
    stored_c = float.fromhex(header["c"])
    if c is not None:
        try:
            want = float(pb.as_curvature(c, torch.float64).detach())
        except (TypeError, ValueError) as err:
            raise ValueError(f"c: {err}") from None
        if not math.isclose(want, stored_c, rel_tol=1e-6):
            raise ValueError(f"c: the index in {os.fspath(path)!r} was built with c={stored_c:g}, "
                             f"not c={want:g}; load it without c, or rebuild it for c={want:g}")
    options = dict(header["options"])
    options.setdefault("coarse", "lift")  # files written before the option: faiss trained the lists
    if options.get("exact_ranks") is not None:
        options["exact_ranks"] = tuple(options["exact_ranks"])
    index = cls(c=stored_c, **options)
    index._dim = int(header["dim"])
    index._count = int(header["ntotal"])
    if index.keep_coordinates:
        ball_t = torch.from_numpy(ball.astype(ball.dtype.newbyteorder("="), copy=True))
        index._ball = ball_t
        index._ball32 = ball_t if ball_t.dtype == torch.float32 else None
        index._cx2, index._bball = _conformal_terms(ball_t.to(torch.float64), stored_c)
    index._dtype = _DTYPES[header["distance_dtype"]]
    index._norms = torch.tensor([float.fromhex(header["norm_max"])], dtype=torch.float64)
    index._mips_m = None if header["mips_m"] is None else float.fromhex(header["mips_m"])
    index._pad = int(header["pad"])
    fx = faiss.deserialize_index(np.frombuffer(faiss_bytes, dtype=np.uint8).copy())
    if fx.ntotal != index._count:
        raise ValueError(f"HyperbolicIndex.load: {os.fspath(path)!r} is corrupt (faiss holds {fx.ntotal} "
                         f"vectors, the header {index._count})")
    if index._exact and index.use_gpu is not False and hasattr(faiss, "get_num_gpus") \
            and faiss.get_num_gpus() > 0:
        fx = faiss.index_cpu_to_all_gpus(fx)
        index._on_gpu = True
    index._index = fx
    return index
