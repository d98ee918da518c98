"""Blocks compiled one by one (FSDP2, tensor and pipeline parallel): every block compiled, with static shapes, on the
CPU with a backend that records Dynamo's graphs instead of Inductor's code."""

import pytest
import torch
from torch import nn

from vitctl.trainer.config import ModelConfig, TrainConfig
from vitctl.trainer.models import blocks_of, build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel.parallelize import _compile_blocks


@pytest.fixture
def recorded_graphs(monkeypatch):
    """The graphs Dynamo hands the backend, for every `nn.Module.compile` in the test."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, inputs, **_) -> object:
        graphs.append(gm)
        return gm.forward

    compile_module = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_module(self, **{**kw, "backend": record}))
    torch._dynamo.reset()  # Dynamo's cache is per code object, across tests
    limit = torch._dynamo.config.recompile_limit
    yield graphs
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["vit_s16", "swin_t"])
def test_every_block_is_compiled_with_static_shapes(recorded_graphs, name):
    """12 blocks with 12 drop-path rates: 12 compilations of one `forward`, past Dynamo's default limit of 8, after
    which the rest ran eager; Swin's stages change shape, after which Dynamo traced symbolic sizes."""
    model = build_model(ModelConfig(name=name, num_classes=10, drop_path=0.1), resolve("none", torch.device("cpu")))
    _compile_blocks(model, TrainConfig(compile=True, compile_mode="default"))
    model(torch.randn(1, 3, 224, 224)).sum().backward()
    assert len(recorded_graphs) == len(blocks_of(model)) == 12
    symbolic = [gm for gm in recorded_graphs
                if any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes)]
    assert not symbolic
