"""Safetensors files on disk: a checkpoint's files, each tensor's byte range, reads of element
ranges and writes of a planned layout. Knows nothing of models or ranks; raises CheckpointError.

Note [Safetensors by byte range]
  A safetensors file is a little-endian u64 N, N bytes of JSON header ({name: {"dtype",
  "shape", "data_offsets": [begin, end]}}), then each tensor's elements in row-major order
  at 8 + N + begin. So a fragment (an element range of a flattened parameter, Note
  [Fragment views] in csrc/engine/fragment_view.h) is one contiguous read.
  - Reads use os.preadv into the destination when the dtypes agree, else a fixed chunk
    buffer converted by Tensor.copy_. Never mmap: mapped pages count as resident memory.
  - Writes mirror reads: all names, dtypes and shapes are known first, so each header is
    written first and each piece at its place (os.pwrite), in any order.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
from typing import NamedTuple

import torch

from ..checkpoint.format import CheckpointError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
HEADER_LIMIT = 100 << 20          # a larger header is a corrupt file, not a model
CHUNK_BYTES = 16 << 20            # the conversion buffer of a Reader

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CODES = {t: c for c, t in DTYPES.items()}
numel = math.prod   # the elements of a shape


class Entry(NamedTuple):
    """One tensor of a checkpoint: where its bytes are."""
    file: str            # absolute path
    dtype: torch.dtype
    shape: tuple
    offset: int          # its first byte in the file
    nbytes: int


def _here() -> str:
    """Where a file was looked for, for messages (files differ between nodes)."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    return f" (on {socket.gethostname()}{f', rank {rank}' if rank is not None else ''})"


def checkpoint_files(path: str) -> tuple[list[str], dict | None]:
    """(the safetensors files of `path`, its index's weight_map or None). `path`: a directory
    (its index, else model.safetensors, else its only .safetensors file), a file or an index;
    <path>.old after an interrupted save (Note [Atomic save_pretrained] in zero_ext/pretrained/save.py)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path) and os.path.isdir(path + ".old"):
        path += ".old"
    if path.endswith((".bin", ".pt", ".pth", ".ckpt")) or (os.path.isdir(path) and not _safetensors_in(path) and any(
            f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path))):
        raise CheckpointError(
            f"zero_ext: {path!r} is a pickled torch checkpoint (pytorch_model.bin and the like); zero_ext reads "
            f"safetensors only, by byte range, so that no rank loads the whole model. Convert it once, in one "
            f"process: model = <its class>.from_pretrained(dir); model.save_pretrained(out) (safetensors is the "
            f"default), then pass `out`")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, INDEX)):
        found = _safetensors_in(path)
        if WEIGHTS not in found and len(found) != 1:
            raise CheckpointError(
                f"zero_ext: {path!r} holds {len(found)} .safetensors files {found[:4]} and no {INDEX} saying "
                f"which tensor is where{_here()}; pass the directory a save_pretrained() wrote, or one file")
        return [os.path.join(path, WEIGHTS if WEIGHTS in found else found[0])], None
    if os.path.isdir(path):
        path = os.path.join(path, INDEX)
    if not os.path.exists(path):
        raise CheckpointError(f"zero_ext: no checkpoint at {path!r}{_here()}: no such file or directory; pass a "
                              f"directory save_pretrained() wrote, a .safetensors file or its index .json")
    if path.endswith(".json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"zero_ext: the index {path!r} is not a safetensors index ({type(e).__name__}: "
                                  f"{e}){_here()}; it should be {{'weight_map': {{name: file}}}}") from None
        root = os.path.dirname(path)
        return [os.path.join(root, f) for f in files], {k: os.path.join(root, v) for k, v in weight_map.items()}
    if not path.endswith(".safetensors"):
        raise CheckpointError(f"zero_ext: {path!r} is not a .safetensors file, an index .json or a directory")
    return [path], None


def _safetensors_in(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def read_header(file: str) -> dict[str, Entry]:
    """name -> Entry of every tensor in `file`, checked to be all there."""
    if not os.path.exists(file):
        raise CheckpointError(f"zero_ext: checkpoint file {file!r} is missing{_here()}; copy it there (every rank "
                              f"reads its own part of every file) or pass a complete checkpoint")
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(HEADER_LIMIT, size - 8):
            raise CheckpointError(f"zero_ext: checkpoint file {file!r} is truncated or not safetensors "
                                  f"({size} bytes, header length {n}){_here()}")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"zero_ext: checkpoint file {file!r} has a corrupt header ({e}){_here()}") from None
    out, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, stop = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"zero_ext: checkpoint file {file!r}: tensor {name!r} has an unreadable entry "
                                  f"{info!r} ({type(e).__name__}: {e}){_here()}") from None
        if stop - begin != numel(shape) * dtype.itemsize:
            raise CheckpointError(f"zero_ext: checkpoint file {file!r}: tensor {name!r} {list(shape)} "
                                  f"{info['dtype']} spans {stop - begin} bytes, not {numel(shape) * dtype.itemsize}")
        out[name] = Entry(file, dtype, shape, 8 + n + begin, stop - begin)
        end = max(end, 8 + n + stop)
    if size < end:
        raise CheckpointError(f"zero_ext: checkpoint file {file!r} is truncated: {size} bytes, its header "
                              f"describes {end}{_here()}; copy it again, or pass a complete checkpoint")
    return out


def read_entries(path: str) -> tuple[list[str], dict[str, Entry]]:
    """(files, name -> Entry) of checkpoint `path`; every failure is a CheckpointError."""
    entries: dict[str, Entry] = {}
    try:
        files, weight_map = checkpoint_files(path)
        for file in files:
            for name, e in read_header(file).items():
                if name in entries:
                    raise CheckpointError(f"zero_ext: tensor {name!r} is in both {entries[name].file!r} and "
                                          f"{file!r}; pass a checkpoint that holds each tensor once (with its index)")
                entries[name] = e
    except OSError as e:
        raise CheckpointError(f"zero_ext: cannot read the checkpoint {os.fspath(path)!r} ({type(e).__name__}: "
                              f"{e}){_here()}") from e
    for name, file in (weight_map or {}).items():
        if name not in entries or entries[name].file != file:
            raise CheckpointError(f"zero_ext: the index of {path!r} puts {name!r} in {file!r}, which does not hold "
                                  f"it{_here()}; the files and the index are from different saves")
    return files, entries


class Reader:
    """Reads element ranges of checkpoint tensors, counting bytes_read; close() when done."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8)   # converts other dtypes; untouched until then
        self.bytes_read = 0

    def read(self, e: Entry, first: int, out: torch.Tensor) -> None:
        """out := elements [first, first + out.numel()) of the flattened tensor `e`."""
        n = out.numel()
        if n == 0:
            return
        if e.file not in self._fds:
            self._fds[e.file] = os.open(e.file, os.O_RDONLY)
        fd, at = self._fds[e.file], e.offset + first * e.dtype.itemsize
        if not out.is_contiguous():
            tmp = torch.empty(out.shape, dtype=out.dtype)
            self.read(e, first, tmp)
            out.copy_(tmp)
            return
        flat = out.view(-1)
        if out.dtype == e.dtype and out.device.type == "cpu":
            self._pread(fd, flat.view(torch.uint8).numpy(), at, e.file)
            return
        step = CHUNK_BYTES // e.dtype.itemsize
        for a in range(0, n, step):
            k = min(step, n - a)
            raw = self._buf[:k * e.dtype.itemsize]
            self._pread(fd, raw.numpy(), at + a * e.dtype.itemsize, e.file)
            flat[a:a + k].copy_(raw.view(e.dtype))

    def _pread(self, fd: int, into, at: int, file: str) -> None:
        view, done = memoryview(into).cast("B"), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], at + done)
            if got <= 0:
                raise CheckpointError(f"zero_ext: checkpoint file {file!r} ended while reading it (it shrank after "
                                      f"it was checked){_here()}")
            done += got
        self.bytes_read += done

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buf = None


def parse_size(size) -> int:
    """Bytes of "5GB", "500MB", "10KiB" or an int (as Hugging Face's max_shard_size)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", str(size).upper())
    if m is None:
        raise ValueError(f"zero_ext: max_shard_size={size!r}; pass bytes (an int) or a size such as '5GB'")
    base = 1024 if m.group(3) == "IB" else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def plan_files(tensors: list[tuple[str, torch.dtype, tuple]], max_shard_bytes: int) -> dict[str, list]:
    """file name -> [(tensor name, dtype, shape)]: HF's layout, model.safetensors or numbered
    files cut greedily at max_shard_bytes."""
    shards, size = [[]], 0
    for name, dtype, shape in tensors:
        nbytes = dtype.itemsize * numel(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dtype, shape))
        size += nbytes
    if len(shards) == 1:
        return {WEIGHTS: shards[0]}
    return {f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors": s for k, s in enumerate(shards)}


class Writer:
    """The files of a planned layout, headers first; put() writes a piece of a tensor in place."""

    def __init__(self, directory: str, files: dict[str, list]):
        self.where: dict[str, tuple[int, torch.dtype, int]] = {}   # tensor -> (fd, dtype, its first byte)
        self._fds = []
        for fname, tensors in files.items():
            header, begin = {"__metadata__": {"format": "pt"}}, 0
            for name, dtype, shape in tensors:
                nbytes = dtype.itemsize * numel(shape)
                header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [begin, begin + nbytes]}
                begin += nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)                  # the data starts 8-byte aligned
            fd = os.open(os.path.join(directory, fname), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds.append(fd)
            _pwrite(fd, struct.pack("<Q", len(text)) + text, 0)
            os.ftruncate(fd, 8 + len(text) + begin)
            for name, dtype, shape in tensors:
                self.where[name] = (fd, dtype, 8 + len(text) + header[name]["data_offsets"][0])

    def put(self, name: str, first: int, values: torch.Tensor) -> None:
        """Elements [first, first + values.numel()) of tensor `name`, converted to its dtype."""
        fd, dtype, at = self.where[name]
        data = values.detach().reshape(-1).to("cpu", dtype).contiguous()
        _pwrite(fd, data.view(torch.uint8).numpy(), at + first * dtype.itemsize)

    def close(self) -> None:
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()


def _pwrite(fd: int, data, at: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], at + done)
