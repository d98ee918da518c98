"""float8 training (`train.precision=fp8`): bf16-pure whose blocks' matmuls (qkv, proj, fc1, fc2) at least
`train.fp8_min_width` wide run in float8, with scales taken at every step: through our own row-scaled matmuls with
fused casts (fused_rowwise, the default; ops/float8_rows.py), or through torchao, one scale per tensor (tensorwise) or
per row (rowwise).

The swaps happen in place, before the model is parallelized, and keep every parameter's name, shape and dtype:
checkpoints, the fp32 masters, the optimizer and the EMA see the model they always saw. torchao is optional
(`pip install 'vitctl[fp8]'`) and is imported only when one of its recipes is asked for.
"""

import dataclasses
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, RunConfig
from .models import blocks_of
from .models.layers import Mlp, PackedQKV
from .ops.float8_rows import float8_linear, float8_mlp

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig, LinearMMConfig

FLOAT8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs whose tensor cores multiply float8
ALIGNMENT = 16  # torch._scaled_mm needs both sides of every float8 matmul in multiples of 16
INSTALL = "pip install 'vitctl[fp8]'"
FUSED_ROWWISE = "fused_rowwise"  # our own float8 matmuls (ops/float8_rows.py); the other recipes are torchao's


def torchao_float8() -> ModuleType:
    """torchao.float8, or a ConfigError saying how to install it."""
    try:
        import torchao.float8
    except ImportError as e:
        raise ConfigError(f"train.precision=fp8 needs torchao, which does not import here ({e}); {INSTALL}") from e
    return torchao.float8


def has_float8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FLOAT8_CAPABILITY


def fp8_problems(config: RunConfig, device: torch.device) -> list[str]:
    """Why train.precision=fp8 cannot run here: torchao (for its recipes), the device, the batch."""
    problems = []
    if config.train.fp8_recipe != FUSED_ROWWISE:
        try:
            torchao_float8()
        except ConfigError as e:
            problems.append(str(e))
    need = f"compute capability {'.'.join(map(str, FLOAT8_CAPABILITY))} or newer (Ada, Hopper)"
    if device.type != "cuda":
        problems.append(f"train.precision=fp8 multiplies in float8 on a GPU of {need}, and this run is on the "
                        f"{device.type.upper()}; use --precision bf16-pure")
    elif (capability := torch.cuda.get_device_capability(device)) < FLOAT8_CAPABILITY:
        problems.append(f"train.precision=fp8 needs float8 tensor cores ({need}); {torch.cuda.get_device_name(device)} "
                        f"has compute capability {'.'.join(map(str, capability))}; use --precision bf16-pure")
    rows = config.data.batch_size // max(1, config.parallel.microbatches)
    if rows % ALIGNMENT:
        # The weight gradient's matmul runs over batch x tokens, and ViT's and Swin's token counts are odd.
        problems.append(f"train.precision=fp8 needs a batch per forward (data.batch_size / parallel.microbatches) "
                        f"that is a multiple of {ALIGNMENT}, not {rows}; e.g. --batch "
                        f"{-(-rows // ALIGNMENT) * ALIGNMENT * config.parallel.microbatches}")
    return problems


def float8_config(recipe: str, fsdp: bool) -> "Float8LinearConfig":
    """torchao's Float8LinearConfig for `recipe`; under FSDP2 a tensorwise recipe gathers the weights already cast
    to float8 (half bf16's bytes; torchao has no float8 gather for rowwise scales)."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    if fsdp and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def convert_to_float8(model: nn.Module, recipe: str, fsdp: bool, min_width: int = 0) -> None:
    """Swap each block's qkv, proj, fc1 and fc2 whose sizes are multiples of 16 and at least `min_width` for float8
    versions, in place. The patch embedding, the head and what lies between the blocks (Swin's patch merging) stay
    bf16."""
    if recipe == FUSED_ROWWISE:
        return _convert_to_fused_rowwise(model, min_width)
    config, convert = float8_config(recipe, fsdp), torchao_float8().convert_to_float8_training
    for block in blocks_of(model):
        for module in block.modules():
            if type(module) is Mlp and (_fits(module.fc1, min_width) or _fits(module.fc2, min_width)):
                module.__class__ = Float8Mlp
            elif type(module) is PackedQKV and _fits_qkv(module, min_width):
                Float8PackedQKV.swap(module, config)
        convert(block, module_filter_fn=lambda linear, _: _fits(linear, min_width), config=config)


def _fits(linear: nn.Linear, min_width: int) -> bool:
    sizes = linear.in_features, linear.out_features
    return all(size % ALIGNMENT == 0 for size in sizes) and min(sizes) >= min_width


def _fits_qkv(qkv: PackedQKV, min_width: int) -> bool:
    return qkv.weight.shape[-1] % ALIGNMENT == 0 and qkv.weight.shape[-1] >= min_width


class Float8Mlp(Mlp):
    """fc2(GELU(fc1(x))) through the modules: the fused MLP op takes their weights and would bypass the float8
    forward of torchao's Float8Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Float8PackedQKV(PackedQKV):
    """q, k and v in one float8 matmul: torchao's float8 linear function on the (3 * dim, dim) view of the weight,
    whose parameter keeps its (3, dim, dim) shape. Under FSDP2 it is gathered in bf16 (torchao's float8 gather
    wraps nn.Linear weights only)."""

    float8_config: "Float8LinearConfig"
    mm_config: "LinearMMConfig"  # the float8 matmuls' settings, as torchao's Float8Linear derives them

    @classmethod
    def swap(cls, qkv: PackedQKV, config: "Float8LinearConfig") -> None:
        # The class changes in place, as tensor_parallel.py's swaps do: parameters, their names and hooks stay.
        qkv.__class__ = cls
        qkv.float8_config, qkv.mm_config = config, _mm_config(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        out = matmul_with_hp_or_float8_args.apply(x, self.weight.flatten(0, 1).t(), self.mm_config,
                                                  self.float8_config)
        return out + self.bias.flatten().to(out.dtype)


def _mm_config(config: "Float8LinearConfig") -> "LinearMMConfig":
    """The LinearMMConfig that torchao's Float8Linear derives from `config` (taken from one on the meta device)."""
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        return Float8Linear(ALIGNMENT, ALIGNMENT, bias=False, config=config).linear_mm_config


class FusedRowwiseLinear(nn.Linear):
    """nn.Linear through float8_linear (recipe fused_rowwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias)


class FusedRowwisePackedQKV(PackedQKV):
    """PackedQKV through float8_linear on the (3 * dim, dim) view of its weight (recipe fused_rowwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight.flatten(0, 1), self.bias.flatten())


class FusedRowwiseMlp(Mlp):
    """The MLP through float8_mlp, whose GELU is fused with the float8 casts (recipe fused_rowwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)


def _convert_to_fused_rowwise(model: nn.Module, min_width: int) -> None:
    """Each block's MLP whole (its GELU fuses with the casts), its qkv and its other linears, in place."""
    for block in blocks_of(model):
        mlps = [m for m in block.modules() if type(m) is Mlp and _fits(m.fc1, min_width) and _fits(m.fc2, min_width)]
        in_mlps = {id(linear) for mlp in mlps for linear in (mlp.fc1, mlp.fc2)}
        for module in block.modules():
            if type(module) is PackedQKV and _fits_qkv(module, min_width):
                module.__class__ = FusedRowwisePackedQKV
            elif type(module) is nn.Linear and _fits(module, min_width) and id(module) not in in_mlps:
                module.__class__ = FusedRowwiseLinear
        for mlp in mlps:
            mlp.__class__ = FusedRowwiseMlp
