"""Data preparation: robust reading, assistant-only loss masks, regeneration by the target, resumable shards."""

import json
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_eagle3.commands.cli import main
from hf_eagle3.training.data import (
    MAX_MESSAGES,
    MAX_RECORD_BYTES,
    SkipCounts,
    load_dataset,
    prepare_dataset,
    read_conversations,
    regenerate_conversations,
    tokenize_conversation,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer with a ChatML template, trained offline on a few sentences."""
    corpus = ["How can I help you today? The quick brown fox jumps over the lazy dog."] * 20
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def tiny_chat_target(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer, tiny_chat_target):
    """The tiny chat target saved with its tokenizer, as `prepare-data --target DIR` reads it."""
    directory = tmp_path_factory.mktemp("target")
    tiny_chat_target.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def conversation(*contents):
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": content} for i, content in enumerate(contents)]


def sharegpt_record(*contents):
    return {"id": "x", "conversations": [{"from": ("human", "gpt")[i % 2], "value": c} for i, c in enumerate(contents)]}


def test_truncated_sharegpt_json_recovers_every_complete_record(tmp_path):
    records = [sharegpt_record("hi", "hello"), sharegpt_record("a", "b", "c", "d"), sharegpt_record("q", "r")]
    text = json.dumps(records)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-1] + ', {"id": "y", "conversations": [{"from": "human", "val')  # cut mid-record
    skipped = SkipCounts()
    conversations = list(read_conversations(path, skipped))
    assert conversations == [conversation("hi", "hello"), conversation("a", "b", "c", "d"), conversation("q", "r")]
    assert skipped == {"truncated record at end of file": 1}


def test_a_record_range_keeps_the_records_at_those_file_positions_counting_unusable_ones(tmp_path):
    array = tmp_path / "sharegpt.json"
    text = json.dumps([sharegpt_record("a", "1"), "not a conversation", sharegpt_record("b", "2"),
                       sharegpt_record("c", "3")])
    array.write_text(text[:-1] + ', {"id": "cut')
    lines = tmp_path / "chat.jsonl"
    lines.write_text("\n".join([json.dumps(conversation("a", "1")), "", "{not json",
                                 json.dumps(conversation("b", "2")), json.dumps(conversation("c", "3"))]))
    for path in (array, lines):
        skipped = SkipCounts()
        assert list(read_conversations(path, skipped, range(2, 3))) == [conversation("b", "2")]
        assert skipped == {}  # what lies outside the range is neither read nor counted
        assert list(read_conversations(path, SkipCounts(), range(0, 2))) == [conversation("a", "1")]
        assert list(read_conversations(path, SkipCounts(), range(3, 10))) == [conversation("c", "3")]


def test_prepare_data_records_the_record_range_it_read(tmp_path, target_dir, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(conversation(f"q{i}", f"answer {i}")) for i in range(6)))
    main(["prepare-data", "--input", str(path), "--output", str(tmp_path / "data"), "--target", str(target_dir),
          "--records", "1:4"])
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["settings"]["records"] == [1, 4] and manifest["conversations"] == 3
    with pytest.raises(SystemExit):
        main(["prepare-data", "--input", str(path), "--output", str(tmp_path / "other"), "--target", str(target_dir),
              "--records", "4:1"])
    assert "START < STOP" in capsys.readouterr().err


def test_a_record_range_past_the_end_of_the_inputs_says_so(tmp_path, target_dir):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(conversation(f"q{i}", f"answer {i}")) for i in range(6)))
    with pytest.raises(SystemExit) as error:
        main(["prepare-data", "--input", str(path), "--output", str(tmp_path / "data"), "--target", str(target_dir),
              "--records", "6:"])
    assert f"--records 6: selects no record of {path}: they end before position 6" in str(error.value)
    assert "file format" not in str(error.value)


def test_malformed_records_are_skipped_with_a_count(tmp_path):
    lines = [
        json.dumps({"messages": conversation("fine", "ok")}),
        "{not json",
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"content": "no role"}]}),
        json.dumps({"messages": [{"role": "narrator", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps({"conversations": [{"from": "gpt", "value": "starts with the assistant"}]}),
        json.dumps(["not a turn"]),
        json.dumps(conversation("bare list of messages", "fine")),
        json.dumps({"messages": [*conversation("cut at the broken turn", "yes"), conversation("x", "again")[1]]}),
        "",
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines))
    skipped = SkipCounts()
    conversations = list(read_conversations(path, skipped))
    assert conversations == [
        conversation("fine", "ok"),
        conversation("bare list of messages", "fine"),
        conversation("cut at the broken turn", "yes"),
    ]
    assert skipped == {
        "bad JSON line": 1,
        "empty conversation": 1,
        "missing role": 1,
        "unknown role": 1,
        "missing content": 1,
        "no user turn at the start": 1,
        "malformed turn": 1,
    }


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No data file"):
        list(read_conversations(tmp_path / "absent.jsonl"))


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = conversation("How can I help?", "The quick fox.", "And the dog?", "It is lazy.")
    input_ids, loss_mask = tokenize_conversation(tokenizer, messages, max_length=1000)
    assert len(input_ids) == len(loss_mask)
    masked = tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if m])
    assert masked == "The quick fox.<|im_end|>It is lazy.<|im_end|>"
    assert input_ids == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False))["input_ids"]


def test_length_cap_cuts_and_drops_conversations_without_assistant_tokens(tokenizer):
    messages = conversation("How can I help you today? " * 4, "The quick fox.")
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    prompt_length = len(tokenizer(prompt)["input_ids"])
    input_ids, loss_mask = tokenize_conversation(tokenizer, messages, max_length=prompt_length + 2)
    assert len(input_ids) == prompt_length + 2 and sum(loss_mask) == 2
    assert tokenize_conversation(tokenizer, messages, max_length=prompt_length) is None


def test_an_answer_s_generated_token_ids_replace_its_text_in_the_training_example(tokenizer):
    messages = conversation("How can I help?", "The quick fox.")
    as_text = tokenize_conversation(tokenizer, messages, max_length=1000)
    prompt_ids = tokenizer(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True))[
        "input_ids"]
    # the same answer split into one token per character, as a target may generate what its tokenizer merges
    generated = [tokenizer(character)["input_ids"][0] for character in "The quick fox."]
    assert generated != as_text[0][len(prompt_ids) : len(prompt_ids) + len(generated)]
    input_ids, loss_mask = tokenize_conversation(tokenizer, [messages[0], messages[1] | {"token_ids": generated}], 1000)
    end_of_turn = as_text[0][len(prompt_ids) + sum(as_text[1]) - 1 :]  # the mask: the answer's tokens and <|im_end|>
    assert input_ids == prompt_ids + generated + end_of_turn
    assert tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if m]) == "The quick fox.<|im_end|>"
    assert sum(loss_mask) == len(generated) + 1
    cut = tokenize_conversation(tokenizer, [messages[0], messages[1] | {"token_ids": generated}], len(prompt_ids) + 3)
    assert cut == (prompt_ids + generated[:3], [0] * len(prompt_ids) + [1] * 3)


def test_a_regenerated_answer_is_trained_on_the_ids_the_target_generated(tokenizer, tiny_chat_target):
    messages = conversation("How can I help?", "original answer")
    regenerated = regenerate_conversations(tiny_chat_target, tokenizer, [messages], max_new_tokens=12, progress=False)
    prompt = tokenizer(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
                       return_tensors="pt")
    output = tiny_chat_target.generate(**prompt, max_new_tokens=12, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)[0, prompt["input_ids"].shape[1] :].tolist()
    stops = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    generated = output[: next((i for i, t in enumerate(output) if t in stops), None)]
    assert regenerated[0][1]["token_ids"] == generated
    input_ids, loss_mask = tokenize_conversation(tokenizer, regenerated[0], max_length=1000)
    length = prompt["input_ids"].shape[1]
    assert input_ids[: length + len(generated)] == prompt["input_ids"][0].tolist() + generated
    assert loss_mask[length : length + len(generated)] == [1] * len(generated) and not any(loss_mask[:length])


def test_regeneration_replaces_answers_and_skips_long_prompts(tokenizer, tiny_chat_target):
    conversations = [
        conversation("How can I help?", "original answer", "And the dog?", "original"),
        conversation("The quick brown fox jumps over the lazy dog. " * 20, "original"),
    ]
    skipped = SkipCounts()
    regenerated = regenerate_conversations(
        tiny_chat_target, tokenizer, conversations, max_turns=2, max_prompt_length=80, max_new_tokens=5,
        batch_size=2, skipped=skipped, progress=False,
    )
    assert skipped == {"prompt longer than the cap": 1}
    assert len(regenerated) == 1 and [m["role"] for m in regenerated[0]] == ["user", "assistant"] * 2
    assert [m["content"] for m in regenerated[0][::2]] == ["How can I help?", "And the dog?"]
    assert regenerated[0][1]["content"] != "original answer"
    assert tokenizer.padding_side == "right"  # restored


def test_prepare_writes_shards_and_resumes_without_regenerating(tmp_path, tokenizer, tiny_chat_target):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(f"question {i}?", "answer")}) for i in range(5)))
    output = tmp_path / "prepared"
    options = dict(max_length=64, shard_size=2, max_new_tokens=4, batch_size=4, progress=False)
    first = prepare_dataset([path], output, tokenizer, target=tiny_chat_target, **options)
    assert sorted(p.name for p in output.glob("shard-*.jsonl")) == [f"shard-0000{i}.jsonl" for i in range(3)]
    assert len(first.examples) == 5 and json.loads((output / "manifest.json").read_text())["conversations"] == 5

    def no_generation(*args, **kwargs):  # resuming must read the shards, never generate again
        raise AssertionError("regenerated an existing shard")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_chat_target, "generate", no_generation)
        resumed = prepare_dataset([path], output, tokenizer, target=tiny_chat_target, **options)
    assert resumed.examples == first.examples == load_dataset(output)
    with pytest.raises(ValueError, match="these differ: max_length"):
        prepare_dataset([path], output, tokenizer, target=tiny_chat_target, **{**options, "max_length": 32})


@pytest.mark.parametrize("damage", ["deleted", "not JSON", "another shape"])
def test_a_shard_whose_record_is_missing_or_damaged_is_refused_with_what_to_do(tmp_path, tokenizer, damage):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(f"question {i}?", "answer")}) for i in range(5)))
    output = tmp_path / "prepared"
    prepare_dataset([path], output, tokenizer, max_length=64, shard_size=2, progress=False)
    record = output / "shard-00001.record.json"
    if damage == "deleted":
        record.unlink()
    else:
        record.write_text("{" if damage == "not JSON" else "[1, 2]")
    with pytest.raises(ValueError) as error:
        prepare_dataset([path], output, tokenizer, max_length=64, shard_size=2, progress=False)
    assert str(record) in str(error.value) and f"Delete {output / 'shard-00001.jsonl'}" in str(error.value)


def test_a_shard_is_regenerated_in_full_batches_when_prompts_over_the_cap_are_passed_over(tmp_path, tokenizer,
                                                                                          tiny_chat_target, capsys):
    long = "The quick brown fox jumps over the lazy dog. " * 20
    questions = ["question 0?", long, "question 1?", long, long, "question 2?", "question 3?", "question 4?"]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(question, "answer")}) for question in questions))
    batch_sizes = []
    generate = tiny_chat_target.generate

    def counted_generate(**inputs):
        batch_sizes.append(inputs["input_ids"].shape[0])
        return generate(**inputs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_chat_target, "generate", counted_generate)
        prepared = prepare_dataset([path], tmp_path / "out", tokenizer, target=tiny_chat_target, max_length=64,
                                   shard_size=4, max_new_tokens=3, batch_size=4, max_prompt_length=80, limit=5)
    assert batch_sizes == [4, 1]  # not 4 conversations read, 2 answered, then 2, then ...
    assert [example.messages[0]["content"] for example in prepared.examples] == [q for q in questions if q != long]
    assert prepared.skipped == {"prompt longer than the cap": 3}
    record = json.loads((tmp_path / "out" / "shard-00000.record.json").read_text())
    assert record == {"conversations_read": 7, "skipped": {"prompt longer than the cap": 3}}
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert "5/5 [" in [line for line in bar if line.startswith("regenerating")][-1]  # the answered ones, not the read


def test_prepare_grows_a_dataset_with_a_larger_limit(tmp_path, tokenizer, tiny_chat_target):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(f"question {i}?", "answer")}) for i in range(7)))
    output = tmp_path / "prepared"
    options = dict(max_length=64, shard_size=2, max_new_tokens=4, batch_size=4, progress=False)
    first = prepare_dataset([path], output, tokenizer, target=tiny_chat_target, limit=4, **options)
    grown = prepare_dataset([path], output, tokenizer, target=tiny_chat_target, limit=5, **options)
    assert grown.examples[:4] == first.examples and len(grown.examples) == 5 == len(load_dataset(output))
    assert json.loads((output / "manifest.json").read_text())["settings"]["limit"] == 5
    # the last shard now holds 1 of 2 conversations: a larger limit would change it, a smaller one drop shards
    for limit in (None, 3):
        with pytest.raises(ValueError, match="the first 5 conversations: resume with --limit 5"):
            prepare_dataset([path], output, tokenizer, target=tiny_chat_target, limit=limit, **options)


def test_no_usable_conversation_is_an_error_with_the_counts(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match=rf"1 bad JSON line \({path}:1\), 1 empty conversation \({path}:2\)"):
        prepare_dataset([path], tmp_path / "out", tokenizer, progress=False)


def test_load_dataset_without_shards_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        load_dataset(tmp_path)


def test_a_malformed_record_inside_a_json_array_is_skipped_and_the_rest_read(tmp_path):
    records = [json.dumps(sharegpt_record(f"q{i}", f"a{i}")) for i in range(6)]
    records[2] = records[2].replace('"value": "q2"', '"value": "q2",, "x": [1, }')  # broken in the middle
    path = tmp_path / "sharegpt.json"
    path.write_text("[\n" + ",\n".join(records) + "\n]")
    skipped = SkipCounts()
    conversations = list(read_conversations(path, skipped))
    assert conversations == [conversation(f"q{i}", f"a{i}") for i in (0, 1, 3, 4, 5)]
    assert skipped == {"malformed JSON record": 1}


def test_an_input_edited_in_place_is_not_resumed_from_stale_shards(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(f"question {i}?", "answer")}) for i in range(4)))
    output = tmp_path / "prepared"
    options = dict(max_length=64, shard_size=2, progress=False)
    prepare_dataset([path], output, tokenizer, limit=2, **options)
    path.write_text("\n".join(json.dumps({"messages": conversation(f"fixed {i}?", "answer")}) for i in range(4)))
    with pytest.raises(ValueError, match="whose contents have changed since"):
        prepare_dataset([path], output, tokenizer, limit=4, **options)
    assert [e.messages[0]["content"] for e in load_dataset(output)] == ["question 0?", "question 1?"]  # untouched


def test_shards_of_unknown_origin_are_not_reused(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation("question?", "answer")}))
    output = tmp_path / "prepared"
    output.mkdir()
    (output / "shard-00000.jsonl").write_text(json.dumps({"messages": [], "input_ids": [1, 2], "loss_mask": [0, 1]}))
    with pytest.raises(ValueError, match="no manifest.json"):
        prepare_dataset([path], output, tokenizer, progress=False)


def test_data_for_another_target_is_not_resumed(tmp_path, tokenizer, tiny_chat_target):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation("question?", "answer")}))
    output = tmp_path / "prepared"
    options = dict(max_length=64, max_new_tokens=4, batch_size=4, progress=False)
    prepare_dataset([path], output, tokenizer, target=tiny_chat_target, **options)
    other = LlamaForCausalLM(tiny_chat_target.config).eval()  # same shapes and name, other weights
    with pytest.raises(ValueError, match="these differ: target"):
        prepare_dataset([path], output, tokenizer, target=other, **options)


@pytest.mark.parametrize(
    "setting, message",
    [({"limit": 0}, "--limit must be >= 1"), ({"limit": -1}, "--limit must be >= 1"),
     ({"max_length": -5}, "--max-length must be >= 3"), ({"temperature": -1.0}, "--temperature must be >= 0"),
     ({"shard_size": 0}, "--shard-size must be >= 1"), ({"batch_size": 0}, "--batch-size must be >= 1")],
)
def test_settings_that_would_silently_ruin_the_data_are_refused(tmp_path, tokenizer, setting, message):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation("question?", "answer")}))
    with pytest.raises(ValueError, match=message):
        prepare_dataset([path], tmp_path / "out", tokenizer, progress=False, **setting)
    assert not (tmp_path / "out").exists()


def test_limit_keeps_the_first_n_usable_conversations_and_grows_from_where_it_stopped(tmp_path, tokenizer):
    long_question = "How can I help you today? " * 12  # no answer token fits within max_length
    questions = [long_question if i in (1, 4) else f"question {i}?" for i in range(9)]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(q, "answer")}) for q in questions))
    output = tmp_path / "prepared"
    options = dict(max_length=64, shard_size=2, progress=False)
    first = prepare_dataset([path], output, tokenizer, limit=4, **options)
    assert [e.messages[0]["content"] for e in first.examples] == [f"question {i}?" for i in (0, 2, 3, 5)]
    assert first.skipped == {"no assistant token within the length cap": 2}
    assert [len(_read_lines(shard)) for shard in sorted(output.glob("shard-*.jsonl"))] == [2, 2]
    grown = prepare_dataset([path], output, tokenizer, limit=6, **options)
    assert [e.messages[0]["content"] for e in grown.examples] == [f"question {i}?" for i in (0, 2, 3, 5, 6, 7)]
    everything = prepare_dataset([path], tmp_path / "all", tokenizer, **options)
    assert everything.examples == grown.examples + prepare_dataset(
        [path], tmp_path / "tail", tokenizer, **options).examples[6:]


def test_limit_counts_the_conversations_regeneration_keeps(tmp_path, tokenizer, tiny_chat_target):
    questions = ["The quick brown fox jumps over the lazy dog. " * 20] + [f"question {i}?" for i in range(1, 5)]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(q, "answer")}) for q in questions))
    prepared = prepare_dataset([path], tmp_path / "out", tokenizer, target=tiny_chat_target, limit=2, max_length=64,
                               max_prompt_length=80, max_new_tokens=4, batch_size=4, progress=False)
    assert [e.messages[0]["content"] for e in prepared.examples] == ["question 1?", "question 2?"]
    assert prepared.skipped == {"prompt longer than the cap": 1}


def test_the_manifest_records_the_target_the_data_is_for(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation("question?", "answer")}))
    prepare_dataset([path], tmp_path / "named", tokenizer, target_name_or_path="org/Target", progress=False)
    settings = json.loads((tmp_path / "named" / "manifest.json").read_text())["settings"]
    assert settings["target_name_or_path"] == "org/Target" and settings["tokenizer"]["vocab"]
    tokenizer.name_or_path = "/models/Target"
    prepare_dataset([path], tmp_path / "default", tokenizer, progress=False)
    settings = json.loads((tmp_path / "default" / "manifest.json").read_text())["settings"]
    assert settings["target_name_or_path"] == "/models/Target"


def _read_lines(path):
    return path.read_text().splitlines()


def test_regeneration_shows_one_bar_over_the_run_counting_conversations_towards_the_limit(
    tmp_path, tokenizer, tiny_chat_target, capsys
):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conversation(f"question {i}?", "answer")}) for i in range(7)))
    prepare_dataset([path], tmp_path / "out", tokenizer, target=tiny_chat_target, limit=6, max_length=64,
                    shard_size=2, max_new_tokens=4, batch_size=4)  # three shards
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    drawn = [line for line in bar if line.startswith("regenerating")]
    assert drawn[-1].startswith("regenerating: 100%") and "6/6 [" in drawn[-1] and "conversation/s]" in drawn[-1]
    assert not any(line.startswith("regenerating:   0%") for line in drawn[1:])  # never restarts at a shard


def test_a_record_with_invalid_utf8_or_nested_too_deep_is_skipped_and_named_by_file_and_line(tmp_path, target_dir,
                                                                                            capsys):
    lines = [json.dumps(sharegpt_record(f"question {i}", f"answer {i}")).encode() for i in range(10_000)]
    lines[397] = json.dumps(sharegpt_record("caf\u00e9?", "yes"), ensure_ascii=False).encode().replace(
        "\u00e9".encode(), b"\xe9")  # Latin-1 in a UTF-8 file
    lines[4999] = b"[" * 10_000 + b"]" * 10_000
    for suffix, text in ((".jsonl", b"\n".join(lines)), (".json", b"[" + b",\n".join(lines) + b"]")):
        path = tmp_path / f"chat{suffix}"
        path.write_bytes(text)
        skipped = SkipCounts()
        assert len(list(read_conversations(path, skipped))) == 9_998
        assert skipped.summary() == f"1 invalid UTF-8 ({path}:398), 1 record nested too deep ({path}:5000)"
    short = tmp_path / "short.jsonl"  # the same, through the command, on few records
    short.write_bytes(b"\n".join(lines[395:400] + lines[4999:5001]))
    main(["prepare-data", "--input", str(short), "--output", str(tmp_path / "out"), "--target", str(target_dir)])
    assert capsys.readouterr().out.strip().endswith(
        f"5 conversations, {sum(len(e.input_ids) for e in load_dataset(tmp_path / 'out'))} tokens in "
        f"{tmp_path / 'out'}; skipped: 1 invalid UTF-8 ({short}:3), 1 record nested too deep ({short}:6)")


def test_a_record_or_conversation_over_the_stated_size_is_skipped_and_counted(tmp_path, target_dir, capsys):
    turns = [("human", "gpt")[i % 2] for i in range(MAX_MESSAGES + 1)]
    long_conversation = {"conversations": [{"from": role, "value": "hi"} for role in turns]}
    lines = [
        json.dumps(sharegpt_record("kept?", "yes")),
        json.dumps(sharegpt_record("x" * MAX_RECORD_BYTES, "too long to read")),
        json.dumps(long_conversation),
        json.dumps(sharegpt_record("also kept?", "yes")),
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines))
    main(["prepare-data", "--input", str(path), "--output", str(tmp_path / "out"), "--target", str(target_dir)])
    assert capsys.readouterr().out.strip().endswith(
        f"skipped: 1 conversation over {MAX_MESSAGES} messages ({path}:3), 1 record over {MAX_RECORD_BYTES} bytes "
        f"({path}:2)")
    assert [example.messages for example in load_dataset(tmp_path / "out")] == [
        conversation("kept?", "yes"), conversation("also kept?", "yes")]


def test_tokenizing_a_long_conversation_renders_it_a_number_of_times_independent_of_its_length(tokenizer,
                                                                                               monkeypatch):
    rendered = []  # messages rendered by the chat template, call by call
    apply_chat_template = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template",
                        lambda messages, **kwargs: rendered.append(len(messages)) or apply_chat_template(messages,
                                                                                                          **kwargs))
    for turns in (200, 2_000):
        rendered.clear()
        messages = conversation(*(f"turn {i}" for i in range(turns)))
        input_ids, loss_mask = tokenize_conversation(tokenizer, messages, max_length=64)
        assert (input_ids, loss_mask) == tokenize_conversation(tokenizer, messages[:40], max_length=64)
        assert sum(rendered[1:]) < 1_000 and rendered[0] == turns  # the whole conversation once, then its start


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_byte_order_mark_does_not_cost_the_first_record(tmp_path, target_dir, capsys, suffix):
    records = [sharegpt_record(f"question {i}?", f"answer {i}") for i in range(3)]
    text = "\n".join(map(json.dumps, records)) if suffix == ".jsonl" else json.dumps(records)
    path = tmp_path / f"chat{suffix}"
    path.write_text(text, encoding="utf-8-sig")  # as Windows tools save UTF-8
    main(["prepare-data", "--input", str(path), "--output", str(tmp_path / "out"), "--target", str(target_dir)])
    assert "skipped: none" in capsys.readouterr().out
    assert [example.messages[0]["content"] for example in load_dataset(tmp_path / "out")] == [
        "question 0?", "question 1?", "question 2?"]


FILE_SIZE_LIMIT = """
import resource, signal, sys
from hf_eagle3.commands.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
main(sys.argv[1:])
"""


def test_prepare_data_under_a_file_size_limit_names_the_file_and_the_fix(tmp_path, target_dir):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(sharegpt_record(f"question {i}? " * 20, f"answer {i} " * 20))
                              for i in range(100)))
    output = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, "prepare-data", "--input", str(path), "--output",
                             str(output), "--target", str(target_dir), "--shard-size", "50"],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert f"error: Cannot write {output / 'shard-00000.jsonl'} (File too large): free disk space" in result.stderr
    assert not list(output.glob("*.partial"))
