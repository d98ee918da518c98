"""The EMA of the weights (train.ema_decay): evaluated beside them at each eval, the decay^k mix of the weights,
kept bitwise across a resume, exported by `vitctl export --ema`."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_train import final_weights, tiny

from conftest import CLASSES, ok
from vitctl.cli.train import print_summary
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.loop import Trainer, train
from vitctl.trainer.models import build_model
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel import init_distributed


def evals(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval_top1" in r]


def test_each_eval_logs_the_weights_and_their_ema_and_the_raw_eval_is_unchanged(prepared_shards, tmp_path, capsys):
    train(tiny(prepared_shards, tmp_path / "ema", "train.max_steps=16", "train.ema_decay=0.9"))
    train(tiny(prepared_shards, tmp_path / "plain", "train.max_steps=16"))
    with_ema, plain = evals(tmp_path / "ema"), evals(tmp_path / "plain")
    assert [r["step"] for r in with_ema] == [7, 14, 16]  # after each epoch of 7 steps, and at the end
    for record in with_ema:
        assert 0 <= record["eval_ema_top1"] <= record["eval_ema_top5"] <= 100
        assert record["eval_ema_loss"] != record["eval_loss"]
    # Evaluating the EMA puts the weights back exactly: the raw evals and the final weights are the EMA-less run's.
    assert [{k: r[k] for k in ("eval_top1", "eval_loss")} for r in with_ema] == \
        [{k: r[k] for k in ("eval_top1", "eval_loss")} for r in plain]
    ema_weights, plain_weights = final_weights(tmp_path / "ema"), final_weights(tmp_path / "plain")
    assert all(torch.equal(ema_weights[k], plain_weights[k]) for k in plain_weights)
    print_summary(tmp_path / "ema", CLASSES)
    assert "EMA top-1" in capsys.readouterr().out
    print_summary(tmp_path / "plain", CLASSES)
    assert "EMA top-1" not in capsys.readouterr().out


def test_the_ema_eval_is_the_eval_of_the_ema_weights(prepared_shards, tmp_path):
    config = tiny(prepared_shards, tmp_path / "r", "train.max_steps=4", "train.ema_decay=0.5")
    train(config)
    trainer = Trainer(config, init_distributed(False), resume=True)
    logged = trainer.evaluate()
    trainer.par.weights.load_state_dict(final_weights(tmp_path / "r", "ema"), strict=True)
    direct = trainer.evaluate()
    trainer.metrics.close()
    assert (direct["eval_top1"], direct["eval_loss"]) == (logged["eval_ema_top1"], logged["eval_ema_loss"])
    last = evals(tmp_path / "r")[-1]  # what the run logged at its last step
    assert {key: last[key] for key in logged} == logged


def test_the_ema_is_the_decayed_mix_of_the_weights_and_export_gives_it(prepared_shards, tmp_path):
    config = tiny(prepared_shards, tmp_path / "r", "train.max_steps=3", "train.ema_decay=0.5",
                  "train.checkpoint_every=1", "train.keep_checkpoints=3")
    train(config)
    initial = build_model(config.model, resolve(config.train.fused, torch.device("cpu")), config.train.seed)
    steps = [initial.state_dict()]  # the trainer's initial weights
    steps += [ckpt.consolidated(path) for path in ckpt.list_checkpoints(tmp_path / "r")]
    decay = config.train.ema_decay
    expected = timm_layout({name: sum((1 - decay if k else 1) * decay ** (3 - k) * steps[k][name] for k in range(4))
                            for name in steps[-1]})  # an export holds timm's shapes
    ok("export", tmp_path / "r", "--ema", "--out", tmp_path / "ema.safetensors")
    exported = load_file(tmp_path / "ema.safetensors")
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, expected[name])
    assert not all(torch.equal(exported[k], steps[-1][k]) for k in exported)


def test_resume_keeps_the_ema_bitwise(prepared_shards, tmp_path):
    train(tiny(prepared_shards, tmp_path / "whole", "train.max_steps=10", "train.ema_decay=0.9"))
    train(tiny(prepared_shards, tmp_path / "split", "train.max_steps=5", "train.ema_decay=0.9"))
    train(tiny(prepared_shards, tmp_path / "split", "train.max_steps=10", "train.ema_decay=0.9"), resume=True)
    whole, split = final_weights(tmp_path / "whole", "ema"), final_weights(tmp_path / "split", "ema")
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
    whole_eval, split_eval = evals(tmp_path / "whole")[-1], evals(tmp_path / "split")[-1]
    assert {k: v for k, v in whole_eval.items() if k != "time"} == {k: v for k, v in split_eval.items() if k != "time"}


def test_a_checkpoint_without_an_ema_resumes_with_one_started_from_its_weights(prepared_shards, tmp_path):
    train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=3"))
    started = final_weights(tmp_path / "r")
    train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=4", "train.ema_decay=0.5"), resume=True)
    ema, weights = final_weights(tmp_path / "r", "ema"), final_weights(tmp_path / "r")
    for name in weights:
        torch.testing.assert_close(ema[name], 0.5 * started[name] + 0.5 * weights[name])
