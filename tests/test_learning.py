"""Learning for real: small ViT and Swin reach >= 90% val top-1 on scikit-learn's digits, on the CPU,
reading shards and index files written by vitctl's own data path."""

import pytest
from digits import digits_shards

from vitctl.trainer.config import load_config
from vitctl.trainer.loop import train


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return digits_shards(tmp_path_factory.mktemp("digits"))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "epochs", "extra"), [("vit_micro", 40, []),
                                                       ("swin_micro", 15, ["model.window_size=4"])])
def test_reaches_90_percent_on_digits(shards, tmp_path, name, epochs, extra):
    config = load_config(None, [
        f"model.name={name}", "model.img_size=32", "model.num_classes=10", "model.drop_path=0.0",
        f"data.path={shards}", "data.source=webdataset", "data.batch_size=64", "data.workers=2",
        "train.precision=fp32", f"train.epochs={epochs}", "train.log_every=100", "train.eval_every_epochs=5",
        f"train.out_dir={tmp_path / 'run'}", "optim.lr=8e-3", "optim.warmup_epochs=2",
        "augment.mixup=0", "augment.cutmix=0", "augment.hflip=false", "augment.min_crop_scale=0.9", *extra])
    result = train(config)
    assert result["eval_samples"] == 300
    assert result["eval_top1"] >= 90.0, result
