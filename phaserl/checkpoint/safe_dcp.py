"""torch.distributed.checkpoint without pickle: tensors only, and metadata read through a restricted unpickler.

DCP keeps two kinds of pickle. Its `.metadata` file is a pickle of its own dataclasses, which
`FileSystemReader` reads with plain `pickle.load`; and every non-tensor value of a state dict is saved
as a pickle that the default load planner reads with `torch.load(weights_only=False)`. Either runs
whatever code a crafted file carries. Here:

- `save_tensors` gives DCP a flat {key: tensor} dict, so nothing but tensors is written (the
  non-tensor parts of a state dict go to JSON: state.py);
- `load_tensors` reads `.metadata` with `_MetadataUnpickler`, which admits only the classes DCP's
  metadata is made of (checked against what torch 2.11 and 2.13 write) and refuses anything else by
  name; a metadata entry that declares a pickled value is refused, and the planner refuses to unpickle
  one in any case. Tensor payloads go through DCP's own `torch.load(weights_only=True)`.

Every refusal is a `CheckpointError` naming the file. Not here: what the tensors mean (state.py),
collectives beyond DCP's own (the Checkpointer).
"""
from __future__ import annotations

import os
import pickle
import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import CheckpointError
from ..parallel import is_distributed, training_group

METADATA_FILE = ".metadata"

# (module, name) pairs a DCP .metadata may name: its dataclasses, torch.Size, and paths.
_ALLOWED = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # where older torch releases defined TensorProperties
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # how torch pickles a torch.layout: a name looked up in a table
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the globals of a DCP metadata file (and torch dtypes)."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.source} asks to load {module}.{name}, which is not part of a checkpoint's metadata: the file "
            "was replaced or crafted, and phaserl refuses to run code from it. Use a checkpoint you wrote "
            "yourself (an earlier step_N), or restore this one from a trusted copy")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.source} holds a persistent reference, which DCP metadata never does; refused")


def read_metadata_safely(path: str) -> "dcp_metadata.Metadata":
    """The DCP Metadata in file `path`, or a CheckpointError saying why it was refused."""
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing: the checkpoint's tensor index is gone; "
                              "use an earlier step_N") from exc
    except Exception as exc:  # any malformed pickle: truncated, wrong opcodes, wrong argument types
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: {exc}); use an earlier step_N") from exc
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CheckpointError(f"{path} holds a {type(meta).__name__}, not DCP metadata; refused")
    pickled = [key for key, md in meta.state_dict_metadata.items()
               if isinstance(md, dcp_metadata.BytesStorageMetadata)]
    if pickled:
        raise CheckpointError(
            f"{path} declares pickled (non-tensor) entries such as {pickled[0]!r}; phaserl checkpoints hold tensors "
            "only and never unpickle such entries. It was written by an older phaserl or another tool: resume it "
            "with the version that wrote it, or start a new run (trainer.resume=never)")
    return meta


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        meta = read_metadata_safely(os.path.join(str(self.path), name))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        raise CheckpointError(f"the checkpoint holds a pickled value for {read_item.dest_index.fqn!r}; refused "
                              "(phaserl checkpoints hold tensors only)")


@contextmanager
def _single_process_ok():
    # DCP warns on every call without a process group; one process is phaserl's default, not a mistake.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_tensors(tensors: dict, directory: str) -> None:
    """Collective: write {key: tensor} (plain or DTensor shards) into `directory`."""
    bad = [key for key, value in tensors.items() if not isinstance(value, torch.Tensor)]
    assert not bad, f"save_tensors takes tensors only, got {bad[:3]}"
    with _single_process_ok():
        dcp.save(tensors, checkpoint_id=directory, no_dist=not is_distributed(), process_group=training_group())


def load_tensors(template: dict, directory: str, *, no_dist: bool = False) -> None:
    """Collective (unless no_dist): fill the tensors of `template` ({key: tensor}) in place from `directory`."""
    reader = _SafeReader(directory)
    try:
        with _single_process_ok():
            dcp.load(template, storage_reader=reader, planner=_TensorsOnlyPlanner(),
                     no_dist=no_dist or not is_distributed(), process_group=training_group())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        inner = _first_checkpoint_error(exc)
        if inner is not None:
            raise inner from None
        cause = _root_causes(exc)
        raise CheckpointError(f"reading the tensors in {directory} failed: {_short(cause)}. The files are damaged "
                              "or do not match this run's models; use an earlier step_N") from None


def _wrapped(exc: BaseException) -> list:
    # DCP wraps per-rank failures in its own CheckpointException (failures: {rank: (exception, traceback)}).
    if isinstance(exc, CheckpointException):
        return [pair[0] if isinstance(pair, tuple) else pair for pair in exc.failures.values()]
    return [exc]


def _root_causes(exc: BaseException) -> str:
    return "; ".join(f"{type(e).__name__}: {e}" for e in _wrapped(exc))


def _first_checkpoint_error(exc: BaseException):
    for err in _wrapped(exc):
        while err is not None:
            if isinstance(err, CheckpointError):
                return err
            err = err.__cause__ or err.__context__
    return None


def _short(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."
