"""Snapshot stagers: host copies here; GPU staging arena and fences in :mod:`asyncckpt._gpu`."""

from .base import Snapshot, StagedAtOnce, StagedTensor, Stager, bytes_view
from .host import HostCopy, HostSnapshot, HostStager

__all__ = ["HostCopy", "HostSnapshot", "HostStager", "Snapshot", "StagedAtOnce", "StagedTensor", "Stager", "bytes_view"]
