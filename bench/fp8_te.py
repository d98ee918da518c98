"""Transformer Engine's float8 on our models, for bench_fp8.py's comparison with our own float8 and torchao's.

Each block at least `min_width` wide gets TE's modules in place of its matmuls, the way TE is meant to be used: its
LayerNorm fused with the MLP (LayerNormMLP) and, in ViT, with qkv (LayerNormLinear); Swin's first LayerNorm comes
before the window partition, so its qkv is a plain te.Linear. Attention, the patch embedding, the head and what lies
between the blocks stay ours. TE's modules are opaque to torch.compile (TE disables dynamo on them): a compiled step
compiles what lies between them, and CUDA graphs come from TE's own make_graphed_callables (TEGraphed), around the
model eager or compiled. The weights are TE's fresh ones; only the speed is compared.
"""

import torch
from torch import nn

from vitctl.trainer.models import blocks_of

TE_RECIPES = ("delayed", "current", "block")  # TE's names: DelayedScaling, Float8CurrentScaling, Float8BlockScaling
TE_MODES = ("eager", "graphs", "compiled-graphs")  # and torch.compile's modes


def te_recipe(name: str):
    """TE's recipe object, at TE's defaults."""
    from transformer_engine.common import recipe

    return {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
            "block": recipe.Float8BlockScaling}[name]()


class TEAutocast(nn.Module):
    """The model's forward inside te.autocast: TE's modules quantize only there."""

    def __init__(self, model: nn.Module, recipe: str) -> None:
        super().__init__()
        self.model, self.recipe = model, te_recipe(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import transformer_engine.pytorch as te

        with te.autocast(enabled=True, recipe=self.recipe):
            return self.model(x)


class TEGraphed(TEAutocast):
    """TEAutocast whose model runs as CUDA graphs (forward and backward) that TE captures at the first forward, after
    the step's MasterWeights has cast the model to bf16; with `compile_rest`, what lies between TE's modules is
    compiled (torch.compile's default mode) before the capture."""

    graphed = None

    def __init__(self, model: nn.Module, recipe: str, compile_rest: bool) -> None:
        super().__init__(model, recipe)
        self.compile_rest = compile_rest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import transformer_engine.pytorch as te

        if self.graphed is None:
            model = torch.compile(self.model) if self.compile_rest else self.model
            # Not a submodule: the graphed callable is the model itself with its forward replaced.
            object.__setattr__(self, "graphed", te.make_graphed_callables(model, (x,), enabled=True,
                                                                         recipe=self.recipe))
        with te.autocast(enabled=True, recipe=self.recipe):
            return self.graphed(x)


def convert_to_te(model: nn.Module, min_width: int) -> None:
    """Swap the matmuls (and the LayerNorms TE fuses with them) of each block at least `min_width` wide, in place."""
    import transformer_engine.pytorch as te

    kwargs = {"params_dtype": torch.bfloat16, "device": "cuda"}
    for block in blocks_of(model):
        dim, hidden = block.mlp.fc1.in_features, block.mlp.fc1.out_features
        if dim < min_width:
            continue
        if hasattr(block.attn, "window"):  # Swin: norm1 runs before the window partition
            block.attn.qkv = te.Linear(dim, 3 * dim, **kwargs)
        else:
            block.attn.qkv = te.LayerNormLinear(dim, 3 * dim, eps=block.norm1.eps, **kwargs)
            block.norm1 = nn.Identity()
        block.attn.proj = te.Linear(dim, dim, **kwargs)
        block.mlp = te.LayerNormMLP(dim, hidden, eps=block.norm2.eps, **kwargs)
        block.norm2 = nn.Identity()
