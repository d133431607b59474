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
import warnings

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedasync import flat as fedasync_flat

PACKED = "__packed__"
MANIFEST = "__manifest__"
_NPY_MAGIC = b"\x93NUMPY"
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
_DTYPES: dict[str, np.dtype] = {}
_MANIFESTS: dict[bytes, tuple[list[str], list[tuple[int, ...]], list[int]]] = {}
_LAYOUTS: dict[tuple, fedasync_flat.Layout] = {}
"""(manifest, dtype, loose arrays) -> the layout decoded updates of that form have."""


def encode(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord holding ``tensors`` (packed when their floating dtypes agree). A
    :class:`fedasync.flat.FlatParams` of one floating buffer is sent as that buffer."""
    if isinstance(tensors, fedasync_flat.FlatParams) and _one_float_group(tensors.layout):
        g = tensors.layout.groups[0]
        arrays = {
            PACKED: Array(_np(tensors.buffers[0])),
            MANIFEST: Array(_manifest_array(g.names, g.shapes)),
        }
        arrays.update({k: Array(_np(v)) for k, v in tensors.loose.items()})
        return ArrayRecord(arrays)
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


def decode_with_flat(
    record: ArrayRecord, *, shared: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Like ``decode``, plus the packed 1-D buffer the floating tensors are views of (or None).

    A packed record decodes to a :class:`fedasync.flat.FlatParams` over that buffer (its
    floating tensors are views of it; the core's fused arithmetic runs on it). With
    ``shared`` the buffer is the message's own bytes, not a copy: the tensors are then
    read-only by contract (the server's intake, which never writes to an update it is given,
    saves a model-sized copy per reply; writing to them would change the message).
    """
    loose: dict[str, torch.Tensor] = {}
    flat: torch.Tensor | None = None
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    keys = list(record.keys())
    if PACKED in keys:
        if MANIFEST not in keys:
            raise ValueError("packed arrays without a manifest")
        raw = _raw(record[MANIFEST], MANIFEST)
        names, shapes, numels = _manifest(raw)
        flat = _array(record[PACKED], PACKED, shared=shared)
        if flat.dim() != 1 or flat.numel() != sum(numels):
            raise ValueError(
                f"packed array holds {flat.numel()} values, manifest says {sum(numels)}"
            )
        if not flat.is_floating_point():
            raise ValueError(f"packed array of {flat.dtype}: only floating tensors are packed")
    elif MANIFEST in keys:
        raise ValueError("a manifest without packed arrays")
    taken = set(names)
    for key in keys:
        if key in (PACKED, MANIFEST):
            continue
        if key.startswith("__") or key in taken or key in loose:
            raise ValueError(f"array name {key!r} is reserved or repeated")
        loose[key] = _array(record[key], key)
    if flat is None:
        return loose, None
    if any(v.is_floating_point() or v.is_complex() for v in loose.values()):
        # a floating array beside the packed ones: not what ``encode`` writes; plain views
        out = dict(zip(names, (p.view(s) for p, s in zip(torch.split(flat, numels), shapes))))
        return {**out, **loose}, flat
    form = (raw, flat.dtype, tuple((k, v.shape, v.dtype) for k, v in loose.items()))
    layout = _LAYOUTS.get(form)
    if layout is None:
        layout = fedasync_flat.packed_layout(names, shapes, flat.dtype, loose)
        if len(_LAYOUTS) < 64:
            _LAYOUTS[form] = layout
    return fedasync_flat.from_buffers(layout, [flat], loose), flat


def _one_float_group(layout: fedasync_flat.Layout) -> bool:
    """One floating buffer of several tensors (loose tensors are never floating)."""
    groups = layout.groups
    return len(groups) == 1 and groups[0].dtype.is_floating_point and len(groups[0].names) > 1


_MANIFEST_ARRAYS: dict[tuple, np.ndarray] = {}


def _manifest_array(names: tuple[str, ...], shapes: tuple[torch.Size, ...]) -> np.ndarray:
    key = (names, shapes)
    arr = _MANIFEST_ARRAYS.get(key)
    if arr is None:
        raw = json.dumps({"names": list(names), "shapes": [list(s) for s in shapes]})
        arr = np.frombuffer(raw.encode(), dtype=np.uint8).copy()
        if len(_MANIFEST_ARRAYS) < 64:
            _MANIFEST_ARRAYS[key] = arr
    return arr


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


def _payload(arr: Array, name: str) -> tuple[np.dtype, tuple[int, ...], bytes, int]:
    """(dtype, shape, the .npy bytes, where the data starts), checked: dtype x shape bytes."""
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
    return dtype, shape, data, start


def _raw(arr: Array, name: str) -> bytes:
    """The data bytes of a 1-D uint8 array (the manifest), without making an array of them."""
    dtype, shape, data, start = _payload(arr, name)
    if dtype != np.uint8 or len(shape) != 1:
        raise ValueError(f"{name!r}: expected 1-D uint8, got {shape} {dtype}")
    return data[start:]


def _array(arr: Array, name: str, *, shared: bool = False) -> torch.Tensor:
    dtype, shape, data, start = _payload(arr, name)
    count = math.prod(shape)
    if shared and len(shape) == 1 and dtype.isnative and count > 0:
        # bytes are read-only and the caller promised not to write (the warning torch gives
        # once per process for a non-writable buffer is filtered at import)
        tdtype = _TORCH[dtype.str] if dtype.str in _TORCH else _torch_dtype(dtype)
        return torch.frombuffer(data, dtype=tdtype, count=count, offset=start)
    fortran = data.find(b"'fortran_order': True", 10, start) != -1
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return torch.from_numpy(flat.reshape(shape, order="F" if fortran else "C").copy())


_TORCH: dict[str, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    t = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    _TORCH[dtype.str] = t
    return t
