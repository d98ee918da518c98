"""Checks that weights read back are the weights written: sha256 of files and tensors (what vitctl writes), finite
values (what anyone else wrote)."""

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from vitctl.datasets.manifest import file_sha256


def files_sha256(paths: list[Path]) -> list[str]:
    """Several files at once: hashlib releases the GIL, so each thread hashes at the disk's or a core's speed."""
    if not paths:
        return []
    with ThreadPoolExecutor(min(8, len(paths))) as pool:
        return list(pool.map(file_sha256, paths))


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """One digest of names, dtypes, shapes and bytes, independent of how a file lays the tensors out."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, int] | None:
    """The first floating-point tensor holding inf or nan, with how many such values; None when all are finite."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            if bad:
                return name, bad
    return None
