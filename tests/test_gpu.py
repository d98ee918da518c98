"""GPU checks (marked gpu; CI has no GPU and skips them; run them on the device machine)."""

import importlib.util
import math

import pytest
import torch

from vitctl.trainer.config import ModelConfig, load_config
from vitctl.trainer.loop import Trainer, train
from vitctl.trainer.models import build_model
from vitctl.trainer.ops import cudnn_attention, reference, resolve, sdpa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", ["vit_s16", "swin_t"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fused_ops_match_reference_forward_and_backward(name, dtype, tol):
    torch.manual_seed(0)
    ref = build_model(ModelConfig(name=name, drop_path=0.0), resolve("none", CUDA)).to(CUDA)
    fused = build_model(ModelConfig(name=name, drop_path=0.0), resolve("all", CUDA)).to(CUDA)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 224, 224, device=CUDA)
    outputs = []
    for model in (ref, fused):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = model(x).float()
        out.square().mean().backward()
        outputs.append((out, [p.grad.float() for p in model.parameters()]))
    (a, grads_a), (b, grads_b) = outputs
    assert (a - b).norm() / a.norm() < tol
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert (ga - gb).norm() <= tol * ga.norm() + 1e-6


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="needs nvidia-cudnn-frontend")
@pytest.mark.parametrize(("batch", "tokens", "heads", "width"), [(3, 197, 4, 64), (2, 50, 3, 32), (1, 7, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_attention_reads_and_writes_packed_qkv_as_sdpa_does(batch, tokens, heads, width, dtype):
    """Its output and packed qkv gradient against float32 attention: no further from it than SDPA's on the same
    inputs (a wrong stride or an unwritten part of the gradient would be far off). From Ampere on, `--fused all`
    takes it: a probe that declined there would leave every run on SDPA unseen."""
    if torch.cuda.get_device_capability() >= (8, 0):
        assert cudnn_attention.unavailable(CUDA) is None
    torch.manual_seed(0)
    qkv = torch.randn(batch, tokens, 3 * heads * width, device=CUDA, dtype=dtype)
    grad = torch.randn(batch, tokens, heads * width, device=CUDA, dtype=dtype)
    results = []
    for attention, inputs in ((reference.attention, qkv.float()), (sdpa.attention, qkv),
                              (cudnn_attention.attention, qkv)):
        leaf = inputs.detach().requires_grad_()
        out = attention(leaf, heads)
        out.backward(grad.to(out.dtype))
        results.append((out.float(), leaf.grad.float()))
    (ref_out, ref_grad), *others = results
    (sdpa_out, sdpa_grad), (out, grad_qkv) = others
    for x, bound, ref in ((out, sdpa_out, ref_out), (grad_qkv, sdpa_grad, ref_grad)):
        assert x.isfinite().all()
        assert (x - ref).norm() <= 1.5 * (bound - ref).norm() + 1e-3 * ref.norm()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-pure"])
def test_trains_on_the_gpu(prepared_shards, tmp_path, precision):
    config = load_config(None, ["model.name=vit_micro", "model.img_size=32", "model.num_classes=5",
                                f"data.path={prepared_shards}", "data.source=webdataset", "data.batch_size=8",
                                "data.workers=2", f"train.precision={precision}", "train.max_steps=4",
                                f"train.out_dir={tmp_path}", "augment.mixup=0", "augment.cutmix=0"])
    result = train(config, use_cuda=True)
    assert result["step"] == 4 and result["eval_samples"] == 20


@pytest.mark.parametrize("model", ["swin_micro", "vit_micro"])
def test_trains_compiled_with_cuda_graphs(prepared_shards, tmp_path, model):
    """Training and eval run under compile_mode=reduce-overhead (CUDA graphs) through our custom ops."""
    window = ["model.window_size=4"] if model.startswith("swin") else []
    config = load_config(None, [
        f"model.name={model}", "model.img_size=32", *window, "model.num_classes=5",
        f"data.path={prepared_shards}", "data.source=webdataset", "data.batch_size=8", "data.workers=2",
        "train.precision=bf16", "train.max_steps=6", "train.compile=true", "train.compile_mode=reduce-overhead",
        "train.eval_every_epochs=0.5", f"train.out_dir={tmp_path}", "augment.mixup=0", "augment.cutmix=0"])
    result = train(config, use_cuda=True)
    assert result["step"] == 6 and result["eval_samples"] == 20 and math.isfinite(result["loss"])


def test_trains_and_evaluates_from_nvjpeg_with_the_next_batch_decoding_in_a_thread(prepared_shards, tmp_path):
    """The nvjpeg branch: decode one batch ahead in the loader's thread, crops in one kernel, the recipe on its own
    stream; evaluation twice an epoch sees every val sample once, and a resumed run goes on from its checkpoint."""
    overrides = ["model.name=vit_micro", "model.img_size=32", "model.num_classes=5", f"data.path={prepared_shards}",
                 "data.source=webdataset", "data.decode=nvjpeg", "data.batch_size=8", "data.workers=2",
                 "train.eval_every_epochs=0.5", f"train.out_dir={tmp_path}", "augment.mixup=0", "augment.cutmix=0"]
    first = train(load_config(None, [*overrides, "train.max_steps=4"]), use_cuda=True)
    again = train(load_config(None, [*overrides, "train.max_steps=6"]), resume=True, use_cuda=True)
    assert (first["step"], again["step"]) == (4, 6)
    assert first["eval_samples"] == again["eval_samples"] == 20 and math.isfinite(again["loss"])


def test_training_and_eval_run_on_a_pool_stream(prepared_shards, tmp_path, monkeypatch):
    """Not CUDA's legacy default stream, where DALI's batches fed the step 3-4% slower (parallel.own_stream)."""
    streams = []
    for method in ("train_step", "evaluate"):
        real = getattr(Trainer, method)

        def spy(self, *args, real=real):
            streams.append(torch.cuda.current_stream())
            return real(self, *args)
        monkeypatch.setattr(Trainer, method, spy)
    config = load_config(None, ["model.name=vit_micro", "model.img_size=32", "model.num_classes=5",
                                f"data.path={prepared_shards}", "data.source=webdataset", "data.batch_size=8",
                                "data.workers=2", "train.max_steps=2", f"train.out_dir={tmp_path}",
                                "augment.mixup=0", "augment.cutmix=0"])
    assert train(config, use_cuda=True)["eval_samples"] == 20
    assert len(streams) >= 3 and all(s != torch.cuda.default_stream() for s in streams)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # left as it was


@pytest.mark.skipif(importlib.util.find_spec("nvidia.dali") is None, reason="needs nvidia-dali")
def test_trains_on_the_gpu_from_dali_with_the_full_recipe(prepared_shards, tmp_path):
    """DALI's GPU pipeline (nvjpeg decoding, RandAugment, erasing on the GPU) feeds training and resumes mid-epoch."""
    overrides = ["model.name=swin_micro", "model.img_size=32", "model.window_size=4", "model.num_classes=5",
                 f"data.path={prepared_shards}", "data.source=dali", "data.batch_size=8", "data.workers=2",
                 "augment.rand_augment=rand-m9-mstd0.5-inc1", "augment.reprob=0.25", "train.precision=bf16",
                 "train.checkpoint_every=3", f"train.out_dir={tmp_path}"]
    result = train(load_config(None, [*overrides, "train.max_steps=3"]), use_cuda=True)
    assert result["step"] == 3
    result = train(load_config(None, [*overrides, "train.max_steps=6"]), resume=True, use_cuda=True)
    assert result["step"] == 6 and result["eval_samples"] == 20 and math.isfinite(result["loss"])


def _jpeg(width: int, height: int, seed: int) -> torch.Tensor:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


_DECODE_BESIDE_MATMULS = """
import io, sys
import numpy as np, torch
from PIL import Image
from vitctl.trainer.data.images import decode_jpegs
from vitctl.trainer.parallel import widen_cuda_queues

if sys.argv[1] == "widened":
    widen_cuda_queues()
device = torch.device("cuda")
datas = []
for seed in range(64):
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (375, 500, 3), dtype=np.uint8)).save(buffer, "JPEG")
    datas.append(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
decode_jpegs(datas, device)
a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
with torch.cuda.stream(torch.cuda.Stream(device)):
    for _ in range(60):
        a @ a
    done = torch.cuda.Event()
    done.record()
decode_jpegs(datas, device)
print("beside" if not done.query() else "after")
"""


def test_a_rank_s_gpu_decode_runs_beside_work_queued_on_another_stream():
    """train() gives the process CUDA's 32 hardware queues before CUDA starts: on CUDA's default 8, the nvjpeg decode
    behind matmuls queued on another stream returns only when they have finished (a queue shared by both streams)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    outcome = {mode: subprocess.run([sys.executable, "-c", _DECODE_BESIDE_MATMULS, mode], env=env, check=True,
                                    capture_output=True, text=True, timeout=300).stdout.split()[-1]
               for mode in ("default", "widened")}
    assert outcome == {"default": "after", "widened": "beside"}


def test_gpu_decode_never_overwrites_memory_whose_readers_are_still_queued():
    """pytorch/vision#9606: decode_jpeg on CUDA may be handed a block freed on the caller's stream while kernels
    queued there still read it, and overwrite it first. Blocks the size of its outputs are freed with reductions
    of them still queued behind a long kernel; each reduction must still see the values it was queued on."""
    from vitctl.trainer.data.augment import Recipe
    from vitctl.trainer.data.draws import draw_sample, stack_draws
    from vitctl.trainer.data.images import decode_jpegs, sample_rng, views_gpu

    width, height, batch = 500, 375, 8
    datas = [_jpeg(width, height, seed) for seed in range(batch)]
    recipe = Recipe(size=224, min_scale=0.08, hflip=True, interpolation="bicubic")
    wrong = 0
    for step in range(30):
        blocks = [torch.full((3, height, width), 1, dtype=torch.uint8, device=CUDA) for _ in range(2 * batch)]
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # the reductions below queue behind this
        sums = [block.sum(dtype=torch.int64) for block in blocks]
        del blocks
        draws = stack_draws([draw_sample(d.numpy().tobytes(), recipe, sample_rng(0, step, i))
                             for i, d in enumerate(datas)])
        views_gpu(decode_jpegs(datas, CUDA), recipe, CUDA, draws)
        torch.cuda.synchronize()
        wrong += sum(int(s) != 3 * height * width for s in sums)
    assert wrong == 0
