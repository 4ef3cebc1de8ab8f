"""The hashes the real-run check compares: one tensor-set hash, one artifact hash.

* `tensors_sha256`: sha256 over the tensors sorted by name, each as name, dtype, shape and
  raw bytes (the seed's "adapter sha256"). FSDP2 parameters are DTensors; they are
  gathered with `full_tensor()` first, so every rank, device and sharding hashes the same.
* `policy_files` / `files_hash`: the files of a policy artifact (the adapter tensors as
  safetensors, plus the hash of the frozen base weights they sit on) and their content
  hash by `model.artifacts.content_hash`, the same function the artifact store and every
  worker loader use. The generation side acks the hash of the files it WOULD publish from
  what it holds, so an ack can only match the registered artifact if the bytes do.

torch is never imported here: tensors are recognised by duck typing (`detach`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import safetensors.numpy as st_numpy

from rollout_lifecycle.model.artifacts import WEIGHTS_NAME, FileEntry, content_hash

BASE_NAME = "base.json"


def to_numpy(t: Any) -> npt.NDArray[Any]:
    """A host numpy copy of a numpy array, torch tensor or FSDP2 DTensor."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if hasattr(t, "detach"):
        t = t.detach()
        if str(t.dtype) == "torch.bfloat16":
            raise ValueError(
                "bf16 tensors cannot be hashed as numpy; the check runs in fp32 "
                "(mixed_precision param_dtype fp32)"
            )
        return np.ascontiguousarray(t.to("cpu").numpy())
    return np.ascontiguousarray(np.asarray(t))


def tensors_sha256(named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, sorted by name."""
    items = named.items() if isinstance(named, Mapping) else named
    pairs = sorted(((str(n), t) for n, t in items), key=lambda p: p[0])
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice")
    h = hashlib.sha256()
    for name, t in pairs:
        a = to_numpy(t)
        h.update(name.encode("utf-8") + b"\0")
        h.update(f"{a.dtype.str}{tuple(a.shape)}".encode("ascii") + b"\0")
        h.update(a.tobytes())
    return h.hexdigest()


def policy_files(adapter: Mapping[str, Any], base_sha256: str) -> dict[str, bytes]:
    """The files of a policy artifact: adapter tensors (safetensors) and the base's hash."""
    arrays = {str(n): to_numpy(t) for n, t in adapter.items()}
    base = json.dumps({"base_sha256": base_sha256}, sort_keys=True, separators=(",", ":"))
    return {WEIGHTS_NAME: st_numpy.save(arrays), BASE_NAME: base.encode("ascii")}


def files_hash(files: Mapping[str, bytes]) -> str:
    """The content hash an artifact holding exactly these files has."""
    return content_hash(
        FileEntry(name, len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items()
    )


def policy_hash(adapter: Mapping[str, Any], base_sha256: str) -> str:
    """`files_hash(policy_files(...))`: the artifact hash of a held or trained policy."""
    return files_hash(policy_files(adapter, base_sha256))


def base_of(files: Mapping[str, bytes]) -> str:
    """The base-weights hash recorded in an artifact's files; ValueError if malformed."""
    try:
        base = json.loads(files[BASE_NAME].decode("ascii"))["base_sha256"]
    except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a policy artifact: {BASE_NAME} unreadable ({exc})") from None
    if not isinstance(base, str):
        raise ValueError(f"{BASE_NAME}: base_sha256 must be a string")
    return base
