"""The registered models: each name's family and hyperparameters, as data (no torch), so that the CLI can list them
in its help without loading the model code."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "vit" or "swin": the model class `models.FAMILIES` builds
    kwargs: dict = field(default_factory=dict)
    timm_name: str | None = None  # the same architecture in timm (224 px), for weight loading and benchmarks


def _vit(patch: int, dim: int, depth: int, heads: int, timm_name: str | None, mlp_ratio: float = 4.0) -> ModelSpec:
    return ModelSpec("vit", dict(patch=patch, dim=dim, depth=depth, heads=heads, mlp_ratio=mlp_ratio), timm_name)


def _swin(dim: int, depths: tuple, heads: tuple, timm_name: str | None) -> ModelSpec:
    return ModelSpec("swin", dict(dim=dim, depths=depths, heads=heads), timm_name)


MODELS: dict[str, ModelSpec] = {
    "vit_s16": _vit(16, 384, 12, 6, "vit_small_patch16_224"),
    "vit_b16": _vit(16, 768, 12, 12, "vit_base_patch16_224"),
    "vit_l16": _vit(16, 1024, 24, 16, "vit_large_patch16_224"),
    "vit_h14": _vit(14, 1280, 32, 16, "vit_huge_patch14_224"),
    "vit_g14": _vit(14, 1408, 40, 16, "vit_giant_patch14_224", mlp_ratio=48 / 11),
    "swin_t": _swin(96, (2, 2, 6, 2), (3, 6, 12, 24), "swin_tiny_patch4_window7_224"),
    "swin_s": _swin(96, (2, 2, 18, 2), (3, 6, 12, 24), "swin_small_patch4_window7_224"),
    "swin_b": _swin(128, (2, 2, 18, 2), (4, 8, 16, 32), "swin_base_patch4_window7_224"),
    "swin_l": _swin(192, (2, 2, 18, 2), (6, 12, 24, 48), "swin_large_patch4_window7_224"),
    "swin_h": _swin(320, (2, 2, 42, 2), (8, 16, 32, 64), None),
    # Small models for CPU tests and the demo.
    "vit_micro": _vit(8, 96, 4, 3, None),
    "swin_micro": _swin(32, (1, 1, 2, 1), (1, 2, 4, 8), None),
    # Small models whose heads split over 2 or 4 tensor-parallel ranks, for CPU parallelism tests.
    "vit_mini": _vit(8, 128, 4, 4, None),
    "swin_mini": _swin(64, (1, 1, 2, 1), (4, 4, 8, 16), None),
}
