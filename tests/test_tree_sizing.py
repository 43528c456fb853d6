"""Tree sizing: smaller trees' acceptance read off the largest tree's run (exact, checked against building them),
measured costs, the acceptance profile and `tune_tree` on a tiny target."""

import statistics
from dataclasses import replace

import pytest
import torch
from helpers import VOCAB, greedy_path, tiny_draft
from safetensors import safe_open

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.commands import cli
from hf_eagle3.commands.tune_tree import save_tuned_draft, tune_tree
from hf_eagle3.decoding.calibration import drafting_cost, verification_cost
from hf_eagle3.decoding.drafter import TreeSettings
from hf_eagle3.decoding.tree import build_tree, expand, select_frontier
from hf_eagle3.resources.loading import stored_dtype
from hf_eagle3.training.profile import acceptance_profile, accepted_in_smaller_trees


def _random_candidates(top_k: int, max_depth: int, vocab: int):
    """Candidates grown as the drafter grows them, from random draft distributions."""
    scores, ids = expand(torch.randn(1, vocab).log_softmax(-1), torch.zeros(1), top_k)
    tokens, all_scores = [ids[0]], [scores[0]]
    parents, depths = [torch.full((top_k,), -1)], [torch.ones(top_k, dtype=torch.long)]
    frontier, frontier_scores, count = torch.arange(top_k), scores[0], top_k
    for depth in range(2, max_depth + 1):
        child_scores, child_ids = expand(torch.randn(top_k, vocab).log_softmax(-1), frontier_scores, top_k)
        tokens.append(child_ids.flatten())
        all_scores.append(child_scores.flatten())
        parents.append(frontier.repeat_interleave(top_k))
        depths.append(torch.full((top_k * top_k,), depth))
        best = select_frontier(child_scores, top_k)
        frontier, frontier_scores, count = count + best, child_scores.flatten()[best], count + top_k * top_k
    return torch.cat(tokens), torch.cat(all_scores), torch.cat(parents), torch.cat(depths)


def _target_choices(tokens, parents, vocab: int):
    """The target's greedy token after the root (index 0) and after each candidate (index c + 1): mostly one of the
    node's two best drafted children, so that paths get accepted, otherwise a token never drafted."""
    choices = torch.randint(vocab, vocab + 5, (tokens.numel() + 1,))
    for parent in range(-1, tokens.numel()):
        children = (parents == parent).nonzero().flatten()
        if children.numel() and torch.rand(()) < 0.8:
            choices[parent + 1] = tokens[children[torch.randint(min(2, children.numel()), ())]]
    return choices


@pytest.mark.parametrize("seed", range(20))
def test_smaller_trees_accept_what_building_them_accepts(seed):
    torch.manual_seed(seed)
    top_k, max_depth, max_total, vocab = 3, 5, 30, 6
    tokens, scores, parents, depths = _random_candidates(top_k, max_depth, vocab)
    choices = _target_choices(tokens, parents, vocab)

    def accepted_path(depth: int, total: int):
        kept = depths <= depth  # candidates are numbered depth by depth: a prefix
        tree = build_tree(torch.tensor(0), tokens[kept], scores[kept], parents[kept], depths[kept], total)
        path = greedy_path(tree, torch.cat([choices[:1], choices[1:][tree.candidate_ids]]))
        return tree, path

    largest, path = accepted_path(max_depth, max_total)
    depth_grid, total_grid = torch.arange(1, max_depth + 1), torch.tensor([1, 2, 3, 5, 8, 12, 20, 30])
    table = accepted_in_smaller_trees(largest.candidate_rank_keys, largest.candidate_depths,
                                      largest.candidate_ids[path[1:] - 1], depth_grid, total_grid)
    for a, depth in enumerate(depth_grid.tolist()):
        for b, total in enumerate(total_grid.tolist()):
            assert table[a, b] == accepted_path(depth, total)[1].numel() - 1, (depth, total)


def test_costs_are_measured_for_every_size(llama_target, fitted_draft):
    costs = verification_cost(llama_target, [1, 4, 8], prefix_length=16, repetitions=2)
    assert list(costs) == [1, 4, 8] and all(seconds > 0 for seconds in costs.values())
    fitted_draft.attach_target_embedding(llama_target.get_input_embeddings())
    shapes = [TreeSettings(1, 3, 3), TreeSettings(4, 3, 8), TreeSettings(4, 1, 4)]
    draft_costs = drafting_cost(fitted_draft, shapes, prefix_length=16, repetitions=2)
    assert list(draft_costs) == shapes and all(seconds > 0 for seconds in draft_costs.values())


def test_acceptance_profile_matches_the_largest_run(llama_target, fitted_draft):
    torch.manual_seed(0)
    prompts = [torch.randint(1, 90, (1, 6)) for _ in range(2)]
    rows = acceptance_profile(llama_target, fitted_draft, prompts, top_ks=[1, 3], max_depth=3, max_total=8,
                              max_new_tokens=16, progress=False)
    shapes = {(row["tree_top_k"], row["tree_depth"], row["tree_total_tokens"]): row["tau"] for row in rows}
    assert (3, 1, 4) not in shapes and (1, 3, 3) in shapes and (1, 3, 4) not in shapes  # no more nodes than candidates
    for top_k, total in ((3, 8), (1, 3)):  # the largest tree of each top-k: its τ is the measured one
        lengths = []
        for input_ids in prompts:
            llama_target.generate(input_ids, max_new_tokens=16, do_sample=False, assistant_model=fitted_draft,
                                  tree_depth=3, tree_top_k=top_k, tree_total_tokens=total)
            lengths += fitted_draft.generation_stats.acceptance_lengths
        assert shapes[(top_k, 3, total)] == pytest.approx(sum(lengths) / len(lengths), abs=1e-4)
    assert shapes[(3, 3, 8)] > shapes[(3, 1, 1)] >= 1.0


def test_a_profile_of_prompts_from_several_sets_holds_each_set_s_median_prompt_s_tau(llama_target, fitted_draft):
    torch.manual_seed(1)
    prompts = [torch.randint(1, 90, (1, 6)) for _ in range(3)] + [torch.randint(1, 90, (1, 5)).repeat(1, 3)]
    sets = ["chat", "chat", "code", "code"]
    rows = acceptance_profile(llama_target, fitted_draft, prompts, top_ks=[2], max_depth=2, max_total=6,
                              max_new_tokens=16, progress=False, prompt_sets=sets)
    largest = next(row for row in rows if (row["tree_depth"], row["tree_total_tokens"]) == (2, 6))
    lengths, prompt_taus = {"chat": [], "code": []}, {"chat": [], "code": []}
    for input_ids, name in zip(prompts, sets):
        llama_target.generate(input_ids, max_new_tokens=16, do_sample=False, assistant_model=fitted_draft,
                              tree_depth=2, tree_top_k=2, tree_total_tokens=6)
        prompt_lengths = fitted_draft.generation_stats.acceptance_lengths
        lengths[name] += prompt_lengths
        prompt_taus[name].append(sum(prompt_lengths) / len(prompt_lengths))
    # each set's τ is its median prompt's (of two: their mean), the row's pools every cycle
    assert largest["tau_by_set"] == pytest.approx({name: statistics.median(taus) for name, taus in
                                                   prompt_taus.items()}, abs=1e-4)
    everything = lengths["chat"] + lengths["code"]
    assert largest["tau"] == pytest.approx(sum(everything) / len(everything), abs=1e-4)
    assert all(set(row["tau_by_set"]) == {"chat", "code"} for row in rows)
    one_set = acceptance_profile(llama_target, fitted_draft, prompts[:2], top_ks=[2], max_depth=2, max_total=6,
                                 max_new_tokens=16, progress=False, prompt_sets=["chat", "chat"])
    assert all("tau_by_set" not in row for row in one_set)  # one set: its τ is the row's
    with pytest.raises(ValueError, match="one set name per prompt"):
        acceptance_profile(llama_target, fitted_draft, prompts, top_ks=[2], max_depth=2, max_total=6,
                           max_new_tokens=16, progress=False, prompt_sets=["chat"])


def test_tune_tree_ranks_every_profiled_shape_by_predicted_speed(llama_target, fitted_draft):
    prompts = [torch.randint(1, 90, (1, 6)) for _ in range(2)]
    profile, predictions, costs = tune_tree(llama_target, fitted_draft, prompts, top_ks=[1, 3], max_depth=2,
                                            max_total=4, max_new_tokens=12, progress=False)
    speeds = [prediction.tokens_per_second for prediction in predictions]
    assert speeds == sorted(speeds, reverse=True) and len(predictions) == len(profile)
    assert costs.plain_step > 0 and costs.other >= 0
    assert set(costs.verify) == {1} | {prediction.settings.total_tokens + 1 for prediction in predictions}


def test_a_profile_with_context_ngram_candidates_matches_its_largest_run(llama_target, fitted_draft):
    torch.manual_seed(0)
    prompts = [torch.randint(1, 90, (1, 5)).repeat(1, 3) for _ in range(2)]  # repeats: continuations are found
    rows = acceptance_profile(llama_target, fitted_draft, prompts, top_ks=[2], max_depth=2, max_total=6,
                              max_new_tokens=16, progress=False, ngram_candidates=True)
    assert all(row["ngram_candidates"] is True for row in rows)
    shapes = {(row["tree_depth"], row["tree_total_tokens"]): row["tau"] for row in rows}
    lengths = []
    for input_ids in prompts:
        llama_target.generate(input_ids, max_new_tokens=16, do_sample=False, assistant_model=fitted_draft,
                              tree_depth=2, tree_top_k=2, tree_total_tokens=6, ngram_candidates=True)
        lengths += fitted_draft.generation_stats.acceptance_lengths
    assert shapes[(2, 6)] == pytest.approx(sum(lengths) / len(lengths), abs=1e-4)
    assert shapes[(2, 6)] >= shapes[(1, 2)] >= 1.0


def test_a_tuned_draft_is_saved_in_its_stored_dtype_and_never_with_a_default_slower_than_plain(
        llama_target, tmp_path, capsys):
    stored = tmp_path / "stored"
    tiny_draft(draft_vocab_size=VOCAB).to(torch.bfloat16).save_pretrained(stored)
    draft = Eagle3DraftModel.from_pretrained(stored, dtype=torch.float32)  # tune-tree measures in --dtype
    prompts = [torch.randint(1, 90, (1, 6)) for _ in range(2)]
    profile, predictions, costs = tune_tree(llama_target, draft, prompts, top_ks=[1, 3], max_depth=2, max_total=4,
                                            max_new_tokens=12, progress=False)
    best = predictions[0]

    def machine_where_the_best_shape_runs_at(speedup):  # the measured costs, with plain decoding as fast as that
        return replace(costs, plain_step=speedup / best.tokens_per_second)

    message = save_tuned_draft(draft, profile, predictions, machine_where_the_best_shape_runs_at(0.9),
                               tmp_path / "tuned", stored_dtype(str(stored)))
    assert "warning: no tree shape is predicted to beat plain decoding on this machine by 5% (the fastest" in (
        capsys.readouterr().out)
    assert message.startswith("saved the draft (bfloat16)") and "the fixed tree defaults stay 4x3x12" in message
    assert tensor_dtypes(tmp_path / "tuned") == tensor_dtypes(stored)  # every tensor as stored: bf16 weights
    assert "BF16" in tensor_dtypes(stored).values()
    assert (tmp_path / "tuned" / "model.safetensors").stat().st_size <= 1.05 * (
        stored / "model.safetensors").stat().st_size
    tuned = Eagle3DraftModel.from_pretrained(tmp_path / "tuned")
    assert tuned.config.acceptance_profile == profile and tuned.config.tree_shape == "auto"
    assert (tuned.config.tree_depth, tuned.config.tree_top_k, tuned.config.tree_total_tokens) == (4, 3, 12)

    message = save_tuned_draft(draft, profile, predictions, machine_where_the_best_shape_runs_at(1.5),
                               tmp_path / "pays", stored_dtype(str(stored)))
    assert "warning" not in capsys.readouterr().out and "the fixed tree defaults are this machine's best" in message
    tuned = Eagle3DraftModel.from_pretrained(tmp_path / "pays")
    shape = best.settings
    assert (tuned.config.tree_depth, tuned.config.tree_top_k, tuned.config.tree_total_tokens) == (
        shape.depth, shape.top_k, shape.total_tokens)


def tensor_dtypes(directory):
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        return {name: file.get_slice(name).get_dtype() for name in file.keys()}


def test_tune_tree_save_to_an_existing_file_is_refused_naming_it_before_measuring(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(SystemExit, match=f"--save-to {notes} is a file: the draft is saved as a folder"):
        cli.main(["tune-tree", "--save-to", str(notes)])
    assert notes.read_text() == "mine"


def test_tune_tree_refuses_to_choose_a_shape_from_no_prompts(llama_target, fitted_draft, capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune-tree", "--limit", "0"])
    assert "argument --limit: 0 is out of range: allowed 1 to " in capsys.readouterr().err
    with pytest.raises(ValueError, match="No prompts to measure the acceptance profile on"):  # an empty prompt file
        tune_tree(llama_target, fitted_draft, [], top_ks=[1], max_depth=1, max_total=1, progress=False)
