"""How tensors travel in messages: one packed array per model, decoded strictly and fast.

Flower's ``ArrayRecord(torch_state_dict=...)`` stores one .npy payload per tensor, and each
payload is hashed, framed and parsed on its own (``np.load`` parses the header with
``ast.literal_eval``). A MONAI DenseNet121 has about 600 tensors, so both ends spent more
time on per-array overhead than on the data. Here all floating tensors of a model (one
dtype) are concatenated into a single 1-D array ``__packed__``, with a small JSON manifest
``__manifest__`` (names and shapes, in order, as uint8 bytes); any other tensor (integer
buffers, or every tensor when floating dtypes differ) travels as its own array. The decoder
reads the dtype and shape from each Array's own fields and only the header length from the
.npy bytes; the payload must be exactly dtype x shape bytes, object arrays are refused, and a
malformed record raises ValueError (the server turns that into a ``malformed`` rejection).
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

PACKED = "__packed__"
MANIFEST = "__manifest__"
_NPY_MAGIC = b"\x93NUMPY"
_DTYPES: dict[str, np.dtype] = {}
_MANIFESTS: dict[bytes, tuple[list[str], list[tuple[int, ...]], list[int]]] = {}


def encode(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord holding ``tensors`` (packed when their floating dtypes agree)."""
    floats = [k for k, v in tensors.items() if v.is_floating_point()]
    dtypes = {tensors[k].dtype for k in floats}
    if len(floats) < 2 or len(dtypes) != 1:
        return ArrayRecord({k: Array(_np(v)) for k, v in tensors.items()})
    flat = torch.cat([tensors[k].detach().reshape(-1) for k in floats])
    manifest = json.dumps({"names": floats, "shapes": [list(tensors[k].shape) for k in floats]})
    arrays = {
        PACKED: Array(_np(flat)),
        MANIFEST: Array(np.frombuffer(manifest.encode(), dtype=np.uint8).copy()),
    }
    arrays.update({k: Array(_np(v)) for k, v in tensors.items() if not v.is_floating_point()})
    return ArrayRecord(arrays)


def decode(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of ``record`` (private copies), in the manifest's order first."""
    return decode_with_flat(record)[0]


def decode_with_flat(record: ArrayRecord) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Like ``decode``, plus the packed 1-D buffer the floating tensors are views of (or None).

    The server computes an update's norm on that one buffer instead of tensor by tensor.
    """
    out: dict[str, torch.Tensor] = {}
    flat: torch.Tensor | None = None
    keys = list(record.keys())
    if PACKED in keys:
        if MANIFEST not in keys:
            raise ValueError("packed arrays without a manifest")
        names, shapes, numels = _manifest(_array(record[MANIFEST], MANIFEST).numpy().tobytes())
        flat = _array(record[PACKED], PACKED)
        if flat.dim() != 1 or flat.numel() != sum(numels):
            raise ValueError(
                f"packed array holds {flat.numel()} values, manifest says {sum(numels)}"
            )
        for name, shape, part in zip(names, shapes, torch.split(flat, numels)):
            out[name] = part.view(shape)
    elif MANIFEST in keys:
        raise ValueError("a manifest without packed arrays")
    for key in keys:
        if key in (PACKED, MANIFEST):
            continue
        if key.startswith("__") or key in out:
            raise ValueError(f"array name {key!r} is reserved or repeated")
        out[key] = _array(record[key], key)
    return out, flat


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _manifest(raw: bytes) -> tuple[list[str], list[tuple[int, ...]], list[int]]:
    cached = _MANIFESTS.get(raw)
    if cached is not None:
        return cached
    try:
        m = json.loads(raw.decode())
        names = [str(n) for n in m["names"]]
        shapes = [tuple(int(d) for d in s) for s in m["shapes"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"bad manifest: {e}") from e
    if len(names) != len(shapes) or len(set(names)) != len(names):
        raise ValueError("manifest names and shapes do not match or repeat")
    if any(d < 0 for s in shapes for d in s):
        raise ValueError("negative dimension in manifest")
    parsed = (names, shapes, [math.prod(s) for s in shapes])
    if len(_MANIFESTS) < 64:
        _MANIFESTS[raw] = parsed
    return parsed


def _array(arr: Array, name: str) -> torch.Tensor:
    if arr.stype != "numpy.ndarray":
        raise ValueError(f"{name!r}: unsupported serialisation {arr.stype!r}")
    if arr.dtype not in _DTYPES:
        _DTYPES[arr.dtype] = np.dtype(arr.dtype)  # TypeError for nonsense: caught by callers
    dtype = _DTYPES[arr.dtype]
    if dtype.hasobject:
        raise ValueError(f"{name!r}: object arrays are refused")
    shape = tuple(int(d) for d in arr.shape)
    data = arr.data
    if len(data) < 12 or data[:6] != _NPY_MAGIC:
        raise ValueError(f"{name!r}: not an .npy payload")
    start = (
        10 + struct.unpack("<H", data[8:10])[0]
        if data[6] == 1
        else 12 + struct.unpack("<I", data[8:12])[0]
    )
    count = math.prod(shape)
    if len(data) - start != count * dtype.itemsize:
        raise ValueError(f"{name!r}: {len(data) - start} bytes for {shape} {dtype}")
    fortran = data.find(b"'fortran_order': True", 10, start) != -1
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return torch.from_numpy(flat.reshape(shape, order="F" if fortran else "C").copy())
