"""The EAGLE-3 decoding loop: prefill, then cycles of propose, verify, accept and compact until every row stops.

One cycle: the proposer grows every unfinished row's tree below its last generated token (the root), one draft
forward per tree level for all rows; the target verifies every row's root and tree in one forward, each row with its
own tree attention mask over its visible cache entries and its own positions (`target_attention`), returning the
hidden states the draft fuses; every row's path and bonus token are accepted at once (`verify`), read back to the
host in one transfer (`read_back`: the cycle's only wait for the device, on an accelerator), and the accepted
positions' target features go back to the proposer. Stopping criteria, the n-gram search, positions and lengths are
decided on the host from what was read back; the tensors whose shapes they set are built without waiting. The target's
cache keeps, for every row, its accepted entries, contiguous after the previous prefix; a row that accepted fewer than
the longest leaves unused entries, which its visibility mask hides from then on (the cache grows by the longest
accepted path per cycle; plain decoding over a left-padded batch hides its padding the same way). Finished rows leave
the batch; the output pads them exactly as plain batched decoding does.

Rows stop as plain batched decoding stops them: with an EOS criterion a row that stops is padded with the pad token
until every row has stopped; without one (stop strings or `max_length` only), plain decoding goes on computing the rows
that stopped until the last row stops, so a stopped row decodes on here too, up to the length of the longest row.
"""

import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import StaticCache
from transformers.utils import logging

from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.transformers_api import CACHE, compiles_forwards, crop_cache, pad_token_tensor
from .batch_state import BatchState, Row, Stopping, decoding_rows, keep_cache_entries
from .calibration import correct_calibration
from .compiled import compiled_forward
from .drafter import DraftProposal
from .online import Decision, OnlineCheck
from .proposer import Eagle3Proposer, Emitted, PlainProposer, Verified
from .settings import DecodingSettings, in_blocks
from .static_draft import StaticDraft
from .stats import Eagle3GenerateOutput, Eagle3GenerationStats, Stopwatch
from .target_attention import TargetAttention
from .verify import (
    Acceptance,
    accept_argmax,
    accept_sampling,
    accept_walk,
    greedy_pick,
    node_scores,
    per_row,
    processed_scores,
    proposals_over_target,
    sample,
    sampling_pick,
    scores_every_node,
    stacked,
)

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class Run:
    """What the loop reads, unchanged, for the whole call."""

    model: object
    forward: object  # the target's forward for verification: compiled where `generate` compiles its own
    draft: Eagle3DraftModel
    settings: DecodingSettings
    attention: TargetAttention
    layer_ids: list[int]
    draft_to_target: torch.Tensor  # [V_d] the target id of each draft vocabulary entry
    logits_processor: object
    row_processors: list  # each row's processors, per-row state resolved (`verify.per_row`)
    stopping: Stopping
    temperature: float | None  # sampling temperature; `None` for greedy decoding
    record_cycles: bool
    static_length: int | None  # a static cache's length, which every verification mask spans
    static_draft: StaticDraft | None  # the draft's fixed-shape step, where the forwards are compiled
    batch_size: int
    device: torch.device  # where the loop's tensors live: the prompt's device (a target's layers may be elsewhere)
    streamer: object
    stats: Eagle3GenerationStats
    stopwatch: Stopwatch


def decode(model, draft: Eagle3DraftModel, settings: DecodingSettings, layer_ids: list[int], input_ids: torch.Tensor,
           logits_processor, stopping_criteria, generation_config, streamer, record_greedy_cycles: bool,
           model_kwargs: dict):
    """EAGLE-3 decoding of `input_ids` (`[B, L]`) with the call's prepared `model_kwargs` (a checked target cache);
    the draft reads the target's `hidden_states[i]` for `i` in `layer_ids`. A cycle reads one small tensor back from
    the device (`read_back`); everything else it decides from that on the host, or leaves on the device."""
    online = online_check(settings)
    run = _start(model, draft, settings, layer_ids, input_ids, logits_processor, stopping_criteria, generation_config,
                 streamer, record_greedy_cycles, model_kwargs, measured=online is not None)
    start_time = time.perf_counter()
    rows, state = prefill(run, input_ids, model_kwargs)
    while True:
        cycle_start, split_before = time.perf_counter(), run.stats.split()
        decoding = decoding_rows(rows, state.rows, run.stopping)
        if not decoding:
            break
        state = state.select(decoding)
        proposal = propose(run, state)
        logits, features = verify(run, state, proposal)
        acceptance = accept(run, state, proposal, logits)
        lengths, emitted = read_back(run, state, proposal, acceptance, logits)
        state = compact(run, state, proposal, acceptance, features, lengths, emitted)
        if online is not None:
            online = check_online(run, state, online, run.stats.split_since(cycle_start, split_before), lengths)
    return _finish(run, rows, state, generation_config, start_time)


def _start(model, draft: Eagle3DraftModel, settings: DecodingSettings, layer_ids: list[int], input_ids,
           logits_processor, stopping_criteria, generation_config, streamer, record_greedy_cycles: bool,
           model_kwargs: dict, measured: bool) -> Run:
    batch_size = input_ids.shape[0]
    attention = TargetAttention(model, settings.exact_attention, model_kwargs.get("attention_mask"), batch_size)
    cache, static_length = sized_static_cache(model, model_kwargs[CACHE], generation_config, settings)
    model_kwargs[CACHE] = cache
    # As `_sample` does: the forwards after the prefill compiled where transformers compiles them (a static cache on
    # an accelerator, or `compile_config._compile_all_devices`), one graph per tree size.
    compiled = compiles_forwards(model, model_kwargs, generation_config)
    forward = compiled_forward(model, generation_config.compile_config) if compiled else model
    static_draft = draft_static_step(draft, settings, generation_config) if compiled else None
    draft.attach_target(model)
    do_sample = generation_config.do_sample
    return_dict = generation_config.return_dict_in_generate
    stopping = Stopping(
        criteria=stopping_criteria,
        max_length=generation_config.max_length,
        pad_stopped_rows=any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria),  # as `_sample`
        keep_scores=bool(return_dict and generation_config.output_scores),
        keep_logits=bool(return_dict and generation_config.output_logits),
    )
    stats = Eagle3GenerationStats(settings.tree, shape_choice=settings.shape_choice, choice=settings.choice)
    draft.generation_stats = stats
    return Run(
        model, forward, draft, settings, attention, layer_ids, draft.draft_to_target, logits_processor,
        per_row(logits_processor, batch_size), stopping,
        temperature=(generation_config.temperature or 1.0) if do_sample else None,
        record_cycles=not do_sample and record_greedy_cycles, static_length=static_length, static_draft=static_draft,
        batch_size=batch_size,
        device=input_ids.device, streamer=streamer, stats=stats,
        stopwatch=Stopwatch(stats, input_ids.device, measured=measured),
    )


def prefill(run: Run, input_ids: torch.Tensor, model_kwargs: dict) -> tuple[list[Row], BatchState]:
    """The prompts through the target (what follows the cache's prefix, as plain decoding feeds them), the fed
    visible positions' features through the proposer; each row's first token.

    A cache that already holds a prefix has no features for it: the draft starts at the first fed token, and the
    prefix reaches it through the target's features of the fed tokens (the target attended to it)."""
    with run.stopwatch.time("prefill_seconds"):
        model, length = run.model, input_ids.shape[1]
        cached = int(model_kwargs[CACHE].get_seq_length())
        model_inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=length - cached,
                                                           is_first_iteration=True, **model_kwargs)
        outputs = model(**model_inputs, output_hidden_states=run.layer_ids)
        attention_mask = model_kwargs.get("attention_mask")
        visible = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids).bool()
        key_positions = model_kwargs.get("position_ids")  # [B, L]: positions of the cache entries
        if key_positions is None:
            key_positions = torch.arange(length, device=input_ids.device)[None]
        key_positions = key_positions.expand(run.batch_size, -1)
        next_logits = outputs.logits[:, -1].float().to(run.device)  # [B, V]
        next_scores = run.logits_processor(input_ids, next_logits)
        next_tokens = sample(next_scores.softmax(-1)) if run.temperature is not None else next_scores.argmax(-1)
        features = _features(run, outputs)  # [B, L - cached, 3 k_t]
        followers = torch.cat([input_ids[:, cached + 1 :], next_tokens[:, None]], dim=-1)
        prompts, first_tokens, starts = input_ids.tolist(), next_tokens.tolist(), visible.int().argmax(-1).tolist()
        rows = [Row(index, input_ids[index], prompts[index]) for index in range(run.batch_size)]
        for row in rows:
            row.emit([first_tokens[row.index]], next_tokens[row.index, None], next_scores[row.index, None],
                     next_logits[row.index, None], run.stopping)
        proposer = Eagle3Proposer(run.draft, run.settings.tree, run.temperature, run.settings.ngram_candidates,
                                  [row.host_tokens[start:] for row, start in zip(rows, starts)], run.static_draft)
        proposer.accepted(Verified(key_positions[:, cached:], features, followers, visible[:, cached:]))
    if run.streamer is not None:
        for row in rows:
            run.streamer.put(torch.tensor(row.host_tokens[length:]))
    run.stats.rows = [row.stats for row in rows]
    return rows, BatchState(rows, proposer, model_kwargs[CACHE], visible, key_positions, key_positions[:, -1] + 1)


def _features(run: Run, outputs) -> torch.Tensor:
    """The target features `[b, n, 3 k_t]` the draft reads, on the loop's device (layers may sit on others)."""
    return torch.cat([outputs.hidden_states[i].to(run.device) for i in run.layer_ids], dim=-1)


def propose(run: Run, state: BatchState) -> DraftProposal:
    """Every row's tree below its root."""
    with run.stopwatch.time("draft_seconds"):
        roots = torch.stack([row.tokens[-1] for row in state.rows])
        return state.proposer.propose(roots, state.root_positions)


def verify(run: Run, state: BatchState, proposal: DraftProposal) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over every row's tree: its logits `[b, n, V]` and features `[b, n, 3 k_t]` at the nodes."""
    tree = proposal.tree
    node_positions = state.root_positions[:, None] + tree.depths  # [b, n]
    key_positions = torch.cat([state.key_positions, node_positions], dim=1)
    attends = run.attention.verification_kwargs(tree, state.cache_length)
    with run.stopwatch.time("verify_seconds"):
        outputs = run.forward(
            input_ids=tree.tokens,
            position_ids=node_positions,
            attention_mask=run.attention.verification_mask(tree.ancestors, state.visible, key_positions,
                                                           run.model.dtype, run.static_length),
            **{CACHE: state.cache},
            output_hidden_states=run.layer_ids,
            use_cache=True,
            **attends,
        )
    run.attention.check_verified(run.model, attends)
    run.stats.num_cycles += 1
    return outputs.logits.to(run.device), _features(run, outputs)


def accept(run: Run, state: BatchState, proposal: DraftProposal, logits: torch.Tensor) -> Acceptance:
    """Every row's accepted path and bonus token: decided for all rows at once, over the target's raw logits (in the
    model dtype: argmax is exact) or its processed scores at every node (chains sampled from the draft included);
    node by node where a processor cannot score every node at once (`scores_every_node`)."""
    tree, keep_scores, processors = proposal.tree, run.stopping.keep_scores, run.logits_processor
    if run.temperature is None and len(processors) == 0:
        return accept_argmax(tree, logits, keep_scores)
    if scores_every_node(run.row_processors[0]):
        scores = node_scores([run.row_processors[row.index] for row in state.rows], [row.tokens for row in state.rows],
                             tree, logits)
        if run.temperature is None:
            return accept_argmax(tree, scores, keep_scores)
        proposals = None if proposal.sampled is None else proposals_over_target(
            proposal.draft_probs.to(scores.dtype), run.draft_to_target, scores.shape[-1])
        return accept_sampling(tree, scores, keep_scores, proposals, proposal.sampled)
    walks = []
    for index, row in enumerate(state.rows):
        row_tree = tree.row(index)
        scores_after = processed_scores(processors, row.tokens[None], row_tree, logits[index], row.index,
                                        run.batch_size)
        pick = (greedy_pick(row_tree) if run.temperature is None else
                sampling_pick(row_tree, None if proposal.draft_probs is None else proposal.draft_probs[index],
                              None if proposal.sampled is None else proposal.sampled[index], run.draft_to_target))
        walks.append(accept_walk(row_tree, scores_after, pick))
    return stacked(walks, tree.max_depth + 1)


def read_back(run: Run, state: BatchState, proposal: DraftProposal, acceptance: Acceptance,
              logits: torch.Tensor) -> tuple[list[int], Emitted]:
    """The cycle's one read from the device: each row's accepted length and tokens, and its continuation's kept and
    accepted tokens. Each row records the cycle and appends its tokens up to where the stopping criteria hold; the
    streamer receives what they kept. Returns every row's accepted length and what it emitted."""
    tree, continuation = proposal.tree, proposal.continuation_nodes
    on_path = (acceptance.path[:, :, None] == torch.arange(tree.num_nodes, device=run.device)).any(1)  # [b, n]
    continuation_accepted = (on_path.gather(1, continuation) & (continuation > 0)).sum(-1)
    packed = torch.cat([acceptance.lengths[:, None], (continuation > 0).sum(-1)[:, None],
                        continuation_accepted[:, None], acceptance.tokens], dim=1).tolist()
    lengths = [values[0] for values in packed]
    logits = logits.gather(1, acceptance.path[..., None].expand(-1, -1, logits.shape[-1])).float() \
        if run.stopping.keep_logits else None
    plain, emitted = tree.num_nodes == 1, []
    for index, (row, values) in enumerate(zip(state.rows, packed)):
        length = values[0]
        cycle = (tree.row(index), acceptance.path[index, :length]) if run.record_cycles else None
        row.record(length, values[2], plain, cycle)
        emitted.append(row.emit(values[3 : 3 + length], acceptance.tokens[index],
                                None if acceptance.scores is None else acceptance.scores[index],
                                None if logits is None else logits[index], run.stopping))
        if run.streamer is not None:
            run.streamer.put(torch.tensor(emitted[-1]))
    return lengths, Emitted(emitted, [values[1] for values in packed], [values[2] for values in packed])


def compact(run: Run, state: BatchState, proposal: DraftProposal, acceptance: Acceptance, features: torch.Tensor,
            lengths: list[int], emitted: Emitted) -> BatchState:
    """The accepted positions' features go to the proposer; each row keeps its accepted cache entries, and rows that
    accepted fewer leave entries their mask hides from now on."""
    longest = max(lengths)
    path, offsets = acceptance.path[:, :longest], torch.arange(longest, device=run.device)
    verified = Verified(state.root_positions[:, None] + offsets,
                        features.gather(1, path[..., None].expand(-1, -1, features.shape[-1])),
                        acceptance.tokens[:, :longest], offsets[None] < acceptance.lengths[:, None])
    with run.stopwatch.time("draft_seconds"):
        state.proposer.accepted(verified, emitted)
    keep_cache_entries(state.cache, state.cache_length, path, state.cache_length + proposal.tree.num_nodes)
    return state.advance(acceptance.lengths, longest)


def online_check(settings: DecodingSettings) -> OnlineCheck | None:
    """The check of a shape the calibration chose (`tree_shape="auto"`) against the call's own speed; `None` for a
    shape the call fixed."""
    choice = settings.choice
    if choice is None or choice.prediction is None:
        return None
    return OnlineCheck(choice.plain_step, choice.prediction.cycle_seconds)


def check_online(run: Run, state: BatchState, online: OnlineCheck, part_seconds: dict[str, float],
                 lengths: list[int]) -> OnlineCheck | None:
    """Count the cycle (its parts' seconds). Once the cycles cost other than predicted, or the call's speed falls short
    of plain decoding's calibrated speed, every row decodes plainly for a trial (its proposer paused, kept current);
    after it, the record is corrected toward what the call measured, and every row goes on with the faster of the
    two; decoding plainly, it tries the tree again now and then (`online`). Returns the check while it goes on, `None`
    once the call keeps the tree to its end."""
    tokens = sum(lengths) / len(lengths)
    before = online.decision
    decision = online.observe(part_seconds, tokens)
    if decision is before and not online.settled:
        return online
    if before is Decision.KEEP and decision is Decision.TRIAL:
        why = (f"its cycles cost {1000 * online.measured_cycle:.1f} ms here, not {1000 * online.predicted_cycle:.1f} ms"
               if online.costs_disproved else f"it ran at {online.speedup:.2f}x plain decoding's calibrated speed")
        run.stats.shape_choice += (f"; {why} after {online.cycles} cycles, so it decoded plainly for "
                                   f"{online.min_cycles + 1} cycles to measure plain decoding here")
        _pause(state)
        return online
    if before is Decision.PLAIN:  # a retry starts: the draft catches up on the tokens decoded plainly
        _resume(run, state)
        return online
    if before is Decision.TRIAL:
        _note_trial(run, online)
    else:
        run.stats.shape_choice += (f"; the tree tried again ({online.retries}), its tokens came "
                                   f"{online.measured_speedup:.2f}x as fast as plain decoding's")
    if decision is Decision.KEEP:
        run.stats.shape_choice += ", so it went back to the tree"
        if before is Decision.TRIAL:
            _resume(run, state)
        return None
    run.stats.shape_choice += f", so it went on plainly (trying the tree again after {online.retry_after} tokens)"
    logger.warning_once(f"{run.settings.shape_choice}; slower than plain decoding in a call, which went on plainly "
                        "(its statistics' shape_choice says by how much)")
    if before is Decision.KEEP:
        _pause(state)
    return online


def _note_trial(run: Run, online: OnlineCheck) -> None:
    """What the trial measured, in the call's statistics, and the record corrected toward it."""
    choice = run.settings.choice
    corrected = correct_calibration(choice, online.measured_cycle, online.measured_plain_step)
    run.stats.shape_choice += (f"; plain decoding took {1000 * online.measured_plain_step:.1f} ms a token here, the "
                               f"tree's tokens {online.measured_speedup:.2f}x as fast")
    if corrected is not None:
        old, new = choice.costs, corrected
        run.stats.shape_choice += (
            f" (the cached costs corrected halfway toward this call's: the machine's speed {old.speed_scale:.2f} -> "
            f"{new.speed_scale:.2f}, the cycles against plain decoding {old.cycle_scale:.2f} -> {new.cycle_scale:.2f})")


def _pause(state: BatchState) -> None:
    """Every row decodes plainly, the proposer paused (told later what the target verified meanwhile)."""
    state.proposer = PlainProposer(paused=state.proposer)


def _resume(run: Run, state: BatchState) -> None:
    """The paused proposer back, caught up on what the target verified meanwhile."""
    with run.stopwatch.time("draft_seconds"):
        state.proposer = state.proposer.resumed()


def _finish(run: Run, rows: list[Row], state: BatchState, generation_config, start_time: float):
    cache = state.cache
    if run.batch_size == 1:  # a cycle cut short by a stop leaves entries past the last kept token: plain has none
        crop_cache(cache, min(0, len(rows[0].host_tokens) - 1 - state.cache_length))
    if run.streamer is not None:
        run.streamer.end()
    final_length = max(row.stop_length for row in rows)
    pad_token = pad_token_tensor(generation_config)  # what `_sample` pads stopped rows with
    sequences = torch.stack([_right_padded(row.tokens[:final_length], final_length, pad_token) for row in rows])
    run.stopwatch.finish()
    run.stats.total_seconds = time.perf_counter() - start_time
    if not generation_config.return_dict_in_generate:
        return sequences
    return Eagle3GenerateOutput(
        sequences=sequences,
        scores=tuple(rows[0].scores) if run.stopping.keep_scores else None,
        logits=tuple(rows[0].logits) if run.stopping.keep_logits else None,
        **{CACHE: cache if run.batch_size == 1 else None},
        eagle3_stats=run.stats,
    )


def _right_padded(tokens: torch.Tensor, length: int, pad_token: torch.Tensor | None) -> torch.Tensor:
    if tokens.numel() == length:
        return tokens
    return torch.cat([tokens, pad_token.to(tokens).expand(length - tokens.numel())])


def draft_static_step(draft: Eagle3DraftModel, settings: DecodingSettings, generation_config) -> StaticDraft | None:
    """The draft's fixed-shape step for a call whose forwards are compiled, compiled as the target's verification: a
    static cache for `max_length` tokens and a tree after them (in blocks, as the target's), each cycle fed padded to
    the longest accepted path and its bonus token (`static_draft`). `None` for a draft with sliding-window layers,
    which drafts eagerly: its window mask reads the draft cache's length on the host."""
    if draft.config.sliding_window is not None:
        logger.warning_once("A draft with sliding-window layers drafts eagerly on the compiled path (its window mask "
                            "reads the draft cache's length on the host): only the target's verification is compiled.")
        return None
    tree, continuation = settings.tree, draft.config.ngram_max_tokens if settings.ngram_candidates else 0
    width = min(max(tree.depth, continuation), tree.total_tokens) + 1
    length = in_blocks(generation_config.max_length + max(width, (tree.depth - 1) * tree.top_k))
    return StaticDraft(compiled_forward(draft, generation_config.compile_config), length, width)


def sized_static_cache(model, cache, generation_config, settings: DecodingSettings):
    """`(cache, key_length)`: a static cache of the call's length (`settings.static_length`), and that length (what
    every verification mask spans); a dynamic cache as it is, with `None`. A static cache too short is replaced while
    empty and refused once filled."""
    if type(cache) is not StaticCache:
        return cache, None
    if settings.exact_attention:
        raise ValueError("exact_attention=True verifies node by node over a dynamic cache: drop "
                         "cache_implementation='static', or drop exact_attention.")
    needed = generation_config.max_length + settings.tree.total_tokens  # a whole tree after max_length - 1 tokens
    if cache.layers[0].max_cache_len < needed and cache.get_seq_length():
        raise ValueError(f"EAGLE-3 decoding into this static cache needs room for {needed} tokens (max_length "
                         f"plus the tree's {settings.tree.total_tokens}): pass a StaticCache of max_cache_len >= "
                         f"{needed}.")
    if cache.layers[0].max_cache_len != settings.static_length:
        cache = StaticCache(config=model.config, max_cache_len=settings.static_length)
    return cache, settings.static_length
