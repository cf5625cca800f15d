"""Reads and writes safetensors files with numpy (the test interpreter has no `safetensors`)."""

# Layout: an 8-byte little-endian header length N, N bytes of JSON, then the
# raw little-endian tensor data. The JSON maps each tensor name to
# {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
# first data byte) and may hold "__metadata__", a map of strings.

import json
import os
import struct

import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {dt.newbyteorder("<"): name for name, dt in DTYPES.items()}

# The reference implementation rejects headers above 100 MB.
MAX_HEADER = 100 * 1000 * 1000


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file; the message names it."""


def dtype_name(array):
    """The safetensors dtype string of a numpy array."""
    dt = array.dtype.newbyteorder("<")
    if dt not in _NAMES:
        raise SafetensorsError(f"dtype {array.dtype} has no safetensors equivalent")
    return _NAMES[dt]


def save(path, tensors, metadata=None):
    """Writes `tensors` (name -> numpy array, in the given order) to `path`."""
    header, chunks, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, array in tensors.items():
        if name == "__metadata__":
            raise SafetensorsError(f"{path}: '__metadata__' is not a tensor name")
        array = np.asarray(array)
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype_name(array), "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces so that the data starts 8-byte aligned, as the reference
    # writer does; readers treat the padding as JSON whitespace.
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in chunks:
            f.write(data)


def save_like(header_path, tensors, path):
    """Writes the float32 tensors `tensors` (name -> array) to `path` in the
    tensors, order and metadata of a header saved as JSON at `header_path`
    (read_header's header with "__metadata__": a program's init.safetensors
    whose weights were left behind). Raises SafetensorsError naming a tensor
    the header has that `tensors` lacks, shapes otherwise, or that is not F32."""
    with open(header_path) as f:
        header = json.load(f)
    meta = header.pop("__metadata__", None)
    out = {}
    for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        value = tensors.get(name)
        if value is None or list(value.shape) != spec["shape"] or spec["dtype"] != "F32":
            raise SafetensorsError(f"{header_path}: tensor {name} {spec['dtype']}{spec['shape']} "
                                   "has no float32 tensor of that shape to fill it")
        out[name] = np.ascontiguousarray(value, dtype=np.float32)
    save(path, out, meta)


def read_header(path):
    """Returns (header dict without __metadata__, metadata dict, data start offset)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise SafetensorsError(f"{path}: header length {n} is implausible")
        text = f.read(n)
    if len(text) != n:
        raise SafetensorsError(f"{path}: header truncated ({len(text)} of {n} bytes)")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata, 8 + n


def load(path, with_metadata=False):
    """Returns name -> numpy array (in file order), and the metadata if asked."""
    header, metadata, start = read_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        blob = f.read()
    tensors = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor '{name}' has a malformed entry "
                                   f"{info!r}") from None
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= begin <= end <= len(blob) or end - begin != want:
            raise SafetensorsError(
                f"{path}: tensor '{name}' {info['dtype']}{list(shape)} needs {want} "
                f"bytes; its data_offsets [{begin}, {end}] do not fit the "
                f"{len(blob)} data bytes")
        tensors[name] = np.frombuffer(blob, dtype, count=want // dtype.itemsize,
                                      offset=begin).reshape(shape).copy()
    return (tensors, metadata) if with_metadata else tensors


def checkpoint_folder(path):
    """The folder `train --load PATH` reads: the step folder PATH/latest names,
    else PATH itself (a step folder, or the older full format)."""
    if os.path.isfile(os.path.join(path, "manifest.json")) or \
            not os.path.isfile(os.path.join(path, "latest")):
        return path
    with open(os.path.join(path, "latest")) as f:
        return os.path.join(path, f.read().strip())


def load_checkpoint(path, roles=("parameter", "buffer")):
    """Full tensors (name -> numpy array) of a checkpoint written by `train
    --save` (docs/checkpoints.md), reassembled from the manifest's shards;
    `roles` picks parameters, buffers and/or optimizer_state. A folder in the
    older full format gives model.safetensors (and optimizer.safetensors)."""
    folder = checkpoint_folder(path)
    manifest_path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(manifest_path):
        out = {}
        if "parameter" in roles or "buffer" in roles:
            out.update(load(os.path.join(folder, "model.safetensors")))
        opt = os.path.join(folder, "optimizer.safetensors")
        if "optimizer_state" in roles and os.path.isfile(opt):
            out.update(load(opt))
        return out
    with open(manifest_path) as f:
        manifest = json.load(f)
    files, out = {}, {}
    for t in manifest["tensors"]:
        if t["role"] not in roles:
            continue
        full = np.zeros(t["shape"], DTYPES[t["dtype"]])
        covered = np.zeros(t["shape"], np.int32)
        for s in t["shards"]:
            if s["file"] not in files:
                files[s["file"]] = load(os.path.join(folder, s["file"]))
            data = files[s["file"]][s["key"]]
            if list(data.shape) != list(s["shape"]):
                raise SafetensorsError(f"{folder}/{s['file']}: '{s['key']}' is "
                                       f"{list(data.shape)}, the manifest says {s['shape']}")
            where = tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["shape"]))
            full[where] = data
            covered[where] += 1
        if covered.size and (covered.min() != 1 or covered.max() != 1):
            raise SafetensorsError(f"{manifest_path}: the shards of '{t['name']}' do not "
                                   f"cover it exactly once")
        out[t["name"]] = full
    return out
