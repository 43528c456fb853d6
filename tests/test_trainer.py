"""Trainer: exact resume after a kill, learning on a tiny target, evaluation, precomputed features, CLI."""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, tiny_draft, tiny_target
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import get_cosine_schedule_with_warmup

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.commands import cli
from hf_eagle3.training import trainer as trainer_module
from hf_eagle3.training.data import Example, load_dataset
from hf_eagle3.training.features import TargetFeatures, batched_target_forward, length_batches, target_forward
from hf_eagle3.training.profile import PROFILE_MAX_DEPTH, PROFILE_TOP_KS
from hf_eagle3.training.trainer import (
    TrainConfig,
    acceptance_summary,
    epoch_batches,
    latest_checkpoint,
    speed_verdict,
    train,
    trainable_state_dict,
)


@pytest.fixture(scope="module")
def target():
    """The tiny random Llama with a sharpened output layer, so its next-token distributions are peaked like a real
    model's (a random one's are almost uniform: there would be nothing to learn)."""
    model = tiny_target("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, target):
    """Conversations whose answers are the tiny target's own greedy continuations (what regeneration produces)."""
    directory = tmp_path_factory.mktemp("data")
    torch.manual_seed(0)
    prompts = torch.randint(1, VOCAB, (48, 6))
    with torch.no_grad():
        sequences = target.generate(
            prompts, max_new_tokens=26, do_sample=False, attention_mask=torch.ones_like(prompts)
        )
    with open(directory / "shard-00000.jsonl", "w") as file:
        for sequence in sequences.tolist():
            file.write(json.dumps({"messages": [], "input_ids": sequence, "loss_mask": [0] * 6 + [1] * 26}) + "\n")
    return directory


def config_for(dataset, output_dir, **overrides):
    settings = dict(
        data=str(dataset), output_dir=str(output_dir), draft_vocab_size=64, intermediate_size=64, batch_size=4,
        ttt_steps=3, learning_rate=3e-3, warmup_steps=2, max_steps=8, save_every=4, eval_every=4, log_every=1,
        eval_fraction=0.2, seed=1, profile_prompts=0, eval_tree_prompts=0,  # tests that decode set them
    )
    return TrainConfig(**(settings | overrides))


def draft_weights(output_dir):
    return load_file(str(latest_checkpoint(output_dir) / "model.safetensors"))


class Killed(Exception):
    pass


def test_killed_and_resumed_run_matches_an_uninterrupted_one(dataset, target, tmp_path, monkeypatch):
    train(config_for(dataset, tmp_path / "straight"), target=target, progress=False)

    save_checkpoint = trainer_module.save_checkpoint

    def save_then_die(output_dir, draft, optimizer, state, keep):
        path = save_checkpoint(output_dir, draft, optimizer, state, keep)
        if state["step"] == 4:
            raise Killed
        return path

    monkeypatch.setattr(trainer_module, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        train(config_for(dataset, tmp_path / "killed"), target=target, progress=False)
    monkeypatch.undo()

    # The checkpoint holds the same step, learning rate and data position as the uninterrupted run's at step 4.
    straight_state = json.loads((tmp_path / "straight" / "checkpoint-000004" / "trainer_state.json").read_text())
    killed_state = json.loads((tmp_path / "killed" / "checkpoint-000004" / "trainer_state.json").read_text())
    for key in ("step", "epoch", "round", "tokens"):
        assert killed_state[key] == straight_state[key]
    assert [e.get("lr") for e in killed_state["history"]] == [e.get("lr") for e in straight_state["history"]]

    with pytest.raises(FileExistsError, match="--resume"):
        train(config_for(dataset, tmp_path / "killed"), target=target, progress=False)
    train(config_for(dataset, tmp_path / "killed"), resume=True, target=target, progress=False)
    straight, resumed = draft_weights(tmp_path / "straight"), draft_weights(tmp_path / "killed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    straight_history = json.loads((tmp_path / "straight" / "history.json").read_text())
    resumed_history = json.loads((tmp_path / "killed" / "history.json").read_text())
    assert [e.get("train_loss") for e in straight_history] == [e.get("train_loss") for e in resumed_history]


TRAIN_CLI = (
    "import argparse; from hf_eagle3.training import trainer; parser = argparse.ArgumentParser(); "
    "trainer.register_cli(parser.add_subparsers()); args = parser.parse_args(); args.run(args)"
)


def parse_train_cli(argv):
    parser = argparse.ArgumentParser()
    trainer_module.register_cli(parser.add_subparsers())
    return parser.parse_args(argv)


def test_sigkilled_cli_run_resumes_to_the_weights_of_an_uninterrupted_one(dataset, target, tmp_path):
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    argv = [
        "train", "--data", str(dataset), "--target", str(target_dir), "--draft-vocab-size", "64",
        "--intermediate-size", "64", "--batch-size", "4", "--ttt-steps", "3", "--learning-rate", "3e-3",
        "--warmup-steps", "2", "--max-steps", "40", "--save-every", "2", "--eval-every", "1000", "--eval-batches", "0",
        "--eval-fraction", "0.2", "--seed", "1", "--threads", "1", "--profile-prompts", "0", "--eval-tree-prompts", "0",
    ]
    straight = parse_train_cli([*argv, "--output-dir", str(tmp_path / "straight")])
    straight.run(straight)

    killed_dir = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-c", TRAIN_CLI, *argv, "--output-dir", str(killed_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (killed_dir / "checkpoint-000010").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.kill()  # SIGKILL: no clean-up of any kind
    assert process.wait() == -9, "the run ended before it could be killed"
    assert latest_checkpoint(killed_dir).name < "checkpoint-000040"

    resumed = parse_train_cli([*argv, "--output-dir", str(killed_dir), "--resume"])
    resumed.run(resumed)
    expected, got = draft_weights(tmp_path / "straight"), draft_weights(killed_dir)
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_resume_without_checkpoint_is_a_clear_error(dataset, target, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(config_for(dataset, tmp_path), resume=True, target=target, progress=False)


def test_training_lowers_the_loss_and_raises_held_out_acceptance(dataset, target, tmp_path):
    config = config_for(dataset, tmp_path, max_steps=40, eval_every=40, save_every=40, learning_rate=1e-2)
    train(config, target=target, progress=False)
    history = json.loads((tmp_path / "history.json").read_text())
    losses = [entry["train_loss"] for entry in history if "train_loss" in entry]
    assert sum(losses[-5:]) < 0.92 * sum(losses[:5])  # the floor is the target distribution's entropy
    final = [entry["eval"] for entry in history if "eval" in entry][-1]
    assert final["alpha"][0] > 0.2 and final["chain_tau"] > 1.2  # an untrained draft: 0-α about 1/64
    assert (tmp_path / "training.png").stat().st_size > 0
    saved = Eagle3DraftModel.from_pretrained(tmp_path / "draft").config
    assert saved.draft_vocab_size == 64
    assert (saved.bos_token_id, saved.eos_token_id, saved.pad_token_id) == (
        target.config.bos_token_id, target.config.eos_token_id, target.config.pad_token_id)  # pipelines compare them
    assert Eagle3DraftModel.from_pretrained(latest_checkpoint(tmp_path)).config.draft_vocab_size == 64


def test_each_evaluation_decodes_at_the_reference_tree_and_best_keeps_the_draft_of_the_highest_tau(
        dataset, target, tmp_path):
    config = config_for(dataset, tmp_path, max_steps=24, eval_every=6, save_every=24, learning_rate=1e-2,
                        eval_tree_prompts=3)
    train(config, target=target, progress=False)
    evaluations = [entry["eval"] for entry in json.loads((tmp_path / "history.json").read_text()) if "eval" in entry]
    taus = [evaluation["tree_tau"] for evaluation in evaluations]
    assert len(taus) == 4 and all(evaluation["tree"] == trainer_module.EVAL_TREE for evaluation in evaluations)
    assert max(taus) > taus[0] >= 1  # training raises it
    assert [evaluation["best"] for evaluation in evaluations] == [tau > max(taus[:i], default=0)
                                                                  for i, tau in enumerate(taus)]
    # OUTPUT_DIR/best holds the draft of the highest τ: decoding the held-out prompts with it gives that τ again
    best = Eagle3DraftModel.from_pretrained(tmp_path / "best")
    emitted = []
    for prompt in trainer_module.held_out_prompts(trainer_module._split_examples(config)[1][:3], target.device):
        output = target.generate(prompt, max_new_tokens=trainer_module.EVAL_TREE_NEW_TOKENS, do_sample=False,
                                 assistant_model=best, return_dict_in_generate=True, **trainer_module.EVAL_TREE)
        emitted += output.eagle3_stats.acceptance_lengths
    assert sum(emitted) / len(emitted) == pytest.approx(max(taus))


def test_held_out_evaluation_chains_eval_ttt_steps_whatever_the_training_steps(dataset, target, tmp_path):
    train(config_for(dataset, tmp_path, ttt_steps=1, eval_ttt_steps=5, max_steps=2), target=target, progress=False)
    history = json.loads((tmp_path / "history.json").read_text())
    assert len([entry["eval"] for entry in history if "eval" in entry][-1]["alpha"]) == 5


def test_the_lk_loss_trains_the_held_out_acceptance_rate_up(dataset, target, tmp_path):
    config = config_for(dataset, tmp_path, loss="lk", max_steps=30, eval_every=10, save_every=30, learning_rate=1e-2)
    train(config, target=target, progress=False)
    evals = [entry["eval"] for entry in json.loads((tmp_path / "history.json").read_text()) if "eval" in entry]
    assert evals[-1]["acceptance"][0] > evals[0]["acceptance"][0]
    assert json.loads((tmp_path / "train_config.json").read_text())["loss"] == "lk"


def test_init_draft_continues_from_a_trained_draft_and_its_vocabulary(dataset, target, tmp_path):
    train(config_for(dataset, tmp_path / "first", ttt_steps=1, max_steps=4), target=target, progress=False)
    first = Eagle3DraftModel.from_pretrained(tmp_path / "first" / "draft")
    config = config_for(dataset, tmp_path / "second", init_draft=str(tmp_path / "first" / "draft"), learning_rate=0.0)
    train(config, target=target, progress=False)  # learning rate 0: the weights must come through unchanged
    second = Eagle3DraftModel.from_pretrained(tmp_path / "second" / "draft")
    assert torch.equal(second.d2t, first.d2t)
    for name, tensor in trainable_state_dict(first).items():  # the target's embedding is not saved with the draft
        assert torch.equal(second.state_dict()[name], tensor), name

    with pytest.raises(ValueError, match="--draft-vocab-size 64"):
        train(config_for(dataset, tmp_path / "third", init_draft=str(tmp_path / "first" / "draft"),
                         draft_vocab_size=32), target=target, progress=False)


def test_a_grown_draft_vocabulary_keeps_every_trained_row_and_adds_the_most_frequent_missing_tokens(
        dataset, target, tmp_path):
    train(config_for(dataset, tmp_path / "first", ttt_steps=1, max_steps=4), target=target, progress=False)
    first = Eagle3DraftModel.from_pretrained(tmp_path / "first" / "draft")
    init = {"init_draft": str(tmp_path / "first" / "draft"), "draft_vocab_size": 80}
    with pytest.raises(ValueError, match="--grow-draft-vocabulary to grow it to 80"):
        train(config_for(dataset, tmp_path / "refused", **init), target=target, progress=False)
    # the new rows start from the target's whatever --init-head-from-target says (it is about a fresh draft)
    train(config_for(dataset, tmp_path / "grown", **init, grow_draft_vocabulary=True, learning_rate=0.0,
                     init_head_from_target=False), target=target, progress=False)
    grown = Eagle3DraftModel.from_pretrained(tmp_path / "grown" / "draft")
    old, new = first.draft_to_target, grown.draft_to_target
    assert new.numel() == 80 and torch.equal(new, new.sort().values) and torch.isin(old, new).all()
    rows = torch.searchsorted(new, old)
    assert torch.equal(grown.lm_head.weight[rows], first.lm_head.weight)  # learning rate 0: as trained
    for name, tensor in trainable_state_dict(first).items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(grown.state_dict()[name], tensor), name
    # the most frequent answer tokens not held are the ones added
    added = new[~torch.isin(new, old)]
    records = [json.loads(line) for line in (dataset / "shard-00000.jsonl").read_text().splitlines()]
    counts = torch.bincount(torch.tensor([record["input_ids"][6:] for record in records]).flatten(), minlength=VOCAB)
    counts[old] = -1
    assert counts[added].min() >= counts.sort(descending=True).values[added.numel() - 1]
    # the new rows: the target's, mapped as the target's rows of the trained tokens map to the trained rows
    mapping = torch.linalg.lstsq(target.lm_head.weight[old], first.lm_head.weight).solution
    torch.testing.assert_close(grown.lm_head.weight[~torch.isin(new, old)], target.lm_head.weight[added] @ mapping)
    with pytest.raises(ValueError, match="pass the draft to grow"):
        config_for(dataset, tmp_path, grow_draft_vocabulary=True)


def test_a_draft_started_from_the_target_s_last_layer_computes_it_on_the_last_tapped_layer(dataset, target, tmp_path):
    config = config_for(dataset, tmp_path, intermediate_size=target.config.intermediate_size)
    draft = trainer_module.build_draft(trainer_module.draft_config_for(target, config), target,
                                       torch.arange(64), init_head=True, init_layer=True)
    width = draft.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):  # what reads the token embedding keeps a fresh initialisation
            assert getattr(draft.midlayer.self_attn, name).weight[:, :width].abs().sum() > 0
            getattr(draft.midlayer.self_attn, name).weight[:, :width].zero_()
        input_ids = torch.randint(1, VOCAB, (1, 7))
        hidden = target(input_ids, output_hidden_states=True).hidden_states
        taps = [hidden[layer + 1] for layer in draft.config.target_layer_ids]
        output = draft(input_ids=input_ids, hidden_states=torch.cat(taps, dim=-1), use_cache=False)
        last_layer = target.model.layers[-1]
        positions = torch.arange(7)[None]
        expected = last_layer(taps[-1], attention_mask=None, position_ids=positions,
                              position_embeddings=target.model.rotary_emb(taps[-1], positions))
    torch.testing.assert_close(output.hidden_states, expected)

    with pytest.raises(ValueError, match="--intermediate-size"):
        narrow = config_for(dataset, tmp_path, intermediate_size=32)
        trainer_module.build_draft(trainer_module.draft_config_for(target, narrow), target, torch.arange(64),
                                   init_head=True, init_layer=True)
    with pytest.raises(ValueError, match="pass one of them"):
        config_for(dataset, tmp_path, init_draft=str(tmp_path), init_layer_from_target=True)


def test_precomputed_features_match_online_ones_read_ahead_by_workers_or_not(dataset, target, tmp_path):
    examples = [Example([], [3, 5, 7, 9, 11], [0, 0, 1, 1, 1]), Example([], [4, 6, 8], [0, 1, 1])]
    batches = [[0, 1], [1]]
    online = list(TargetFeatures(target, [2, 4, 5]).batches(examples, batches, "train"))
    stored = TargetFeatures(target, [2, 4, 5], tmp_path)
    stored.precompute(examples, "train", batch_tokens=64, progress=False)
    in_process = list(stored.batches(examples, batches, "train"))
    read_ahead = list(stored.batches(examples, batches, "train", workers=2))
    for got, ahead, expected in zip(in_process, read_ahead, online):
        assert torch.equal(got["input_ids"], expected["input_ids"]) and torch.equal(got["indices"], expected["indices"])
        real = expected["input_ids"].new_ones(expected["input_ids"].shape).bool()
        real[1:, 3:] = False  # padding is zero on disk, anything online
        for name in ("features", "final_hidden"):
            assert got[name].dtype == torch.float32 and torch.equal(got[name], ahead[name])
            assert torch.allclose(got[name][real], expected[name][real], rtol=2e-2, atol=2e-2)
            assert not got[name][~real].any()


def test_offline_training_reads_the_same_batches_with_workers_across_an_epoch_and_a_resume(dataset, target, tmp_path):
    import shutil

    config = config_for(dataset, tmp_path / "in-process", max_steps=12, precompute_features=str(tmp_path / "features"),
                        feature_workers=0)  # 10 batches an epoch: the second starts at step 11
    train(config, target=target, progress=False)
    ahead = replace(config, output_dir=str(tmp_path / "read-ahead"), feature_workers=2)
    train(ahead, target=target, progress=False)
    shutil.rmtree(tmp_path / "read-ahead" / "checkpoint-000012")
    train(ahead, resume=True, target=target, progress=False)  # from step 8
    history = [json.loads((tmp_path / run / "history.json").read_text()) for run in ("in-process", "read-ahead")]
    assert [entry.get("train_loss") for entry in history[0]] == [entry.get("train_loss") for entry in history[1]]
    expected, got = draft_weights(tmp_path / "in-process"), draft_weights(tmp_path / "read-ahead")
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_offline_training_on_the_target_s_parts_alone_equals_training_on_the_whole_target(dataset, target, tmp_path):
    target.save_pretrained(tmp_path / "target", max_shard_size="20KB")  # the decoder layers in shards of their own
    config = config_for(dataset, tmp_path / "first", target=str(tmp_path / "target"),
                        precompute_features=str(tmp_path / "features"))
    train(config, progress=False)  # auto: the features are missing, so the whole target loads and computes them
    assert len(list((tmp_path / "features").glob("*/*.safetensors"))) == 48
    train(replace(config, output_dir=str(tmp_path / "whole"), target_weights="whole"), progress=False)
    index = json.loads((tmp_path / "target" / "model.safetensors.index.json").read_text())["weight_map"]
    parts_shards = {shard for name, shard in index.items() if ".layers." not in name}
    for shard in set(index.values()) - parts_shards:  # a run that read them would fail
        (tmp_path / "target" / shard).write_bytes(b"not a safetensors file")
    for choice in ("parts", "auto"):  # auto: every feature file is there and nothing decodes
        train(replace(config, output_dir=str(tmp_path / choice), target_weights=choice), progress=False)
    histories = [[{key: value for key, value in entry.items() if key != "tokens_per_second"}  # all but the speed
                  for entry in json.loads((tmp_path / run / "history.json").read_text())]
                 for run in ("first", "whole", "parts", "auto")]
    assert all(history == histories[0] for history in histories)  # the loss at every step, every held-out metric
    expected = draft_weights(tmp_path / "whole")
    for run in ("first", "parts", "auto"):
        got = draft_weights(tmp_path / run)
        assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"eval_tree_prompts": 2}, r"--eval-tree-prompts 2 decodes held-out prompts"),
    ({"profile_prompts": 2}, r"--profile-prompts 2 decodes held-out prompts"),
    ({"precompute_features": None}, r"computes the target's features online"),
    ({"init_layer_from_target": True}, r"--init-layer-from-target copies the target's last decoder layer"),
    ({}, r"features of 38 of 38 train, 10 of 10 eval conversations are missing"),
], ids=["tree-tau", "profile", "online", "init-layer", "missing-features"])
def test_a_run_told_to_load_the_target_s_parts_alone_is_refused_where_it_needs_the_whole_target(
        dataset, target, tmp_path, overrides, message):
    target.save_pretrained(tmp_path / "target")
    config = config_for(dataset, tmp_path / "run", **{"target": str(tmp_path / "target"), "target_weights": "parts",
                                                      "precompute_features": str(tmp_path / "features")} | overrides)
    with pytest.raises(ValueError, match=message + r".*--target-weights"):
        train(config, progress=False)


def test_batched_target_features_equal_one_conversation_at_a_time_to_float32_rounding(target):
    torch.manual_seed(0)
    sequences = [torch.randint(1, VOCAB, (length,)).tolist() for length in (30, 13, 9, 5, 3)]
    batched = batched_target_forward(target, sequences, [2, 4, 5])
    for sequence, (features, final_hidden) in zip(sequences, batched):
        alone_features, alone_final_hidden = target_forward(target, torch.tensor([sequence]), [2, 4, 5])
        assert features.dtype == torch.float32 and features.shape[0] == len(sequence)
        # to float32 rounding (torch's float32 tolerances): other batch shapes sum in another order, nothing more
        torch.testing.assert_close(features, alone_features[0])
        torch.testing.assert_close(final_hidden, alone_final_hidden[0])


def test_length_batches_sort_by_length_and_keep_to_the_token_budget():
    lengths = [5, 30, 9, 13, 3, 9, 40]
    batches = length_batches(lengths, batch_tokens=30)
    assert batches == [[6], [1], [3, 2], [5, 0, 4]]  # 40 > 30 goes alone; 2 x 13 <= 30; 3 x 9 <= 30
    assert sorted(sum(batches, [])) == list(range(len(lengths)))


def test_precomputed_files_are_the_same_whatever_the_number_of_processes(dataset, target, tmp_path):
    examples = load_dataset(dataset)[:20]
    features = TargetFeatures(target, [2, 4, 5], tmp_path / "one")
    features.precompute(examples, "train", batch_tokens=96, progress=False)
    one = features.split_dirs["train"]
    shares = []
    for rank in range(3):  # three processes' shares, each written into its own directory to see what it wrote
        share = TargetFeatures(target, [2, 4, 5], tmp_path / f"rank-{rank}")
        share.precompute(examples, "train", batch_tokens=96, rank=rank, world_size=3, progress=False)
        shares.append({path.name: load_file(str(path)) for path in share.split_dirs["train"].iterdir()})
        assert share.split_dirs["train"].name == one.name and shares[-1]
    names = [name for share in shares for name in share]
    assert sorted(names) == sorted(path.name for path in one.iterdir()) == [f"{i:07d}.safetensors" for i in range(20)]
    for share in shares:  # disjoint shares, each file equal to the one a single process writes
        for name, tensors in share.items():
            alone = load_file(str(one / name))
            assert all(torch.equal(tensors[key], alone[key]) for key in ("features", "final_hidden")), name


def test_a_failed_feature_write_stops_precompute_naming_the_file_and_keeps_the_others(dataset, target, tmp_path):
    examples = load_dataset(dataset)[:6]
    features = TargetFeatures(target, [2, 4, 5], tmp_path)
    features.precompute(examples, "train", batch_tokens=64, progress=False)
    directory = features.split_dirs["train"]
    (directory / "0000003.safetensors").unlink()
    (directory / "0000003.safetensors.partial").mkdir()  # where the writer puts the file before renaming it
    with pytest.raises(OSError, match=r"Writing the precomputed features .*0000003.safetensors failed .*free space"):
        features.precompute(examples, "train", batch_tokens=64, progress=False)
    for index in (0, 1, 2, 4, 5):
        assert load_file(str(directory / f"{index:07d}.safetensors"))["features"].shape[0] == 32


def test_epoch_batches_are_deterministic_and_cover_every_example_once():
    lengths = [5, 40, 7, 33, 12, 9, 21, 18, 3, 27]
    batches = epoch_batches(lengths, batch_size=3, seed=0, epoch=2)
    assert batches == epoch_batches(lengths, batch_size=3, seed=0, epoch=2)
    assert batches != epoch_batches(lengths, batch_size=3, seed=0, epoch=3)
    assert sorted(i for batch in batches for i in batch) == list(range(10))


def test_training_and_held_out_examples_are_capped_to_max_length(dataset, tmp_path):
    split = trainer_module._split_examples(config_for(dataset, tmp_path, max_length=20))
    assert [len(split[0]), len(split[1])] == [38, 10]  # eval_fraction 0.2 of 48
    given = trainer_module._split_examples(config_for(dataset, tmp_path, max_length=20, eval_data=str(dataset)))
    assert [len(given[0]), len(given[1])] == [48, 48]
    for examples in (*split, *given):
        assert all(len(e.input_ids) == len(e.loss_mask) == 20 for e in examples)


def test_acceptance_summary():
    summary = acceptance_summary(torch.tensor([8, 4, 1]), torch.tensor([10, 8, 4]))
    assert summary["alpha"] == pytest.approx([0.8, 0.5, 0.25])
    assert summary["chain_tau"] == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_cli_maps_every_option_to_the_config():
    parser = argparse.ArgumentParser()
    trainer_module.register_cli(parser.add_subparsers())
    args = parser.parse_args(
        ["train", "--data", "d", "--output-dir", "o", "--ttt-steps", "1", "--bf16", "--max-steps", "5",
         "--learning-rate", "1e-3", "--no-init-head-from-target"]
    )
    assert args.ttt_steps == 1 and args.bf16 and args.max_steps == 5 and args.learning_rate == 1e-3
    assert args.init_head_from_target is False and args.eval_data is None and args.run is trainer_module._run_cli


def _state_that_creates(path):
    class CreatesAFile:
        def __reduce__(self):
            return open, (str(path), "w")

    return {"optimizer": CreatesAFile()}


def test_resume_never_unpickles_code_from_a_checkpoint(dataset, target, tmp_path):
    config = config_for(dataset, tmp_path / "run", max_steps=4)
    train(config, target=target, progress=False)
    marker = tmp_path / "created-by-the-checkpoint"
    torch.save(_state_that_creates(marker), latest_checkpoint(tmp_path / "run") / "training_state.pt")
    with pytest.raises(ValueError, match="refusing to unpickle"):
        train(config, resume=True, target=target, progress=False)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["missing fc.weight", "NaN weights", "corrupt training state"])
def test_resume_refuses_a_damaged_checkpoint_and_continues_from_the_previous_one(dataset, target, tmp_path, damage):
    from safetensors.torch import save_file

    train(config_for(dataset, tmp_path / "straight"), target=target, progress=False)
    config = config_for(dataset, tmp_path / "damaged")
    train(config, target=target, progress=False)
    latest = latest_checkpoint(tmp_path / "damaged")
    weights = load_file(str(latest / "model.safetensors"))
    if damage == "missing fc.weight":
        del weights["fc.weight"]
    elif damage == "NaN weights":
        weights["fc.weight"][0, 0] = float("nan")
    save_file(weights, str(latest / "model.safetensors"))
    if damage == "corrupt training state":
        (latest / "training_state.pt").write_bytes(b"not a checkpoint")
    train(config, resume=True, target=target, progress=False)  # from checkpoint 4, again to step 8
    expected, got = draft_weights(tmp_path / "straight"), draft_weights(tmp_path / "damaged")
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_a_non_finite_loss_stops_training_with_what_to_do(dataset, target, tmp_path):
    import copy

    broken = copy.deepcopy(target)
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="lower --learning-rate"):
        train(config_for(dataset, tmp_path), target=broken, progress=False)


@pytest.mark.parametrize(
    "setting, message",
    [({"max_grad_norm": -1.0}, "--max-grad-norm must be > 0"), ({"step_decay": -0.5}, "--step-decay must be in"),
     ({"max_steps": -1}, "--max-steps must be >= 1"), ({"max_length": 1}, "--max-length must be >= 3"),
     ({"epochs": 0.0}, "--epochs must be > 0"), ({"eval_fraction": -0.1}, "--eval-fraction must be in"),
     ({"keep_checkpoints": -1}, "--keep-checkpoints must be >= 1"), ({"batch_size": 0}, "--batch-size must be >= 1"),
     ({"gradient_accumulation_steps": 0}, "--gradient-accumulation-steps must be >= 1"),
     ({"save_every": 0}, "--save-every must be >= 1"), ({"eval_every": 0}, "--eval-every must be >= 1"),
     ({"log_every": 0}, "--log-every must be >= 1"), ({"save_dtype": "int8"}, "--save-dtype must be one of"),
     ({"draft_layers": 0}, "--draft-layers must be >= 1")],
)
def test_settings_that_would_silently_ruin_a_run_are_refused_up_front(dataset, tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        config_for(dataset, tmp_path, **setting)


@pytest.mark.parametrize("option, value, bound", [("--draft-layers", 100000, "64"),
                                                  ("--intermediate-size", 10**9, "262,144"),
                                                  ("--draft-vocab-size", 10**9, "1,048,576"),
                                                  ("--ttt-steps", 10**6, "64"), ("--max-length", 10**9, "1,048,576")])
def test_a_size_setting_past_its_bound_is_refused_before_anything_is_allocated(dataset, tmp_path, option, value,
                                                                              bound):
    with pytest.raises(SystemExit, match=f"{option} must be at most {bound}, got {value:,}"):
        cli.main(["train", "--data", str(dataset), "--output-dir", str(tmp_path), option, str(value)])
    assert not any(tmp_path.iterdir())  # nothing written, nothing built


def test_the_cli_reports_a_bad_setting_in_one_sentence(dataset, tmp_path):
    from hf_eagle3.commands import cli

    with pytest.raises(SystemExit, match="hf-eagle3 train: error: Invalid training settings: --max-grad-norm must be"):
        cli.main(["train", "--data", str(dataset), "--output-dir", str(tmp_path), "--max-grad-norm", "-1"])
    with pytest.raises(ValueError, match="--max-grad-norm must be > 0"):  # the traceback with --debug
        cli.main(["--debug", "train", "--data", str(dataset), "--output-dir", str(tmp_path), "--max-grad-norm", "-1"])


def test_precomputed_features_of_another_target_are_never_read(dataset, target, tmp_path):
    examples = [Example([], [3, 5, 7, 9, 11], [0, 0, 1, 1, 1])]
    other = tiny_target("llama", seed=1)  # same hidden size, other weights
    TargetFeatures(target, [2, 4, 5], tmp_path).precompute(examples, "train", batch_tokens=64, progress=False)
    shared = TargetFeatures(other, [2, 4, 5], tmp_path)
    shared.precompute(examples, "train", batch_tokens=64, progress=False)
    online = next(TargetFeatures(other, [2, 4, 5]).batches(examples, [[0]], "train"))
    stored = next(shared.batches(examples, [[0]], "train"))
    for name in ("features", "final_hidden"):
        assert torch.allclose(stored[name], online[name], rtol=2e-2, atol=2e-2)
    assert len(list(tmp_path.glob("train-*"))) == 2


def test_data_tokenized_for_another_vocabulary_is_refused(tmp_path, target):
    directory = tmp_path / "data"
    directory.mkdir()
    rows = [{"messages": [], "input_ids": [1, 2, VOCAB + 7, 3], "loss_mask": [0, 1, 1, 1]}] * 8
    (directory / "shard-00000.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    with pytest.raises(ValueError, match=f"token id {VOCAB + 7}, outside the target's vocabulary of {VOCAB}"):
        train(config_for(directory, tmp_path / "run"), target=target, progress=False)


def test_a_moved_run_directory_resumes_and_bookkeeping_settings_may_change(dataset, target, tmp_path):
    import shutil

    target.save_pretrained(tmp_path / "target")
    argv = ["train", "--data", str(dataset), "--target", str(tmp_path / "target"), "--draft-vocab-size", "64",
            "--intermediate-size", "64", "--ttt-steps", "1", "--max-steps", "2", "--save-every", "2",
            "--eval-every", "1000", "--eval-batches", "0", "--threads", "1", "--profile-prompts", "0"]
    first = parse_train_cli([*argv, "--output-dir", str(tmp_path / "run")])
    first.run(first)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    (tmp_path / "moved" / "draft").rename(tmp_path / "first-draft")
    without_target = argv[:3] + argv[5:]  # the data records no target: the run's own train_config.json does
    resumed = parse_train_cli([*without_target, "--output-dir", str(tmp_path / "moved"), "--log-every", "3",
                               "--resume"])
    resumed.run(resumed)
    assert (tmp_path / "moved" / "draft" / "model.safetensors").is_file()
    changed = parse_train_cli([*argv, "--output-dir", str(tmp_path / "moved"), "--ttt-steps", "2", "--resume"])
    with pytest.raises(ValueError, match=r"cannot change --ttt-steps 1 -> 2 \(defines the training loss\)"):
        changed.run(changed)


def test_a_full_disk_at_a_checkpoint_is_one_sentence_and_keeps_the_run_resumable(dataset, target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    argv = ["train", "--data", str(dataset), "--target", str(tmp_path / "target"), "--draft-vocab-size", "64",
            "--intermediate-size", "64", "--ttt-steps", "1", "--max-steps", "2", "--save-every", "2",
            "--eval-every", "1000", "--eval-batches", "0", "--threads", "1", "--profile-prompts", "0",
            "--output-dir", str(tmp_path / "run")]
    script = (
        "import resource, signal, sys; from hf_eagle3.commands import cli; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "  # a write past the limit fails with EFBIG, like a full disk
        "resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000)); cli.main(sys.argv[1:])"
    )
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("hf-eagle3 train: error: Cannot write the step-2 checkpoint")
    assert "free disk" in last_line
    assert latest_checkpoint(tmp_path / "run") is None  # no half-written checkpoint passes for a complete one


def test_data_regenerated_by_another_model_is_reported(dataset, target, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    (data / "manifest.json").write_text(json.dumps({"settings": {"regenerated_by": "org/Another-Model"}}))
    original, target.config.name_or_path = target.config.name_or_path, "/models/Tiny-Target"
    try:
        train(config_for(data, tmp_path / "run", max_steps=1), target=target, progress=False)
    finally:
        target.config.name_or_path = original
    assert "regenerated by org/Another-Model, not by the target /models/Tiny-Target" in capsys.readouterr().out


def test_a_run_without_a_profile_ends_with_the_bench_command_for_its_own_target(tmp_path):
    verdict = speed_verdict(tiny_draft(), None, tmp_path / "draft", "path/to/target")
    assert "is not known: measure it with `hf-eagle3 bench --target path/to/target --draft " in verdict


def test_the_trained_draft_records_its_acceptance_profile_and_decodes_with_an_auto_tree(dataset, target, tmp_path,
                                                                                      monkeypatch, capsys):
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path / "cache"))
    train(config_for(dataset, tmp_path / "run", profile_prompts=2), target=target, progress=False)
    # the run ends saying whether the draft it wrote decodes faster than plain decoding here
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith(f"Wrote {tmp_path / 'run' / 'draft'}, ") and "plain decoding on this machine" in verdict
    draft = Eagle3DraftModel.from_pretrained(tmp_path / "run" / "draft")
    profile = draft.config.acceptance_profile
    assert draft.config.tree_shape == "auto" and {row["tree_top_k"] for row in profile} == set(PROFILE_TOP_KS)
    assert all(row["tau"] >= 1 for row in profile) and max(row["tree_depth"] for row in profile) == PROFILE_MAX_DEPTH
    assert all(row["prompts"] == 2 and row["cycles"] > 0 for row in profile)  # what each τ rests on
    prompt = torch.tensor([[5, 17, 33, 2, 61, 8]])
    expected = target.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft), expected)
    assert draft.generation_stats.shape_choice is not None  # the machine's calibration chose


def test_a_draft_of_two_decoder_layers_trains_saves_them_and_decodes_as_plain_greedy(dataset, target, tmp_path):
    train(config_for(dataset, tmp_path / "run", draft_layers=2), target=target, progress=False)
    draft = Eagle3DraftModel.from_pretrained(tmp_path / "run" / "draft")
    assert draft.config.num_hidden_layers == 2 and len(draft.extra_layers) == 1
    earliest = sorted((tmp_path / "run").glob("checkpoint-*"))[0]  # step 4 of 8
    latest, earlier = draft_weights(tmp_path / "run"), load_file(str(earliest / "model.safetensors"))
    second_layer = [name for name in latest if name.startswith("extra_layers.")]
    assert second_layer and any(not torch.equal(latest[name], earlier[name]) for name in second_layer)  # it learns
    prompt = torch.tensor([[5, 17, 33, 2, 61, 8]])
    expected = target.generate(prompt, max_new_tokens=16, do_sample=False)
    output = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft, tree_depth=3,
                             tree_top_k=2, tree_total_tokens=6)
    assert torch.equal(output, expected)
    with pytest.raises(ValueError, match="--draft-layers shapes a fresh draft"):
        config_for(dataset, tmp_path, draft_layers=2, init_draft=str(tmp_path / "run" / "draft"))


# ------------------------------------------------------------------------------------- accelerate launch, CPU (gloo)

# Runs the real `hf-eagle3 train` command line in each process, then saves that process's final draft weights.
TRAIN_AND_DUMP_WEIGHTS = """
import sys
from accelerate import PartialState
from safetensors.torch import save_file
from hf_eagle3.commands.cli import build_parser
from hf_eagle3.training.trainer import trainable_state_dict

args = build_parser().parse_args(sys.argv[2:])
draft = args.run(args)
state = PartialState()
tensors = {name: tensor.contiguous() for name, tensor in trainable_state_dict(draft).items()}
save_file(tensors, f"{sys.argv[1]}/rank-{state.process_index}.safetensors",
          metadata={"main": str(state.is_main_process)})
"""
LAUNCH_SETTINGS = dict(draft_vocab_size=64, intermediate_size=64, ttt_steps=2, learning_rate=3e-3, warmup_steps=2,
                       save_every=2, eval_every=2, log_every=1, eval_fraction=0.02, seed=1, threads=1,
                       profile_prompts=0, precompute_batch_tokens=256)  # 8 conversations a batch: 6 batches to share


def accelerate_launch(launch_args, command, tmp_path, env=None):
    """`accelerate launch LAUNCH_ARGS COMMAND` in a clean accelerate configuration, on a free port."""
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    environment = os.environ | {"OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([accelerate, "launch", "--main_process_port", "0", *launch_args, *command],
                          env=environment | (env or {}), capture_output=True, text=True, timeout=300)


def train_argv(target_dir, data, output_dir, **settings):
    argv = ["train", "--data", str(data), "--target", str(target_dir), "--output-dir", str(output_dir)]
    for name, value in (LAUNCH_SETTINGS | settings).items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


@pytest.fixture(scope="module")
def two_cpu_processes(dataset, target, tmp_path_factory):
    """A 4-step run in 2 CPU processes (gloo), 2 conversations per process and step; 1 held-out conversation, so
    process 1 has no held-out batch. Target features are precomputed (each process its share, read by both)."""
    root = tmp_path_factory.mktemp("two-processes")
    target.save_pretrained(root / "target")
    (root / "train_and_dump.py").write_text(TRAIN_AND_DUMP_WEIGHTS)
    argv = train_argv(root / "target", dataset, root / "run", batch_size=2, max_steps=4,
                      precompute_features=root / "features")
    result = accelerate_launch(["--multi_gpu", "--num_processes", "2"], [str(root / "train_and_dump.py"), str(root),
                               *argv], root, env={"ACCELERATE_USE_CPU": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_two_cpu_processes_with_fewer_held_out_batches_than_processes_train_as_one_process(
        two_cpu_processes, dataset, target, tmp_path):
    root = two_cpu_processes
    ranks = [safe_open_weights(root / f"rank-{rank}.safetensors") for rank in (0, 1)]
    assert [main for main, _ in ranks] == ["True", "False"]  # one main process: the only one that writes
    assert all(torch.equal(ranks[0][1][name], ranks[1][1][name]) for name in ranks[0][1])  # both ranks end alike
    assert sorted(path.name for path in (root / "run").iterdir() if path.name.startswith((".", "checkpoint"))) == [
        "checkpoint-000002", "checkpoint-000004"]  # nothing half-written, no checkpoint twice

    # One process with the same global batch: 2 conversations x 2 accumulated micro-batches per step
    single = tmp_path / "single"
    settings = {name: value for name, value in LAUNCH_SETTINGS.items() if name != "threads"}
    train(TrainConfig(data=str(dataset), output_dir=str(single), batch_size=2, gradient_accumulation_steps=2,
                      max_steps=4, precompute_features=str(tmp_path / "features"), **settings),
          target=target, progress=False)
    launched = json.loads((root / "run" / "history.json").read_text())
    alone = json.loads((single / "history.json").read_text())
    assert [sorted(entry) for entry in launched] == [sorted(entry) for entry in alone]
    for got, expected in zip(launched, alone):
        if "eval" in expected:  # the held-out metrics over the one batch, however many processes share it
            assert got["eval"]["loss"] == pytest.approx(expected["eval"]["loss"], rel=1e-5)
            assert got["eval"]["alpha"] == pytest.approx(expected["eval"]["alpha"], abs=1e-9)
        else:
            assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5)
            assert got["tokens"] == expected["tokens"] and got["lr"] == pytest.approx(expected["lr"])
    assert any("eval" in entry for entry in launched)
    expected_weights = draft_weights(single)
    for name, tensor in ranks[0][1].items():
        assert torch.allclose(tensor, expected_weights[name], atol=1e-5), name
    # the two processes' shares of the features make the files one process writes, file for file
    shared, alone = sorted((root / "features").glob("*/*")), sorted((tmp_path / "features").glob("*/*"))
    split_and_name = [[(path.parent.name.split("-")[0], path.name) for path in paths] for paths in (shared, alone)]
    assert split_and_name[0] == split_and_name[1]  # (the fingerprints differ: the targets' paths do)
    assert all(path.read_bytes() == other.read_bytes() for path, other in zip(shared, alone))


def test_a_run_resumed_under_accelerate_extends_max_steps_on_the_longer_schedule(two_cpu_processes, dataset, target,
                                                                                 tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_cpu_processes / "run", run)
    # the resumed processes load the target's parts alone: every feature file is there, and nothing decodes
    argv = train_argv(two_cpu_processes / "target", dataset, run, batch_size=2, max_steps=6, eval_every=3,
                      precompute_features=two_cpu_processes / "features", eval_tree_prompts=0, target_weights="parts")
    result = accelerate_launch(["--multi_gpu", "--num_processes", "2", "-m"], ["hf_eagle3", *argv, "--resume"],
                               tmp_path, env={"ACCELERATE_USE_CPU": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert latest_checkpoint(run).name == "checkpoint-000006"
    history = json.loads((run / "history.json").read_text())
    assert [entry["step"] for entry in history if "eval" in entry] == [2, 4, 6]  # --eval-every changed on resume
    learning_rates = {entry["step"]: entry["lr"] for entry in history if "lr" in entry}
    assert sorted(learning_rates) == [1, 2, 3, 4, 5, 6]

    def schedule(total_steps):
        return get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=1.0), 2, total_steps).lr_lambdas[0]

    # steps 1-4 ran on the 4-step schedule; the resumed steps continue on the 6-step one, which ends at 0
    assert [learning_rates[step] for step in (1, 3, 4)] == pytest.approx([3e-3 * schedule(4)(s) for s in (1, 3, 4)])
    assert [learning_rates[step] for step in (5, 6)] == pytest.approx([3e-3 * schedule(6)(s) for s in (5, 6)])
    assert learning_rates[5] > 0 and learning_rates[6] == 0

    # The same extension in one process (same global batch) reaches the same weights and data position
    single = tmp_path / "single"
    settings = {name: value for name, value in LAUNCH_SETTINGS.items() if name != "threads"}
    config = TrainConfig(data=str(dataset), output_dir=str(single), batch_size=2, gradient_accumulation_steps=2,
                         max_steps=4, precompute_features=str(tmp_path / "features"), **settings)
    train(config, target=target, progress=False)
    train(replace(config, max_steps=6), resume=True, target=target, progress=False)
    for key in ("step", "epoch", "tokens"):
        launched_state = json.loads((run / "checkpoint-000006" / "trainer_state.json").read_text())
        single_state = json.loads((single / "checkpoint-000006" / "trainer_state.json").read_text())
        assert launched_state[key] == single_state[key], key
    expected, got = draft_weights(single), draft_weights(run)
    assert all(torch.allclose(got[name], expected[name], atol=1e-5) for name in expected)

    with pytest.raises(ValueError, match="past the run's end at step 5: pass a --max-steps of at least 6"):
        train(replace(config, max_steps=5), resume=True, target=target, progress=False)


# The same, recording at each gathering of the draft what the processes hold of its (the target's) token embedding.
FSDP_TRAIN_AND_DUMP_WEIGHTS = """
import json, sys
from torch.distributed.tensor import DTensor
from hf_eagle3.training import trainer

gather, seen = trainer.whole_draft, set()

def recording(accelerator, ttt):
    weight = accelerator.unwrap_model(ttt).draft.embed_tokens.weight
    seen.add(json.dumps({"sharded": isinstance(weight, DTensor), "gradient": weight.grad is not None,
                         "trainable": weight.requires_grad}))
    return gather(accelerator, ttt)

trainer.whole_draft = recording
""" + TRAIN_AND_DUMP_WEIGHTS.replace('metadata={"main": str(state.is_main_process)}',
                                    'metadata={"main": str(state.is_main_process), "embedding": " ".join(seen)}')


def test_an_fsdp2_launch_on_cpu_trains_data_parallel_as_ddp_with_the_target_embedding_whole(
        two_cpu_processes, dataset, tmp_path):
    root = two_cpu_processes
    (tmp_path / "train_and_dump.py").write_text(FSDP_TRAIN_AND_DUMP_WEIGHTS)
    argv = train_argv(root / "target", dataset, tmp_path / "run", batch_size=2, max_steps=4,
                      precompute_features=root / "features")
    result = accelerate_launch(["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2"],
                               [str(tmp_path / "train_and_dump.py"), str(tmp_path), *argv], tmp_path,
                               env={"ACCELERATE_USE_CPU": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    # accelerate applies FSDP on accelerators only: on CPU (MULTI_CPU) nothing is sharded, and the run is DDP's
    assert json.loads((tmp_path / "run" / "checkpoint-000004" / "trainer_state.json").read_text())["sharded"] is False
    for rank in (0, 1):  # the target's tensor, whole, frozen, without gradient
        with safe_open(str(tmp_path / f"rank-{rank}.safetensors"), "pt") as file:
            assert json.loads(file.metadata()["embedding"]) == {"sharded": False, "gradient": False,
                                                                 "trainable": False}
    sharded, data_parallel = (json.loads((run / "history.json").read_text()) for run in (tmp_path / "run",
                                                                                        root / "run"))
    assert [sorted(entry) for entry in sharded] == [sorted(entry) for entry in data_parallel]
    for got, expected in zip(sharded, data_parallel):
        if "eval" in expected:
            assert got["eval"]["loss"] == pytest.approx(expected["eval"]["loss"], rel=1e-5)
            assert got["eval"]["tree_tau"] == pytest.approx(expected["eval"]["tree_tau"])
        else:
            assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5)
    for folder in ("draft", "best", "checkpoint-000004"):  # the whole draft, without the target's embedding
        got, expected = (load_file(str(run / folder / "model.safetensors")) for run in (tmp_path / "run",
                                                                                        root / "run"))
        assert sorted(got) == sorted(expected) and "embed_tokens.weight" not in got
        assert all(torch.allclose(got[name], expected[name], atol=1e-5) for name in expected), folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="--multi_gpu runs on the GPUs here")
def test_a_multi_gpu_launch_without_gpus_is_refused_before_anything_is_written(dataset, target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    argv = train_argv(tmp_path / "target", dataset, tmp_path / "run", max_steps=2)
    result = accelerate_launch(["--multi_gpu", "--num_processes", "2", "-m"], ["hf_eagle3", *argv], tmp_path)
    assert result.returncode != 0
    assert "hf-eagle3 train: error: This process is one of 2 launched, but accelerate found no device" in result.stderr
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N -m hf_eagle3 train" in result.stderr
    assert not (tmp_path / "run").exists()


def test_accelerate_launch_mixed_precision_is_the_run_s_unless_the_command_says_otherwise(dataset, target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    argv = train_argv(tmp_path / "target", dataset, tmp_path / "run", max_steps=1)
    # `--cpu --num_processes 2` starts one process (several only through MPI): the run says so and what to use
    result = accelerate_launch(["--cpu", "--num_processes", "2", "--mixed_precision", "bf16", "-m"],
                               ["hf_eagle3", *argv], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: training in 1 process" in result.stdout and "ACCELERATE_USE_CPU=1" in result.stdout
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["bf16"] is True
    result = accelerate_launch(["--num_processes", "1", "--mixed_precision", "bf16", "-m"],
                               ["hf_eagle3", *train_argv(tmp_path / "target", dataset, tmp_path / "fp32", max_steps=1),
                                "--no-bf16"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "fp32" / "train_config.json").read_text())["bf16"] is False


def safe_open_weights(path):
    with safe_open(str(path), "pt") as file:
        return file.metadata()["main"], {name: file.get_tensor(name) for name in file.keys()}


def test_every_setting_is_either_resumable_or_fixed_for_a_stated_reason():
    fixed = [name for names in trainer_module.FIXED_SETTINGS.values() for name in names]
    resumable = list(trainer_module.RESUMABLE_CHANGES)
    assert sorted(fixed + resumable) == sorted(setting.name for setting in dataclass_fields(TrainConfig))


def test_the_target_comes_from_the_data_and_another_one_is_refused_naming_both(dataset, target, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    (data / "manifest.json").write_text(json.dumps({"settings": {"target_name_or_path": "/models/Tiny-Target"}}))
    assert trainer_module.resolve_target(config_for(data, tmp_path / "run")) == "/models/Tiny-Target"
    # the same model under another path or Hub id is the same target
    assert trainer_module.resolve_target(config_for(data, tmp_path / "run", target="org/tiny-target"))
    with pytest.raises(ValueError, match=r"prepared for the target /models/Tiny-Target \(its manifest.json\), not for "
                                         r"--target smollm2.*Pass --target /models/Tiny-Target, or prepare"):
        train(config_for(data, tmp_path / "run", target="smollm2"), target=target, progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="does not record the target it was prepared for.*pass --target"):
        trainer_module.resolve_target(config_for(dataset, tmp_path / "run"))


def train_cli_arguments(data, target_dir, output_dir, *extra):
    return ["train", "--data", str(data), "--target", str(target_dir), "--output-dir", str(output_dir),
            "--draft-vocab-size", "64", "--intermediate-size", "64", "--batch-size", "4", "--ttt-steps", "1",
            "--warmup-steps", "1", "--save-every", "2", "--eval-batches", "0", "--profile-prompts", "0",
            "--threads", "1", *extra]


def test_a_resumed_run_refuses_data_that_changed_since_its_checkpoint_unless_told(dataset, target, tmp_path, capsys):
    import shutil

    data, target_dir, run = tmp_path / "data", tmp_path / "target", tmp_path / "run"
    shutil.copytree(dataset, data)
    target.save_pretrained(target_dir)
    cli.main(train_cli_arguments(data, target_dir, run, "--max-steps", "2"))
    shard = data / "shard-00000.jsonl"
    original = shard.read_text()
    lines = original.splitlines(keepends=True)
    edited = json.loads(lines[3]) | {"input_ids": [1] * 32}
    for change, message in [
        (lambda: shard.write_text("".join(lines[:-8])), "shard-00000.jsonl changed"),  # shrunk
        (lambda: shard.write_text("".join(lines[:3] + [json.dumps(edited) + "\n"] + lines[4:])),
         "shard-00000.jsonl changed"),  # edited
        (lambda: (data / "shard-00001.jsonl").write_text("".join(lines[:8])), "shard-00001.jsonl added"),  # grown
    ]:
        change()
        with pytest.raises(SystemExit, match=f"--resume: the data changed since checkpoint-000002 .*{message}.*"
                                             "pass --allow-data-change to continue on the new data"):
            cli.main(train_cli_arguments(data, target_dir, run, "--max-steps", "4", "--resume"))
        shard.write_text(original)
        (data / "shard-00001.jsonl").unlink(missing_ok=True)
    assert latest_checkpoint(run).name == "checkpoint-000002"  # nothing trained on the other data
    shard.write_text("".join(lines[:-8]))
    cli.main(train_cli_arguments(data, target_dir, run, "--max-steps", "4", "--resume", "--allow-data-change"))
    assert "continuing on the new data (--allow-data-change)" in capsys.readouterr().out
    assert latest_checkpoint(run).name == "checkpoint-000004"
    cli.main(train_cli_arguments(data, target_dir, run, "--max-steps", "6", "--resume"))  # its data now: resumes
    assert latest_checkpoint(run).name == "checkpoint-000006"


def test_a_length_cap_that_leaves_the_answers_out_of_the_loss_stops_before_training(dataset, target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(SystemExit, match=r"Only 0 of the 288 tokens of .* within --max-length 6 are answer tokens the "
                                         r"loss covers \(0.00%, under 1%\).*answers start at token 6 on median.*"
                                         "Raise --max-length"):
        cli.main(train_cli_arguments(dataset, tmp_path / "target", tmp_path / "run", "--max-length", "6"))
    assert latest_checkpoint(tmp_path / "run") is None and not (tmp_path / "run" / "draft").exists()


def test_precision_defaults_to_bf16_only_where_the_device_has_bf16_units(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    expected = "bf16" if trainer_module.has_bf16_units(use_cpu=not torch.cuda.is_available()) else "no"
    assert trainer_module.mixed_precision(None) == expected
    assert (trainer_module.mixed_precision(True), trainer_module.mixed_precision(False)) == ("bf16", "no")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what `accelerate launch` sets when nothing names one
    assert trainer_module.mixed_precision(None) == expected
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # `accelerate launch --mixed_precision bf16`
    assert trainer_module.mixed_precision(None) is None  # accelerate's own
    assert trainer_module.mixed_precision(False) == "no"
