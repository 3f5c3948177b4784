"""Storage backends: POSIX here; KvikIO (GDS or compat) in :mod:`asyncckpt._gpu`."""

from .base import ALIGNMENT, BlobReader, BlobWriter, InflightWrites, Storage, align_up
from .posix import PosixStorage

__all__ = ["ALIGNMENT", "BlobReader", "BlobWriter", "InflightWrites", "PosixStorage", "Storage", "align_up"]
