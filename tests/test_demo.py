"""`hf-eagle3 demo`: representative prompts (the sets the README reports), and in reduced precision where, by how
many tokens and at what logit gap an output parts from plain decoding."""

import copy

import pytest
import torch

from hf_eagle3.commands.cli import build_parser, main
from hf_eagle3.commands.demo import (
    DEMO_PROMPTS_PER_SET,
    _calibrated_cycle_ms,
    _comparison,
    _describe_comparison,
    _fastest_plain_by_set,
    _median_split,
    demo_prompts,
)
from hf_eagle3.decoding.calibration import MachineCosts
from hf_eagle3.decoding.drafter import TreeSettings
from hf_eagle3.resources.prompts import calibration_prompts, humaneval_prompts, mt_bench_first_turns, mt_bench_questions


def test_the_demo_prompts_cover_every_mt_bench_category_and_spread_over_humaneval():
    prompts = demo_prompts()
    assert [prompt_set for prompt_set, _ in prompts] == ["mt-bench"] * DEMO_PROMPTS_PER_SET + [
        "humaneval"] * DEMO_PROMPTS_PER_SET
    questions = {question["turns"][0]: question["category"] for question in mt_bench_questions()}
    assert len({questions[text] for prompt_set, text in prompts if prompt_set == "mt-bench"}) == 8
    assert [humaneval_prompts().index(text) for prompt_set, text in prompts if prompt_set == "humaneval"] == list(
        range(0, 160, 20))


def test_the_calibration_prompts_are_spread_over_both_sets_and_none_the_demo_or_benchmark_uses():
    calibration = calibration_prompts()
    questions = {question["turns"][0]: question["category"] for question in mt_bench_questions()}
    categories = sorted(questions[text] for text in calibration if text in questions)
    assert categories == sorted([*set(questions.values())] * 2)
    assert len(calibration) == 32
    benchmark = mt_bench_first_turns()[:8] + humaneval_prompts()[:8]
    assert not set(calibration) & (set(benchmark) | {text for _, text in demo_prompts()})
    args = build_parser().parse_args(["demo"])
    assert (args.prompts_per_set, args.max_new_tokens, args.repetitions, args.cpu_layout) == (8, 64, 2, True)
    assert not build_parser().parse_args(["demo", "--no-cpu-layout"]).cpu_layout


def test_an_output_that_parts_from_plain_says_where_how_many_tokens_differ_and_the_gap(llama_target):
    input_ids = torch.randint(1, 90, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = llama_target.generate(input_ids, max_new_tokens=10, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
    assert _comparison(plain, copy.deepcopy(plain), 6, torch.bfloat16) == {"identical": True}
    parted = copy.deepcopy(plain)  # a decoding that took the runner-up at token 4 (index 3), with the same logits
    runner_up = int(plain.scores[3][0].topk(2).indices[1])
    parted.sequences[0, 6 + 3] = runner_up
    comparison = _comparison(plain, parted, 6, torch.bfloat16)
    assert comparison["position"] == 3 and comparison["differing_tokens"] == 7
    assert comparison["near_tie"] and comparison["disagreement"] == pytest.approx(0.0) and comparison["plain_gap"] > 0
    described = _describe_comparison(comparison, "bfloat16")
    assert "at token 4 (7 tokens differ from there)" in described and "(a near-tie)" in described
    scores = list(parted.scores)
    scores[3] = scores[3].clone()
    scores[3][0, runner_up] += 5.0  # a decoding that preferred its token by far: no near-tie, a bug
    parted.scores = tuple(scores)
    assert "NOT a near-tie" in _describe_comparison(_comparison(plain, parted, 6, torch.bfloat16), "bfloat16")


def test_the_demo_compares_each_part_of_a_cycle_with_the_calibration_of_the_shape_the_call_used():
    costs = MachineCosts(machine="cpu", plain_step=0.05, verify={9: 0.07, 17: 0.09}, draft={(2, 8): 0.009},
                         other=0.003)
    assert _calibrated_cycle_ms(costs, TreeSettings(2, 8, 16)) == pytest.approx(
        {"draft": 9.0, "verify": 90.0, "other": 3.0})
    assert _calibrated_cycle_ms(costs, None) is None  # the call decoded plainly
    assert _median_split([None, {"draft": 1, "verify": 5, "other": 1}, {"draft": 3, "verify": 7, "other": 2},
                          {"draft": 2, "verify": 6, "other": 9}]) == {"draft": 2, "verify": 6, "other": 2}
    assert _median_split([None]) is None


def test_each_prompt_set_is_compared_with_its_own_fastest_plain_decoding():
    # without bf16 units, bfloat16 decodes short chat prompts faster and prefills long code prompts slower
    runs = [{"set": "mt-bench", "plain_tokens_per_second": {"float32": 13.8, "bfloat16": 16.2}},
            {"set": "mt-bench", "plain_tokens_per_second": {"float32": 14.0, "bfloat16": 15.8}},
            {"set": "mt-bench", "plain_tokens_per_second": {"float32": 12.7, "bfloat16": 9.6}},
            {"set": "humaneval", "plain_tokens_per_second": {"float32": 13.5, "bfloat16": 10.8}},
            {"set": "humaneval", "plain_tokens_per_second": {"float32": 12.5, "bfloat16": 8.5}}]
    assert _fastest_plain_by_set(runs) == {"mt-bench": "bfloat16", "humaneval": "float32"}


@pytest.mark.slow  # the real target and draft, calibrated (about a minute on a 2-core machine)
def test_the_demo_runs_from_the_calibration_to_the_speedup_line_against_each_set_s_fastest_plain_decoding(
        own_cache, capsys):  # its calibration record stays out of the user's cache
    main(["demo", "--prompts-per-set", "1", "--max-new-tokens", "8", "--repetitions", "1", "--dtype", "float32",
          "--threads", "1"])
    printed = capsys.readouterr().out.splitlines()
    assert "calibration (measured here, cached; τ from the draft's acceptance profile):" in printed
    assert [line.split(":")[0] for line in printed if line.startswith("prompt ")] == ["prompt 1 (mt-bench)",
                                                                                      "prompt 2 (humaneval)"]
    speedup_line = next(line for line in printed if line.startswith(
        ("speedup over the fastest plain decoding of each prompt's set here", "EAGLE-3 decoded plainly here")))
    assert "mt-bench " in speedup_line and "humaneval " in speedup_line and "x over plain float32" in speedup_line
