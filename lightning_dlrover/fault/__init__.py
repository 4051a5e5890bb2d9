"""Fault tolerance: parity placement over ranks (coded embeddings, commit protocol and recovery build on it)."""

from lightning_dlrover.fault.placement import ParityPlacement

__all__ = ["ParityPlacement"]
