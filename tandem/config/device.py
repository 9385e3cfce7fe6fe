"""The device the engine runs on (vLLM's ``DeviceConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class DeviceConfig:
    """The accelerator of this engine (each rank of a parallel engine takes its own CUDA device)."""

    device: str = "auto"
    """auto (CUDA when available), cpu, cuda or cuda:N."""

    def __post_init__(self) -> None:
        if self.device in ("auto", "cpu"):
            return  # valid anywhere; torch stays unimported until the engine loads
        import torch

        bad = f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}."
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(bad) from None
        if dev.type == "cpu":
            return
        if dev.type != "cuda":
            raise ValueError(bad)
        if not torch.cuda.is_available():
            why = "PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {self.device!r}: {why}; use --device cpu (or auto).")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible.")

    @property
    def torch_device(self) -> torch.device:
        """The device itself: ``auto`` is CUDA when available, else the CPU."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
