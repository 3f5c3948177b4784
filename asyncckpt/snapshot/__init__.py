"""Snapshot stagers: host copies here; GPU staging arena and fences in :mod:`asyncckpt.gpu`."""

from .base import Snapshot, StagedTensor, Stager
from .host import HostStager

__all__ = ["HostStager", "Snapshot", "StagedTensor", "Stager"]
