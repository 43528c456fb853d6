"""`hf-eagle3 bench` on a tiny target: every figure of the report, the per-prompt records, mismatch diagnosis."""

import copy
import json

import pytest
import torch

from hf_eagle3.commands.bench import (
    acceptance_by_position,
    bench_markdown,
    cycles_ending_outside_vocabulary,
    first_divergence,
    markdown_table,
    methods_from_names,
    plot_summary,
    run_benchmark,
    save_plots,
    summarise,
    verification_cost_report,
)
from hf_eagle3.decoding.cpu_layout import weight_layout


def test_methods_from_names():
    names = ["plain", "prompt-lookup", "chain", "tree", "tree:3x2x5", "tree+exact", "tree:3x2x5+exact", "auto"]
    methods = methods_from_names(names, 4, 3, 12)
    assert [m.name for m in methods] == names
    fast = {"exact_attention": False}
    assert methods[2].generate_kwargs == {"tree_depth": 4, "tree_top_k": 1, "tree_total_tokens": 4} | fast
    assert methods[4].generate_kwargs == {"tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 5} | fast
    assert methods[5].generate_kwargs == methods[3].generate_kwargs | {"exact_attention": True}
    assert methods[6].generate_kwargs == methods[4].generate_kwargs | {"exact_attention": True}
    assert methods[7].generate_kwargs == {"tree_shape": "auto"} | fast
    assert [m.is_eagle3 for m in methods] == [False, False, True, True, True, True, True, True]
    with pytest.raises(ValueError, match="first method must be `plain`"):
        methods_from_names(["tree", "plain"], 4, 3, 12)
    with pytest.raises(ValueError, match="Unknown method 'beam'"):
        methods_from_names(["plain", "beam"], 4, 3, 12)
    with pytest.raises(ValueError, match="Unknown method 'prompt-lookup\\+exact'"):
        methods_from_names(["plain", "prompt-lookup+exact"], 4, 3, 12)


def test_peer_and_hybrid_method_names():
    methods = methods_from_names(["plain", "compiled", "tree+ngram", "auto-ngram", "tree:3x2x5+ngram+exact"], 4, 3, 12,
                                 max_cache_len=300)
    compiled = methods[1].generate_kwargs
    assert compiled["cache_implementation"] == "static" and compiled["compile_config"]._compile_all_devices
    assert compiled["max_cache_len"] == 300
    assert not methods[1].is_eagle3
    assert methods[2].generate_kwargs == methods_from_names(["plain", "tree"], 4, 3, 12)[1].generate_kwargs | {
        "ngram_candidates": True}
    assert methods[3].generate_kwargs == {"tree_shape": "auto", "exact_attention": False, "ngram_candidates": False}
    assert methods[4].generate_kwargs == {"tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 5,
                                          "exact_attention": True, "ngram_candidates": True}
    auto_compiled = methods_from_names(["plain", "auto+ngram+compiled"], 4, 3, 12, max_cache_len=300)[1]
    assert auto_compiled.is_eagle3 and auto_compiled.generate_kwargs == {
        "tree_shape": "auto", "exact_attention": False, "ngram_candidates": True} | compiled


def test_acceptance_by_position():
    # cycles emitting 1, 2, 3 and 3 tokens: drafted tokens accepted 0, 1, 2, 2
    assert acceptance_by_position([1, 2, 3, 3], 3) == [0.75, 2 / 3, 0.0]
    assert acceptance_by_position([1, 1], 2) == [0.0, None]


def test_a_cycle_counts_as_ending_outside_the_vocabulary_when_its_last_token_cannot_be_drafted():
    drafted = torch.ones(10, dtype=torch.bool)
    drafted[[4, 9]] = False
    # the prefill's token 5; cycles emit [7, 9], [3, 4, 8] and [4]: the first and last end on undraftable tokens
    new_tokens = torch.tensor([5, 7, 9, 3, 4, 8, 4])
    assert cycles_ending_outside_vocabulary(new_tokens, [2, 3, 1], drafted) == 2
    assert cycles_ending_outside_vocabulary(new_tokens[:1], [], drafted) == 0


def test_run_benchmark_reports_every_method_and_writes_records(llama_target, fitted_draft, tmp_path, capsys):
    torch.manual_seed(0)
    prompts = {"set-a": [torch.randint(1, 90, (1, 7)) for _ in range(2)], "set-b": [torch.randint(1, 90, (1, 5))]}
    methods = methods_from_names(["plain", "prompt-lookup", "chain", "tree:3x3x8"], 3, 3, 8)
    records_path = tmp_path / "records.jsonl"
    result = run_benchmark(llama_target, fitted_draft, prompts, methods, max_new_tokens=12, repetitions=2,
                           records_path=records_path)
    progress = capsys.readouterr().err  # the untimed warm-up shows its progress too, then the timed runs
    assert "warm-up (compiles and calibrates, untimed): 100%" in progress and "8/8" in progress
    assert progress.index("warm-up") < progress.index("bench: 100%")

    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    assert len(records) == 3 * 4 and records == json.loads(json.dumps(result["records"]))
    assert all(r["identical_to_plain"] and r["new_tokens"] == 12 for r in records)  # float32: exact
    summary = result["summary"]
    assert list(summary) == ["set-a", "set-b"]
    for entry in summary["set-a"].values():
        assert entry["prompts"] == 2 and entry["speedup"] > 0 and entry["tokens_per_second"] > 0
        assert entry["greedy_mismatches"] == [] and entry["near_tie_mismatches"] == []
    tree = summary["set-a"]["tree:3x3x8"]
    cycles = sum(tree["accepted_length_histogram"].values())
    assert 1 <= tree["tau"] <= 4 and len(tree["n_alpha"]) == 3
    assert sum(n * count for n, count in tree["accepted_length_histogram"].items()) == 2 * 12 - 2  # the prefill
    assert tree["tau"] == pytest.approx((2 * 12 - 2) / cycles)  # token of each prompt comes from no cycle
    assert set(tree["cycle_ms"]) == {"draft", "verify", "other"}
    assert 0 <= tree["ends_outside_vocabulary"] <= 1
    eagle3_records = [r for r in records if "acceptance_lengths" in r]
    assert all(r["ends_outside_vocabulary"] <= len(r["acceptance_lengths"]) for r in eagle3_records)

    table = markdown_table(summary)
    assert table.count("\n") == 2 + 2 * 4 and "| set-a | tree:3x3x8 | 3x3x8 |" in table and "| 0 (0) |" in table
    assert "| set-a | tree:3x3x8 | 3x3x8 | " in table and "x | - | - | " in table  # no prediction for a fixed tree
    save_plots(summary, tmp_path)
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_auto_method_reports_the_calibrated_choice_or_plain_decoding(llama_target, fitted_draft, tmp_path,
                                                                    monkeypatch):
    """`auto` where the calibration finds no tree that pays here: reported as plain decoding, τ 1."""
    from hf_eagle3.decoding.calibration import calibrate

    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path))
    fitted_draft.config.acceptance_profile = [{"tree_depth": 1, "tree_top_k": 1, "tree_total_tokens": 1, "tau": 1.01}]
    fitted_draft.config.tree_shape = "auto"
    calibrate(llama_target, fitted_draft)
    prompts = {"set-a": [torch.randint(1, 90, (1, 7))]}
    result = run_benchmark(llama_target, fitted_draft, prompts, methods_from_names(["plain", "auto"], 3, 3, 8),
                           max_new_tokens=8, repetitions=1, progress=False)
    entry = result["summary"]["set-a"]["auto"]
    assert entry["shapes"] == ["plain"] and entry["tau"] == 1.0 and entry["greedy_mismatches"] == []
    assert "| set-a | auto | plain |" in markdown_table(result["summary"])
    # what the calibration predicted, against what was measured: decoding plainly is predicted 1x
    assert entry["predicted_speedup"] == 1.0 and entry["predicted_speedup_at_measured_tau"] == 1.0
    assert entry["prediction_error"] == pytest.approx(1.0 / entry["speedup"] - 1)


def test_plain_in_another_dtype_decodes_a_copy_of_the_target_and_leaves_the_target_as_it_was(llama_target,
                                                                                              fitted_draft):
    methods = methods_from_names(["plain", "plain:bfloat16", "tree:3x3x8"], 3, 3, 8)
    assert methods[1].dtype == torch.bfloat16 and not methods[1].is_eagle3
    prompts = {"set-a": [torch.randint(1, 90, (1, 7))]}
    result = run_benchmark(llama_target, fitted_draft, prompts, methods, max_new_tokens=8, repetitions=1,
                           progress=False)
    assert llama_target.dtype == torch.float32
    entry = result["summary"]["set-a"]["plain:bfloat16"]
    assert entry["tokens_per_second"] > 0 and "tau" not in entry
    assert result["summary"]["set-a"]["tree:3x3x8"]["greedy_mismatches"] == []  # float32 EAGLE-3: exact
    with pytest.raises(ValueError, match="Unknown method 'plain:int8'"):
        methods_from_names(["plain", "plain:int8"], 3, 3, 8)


def test_first_divergence_measures_both_logit_gaps(llama_target):
    input_ids = torch.randint(1, 90, (1, 6))
    plain = llama_target.generate(input_ids, max_new_tokens=8, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
    runner_up = int(plain.scores[3][0].topk(2).indices[1])
    other = copy.deepcopy(plain)  # a "method" that took the runner-up at step 3, with the same logits
    other.sequences[0, 6 + 3] = runner_up
    divergence = first_divergence(plain, other, prompt_length=6)
    expected_gap = float(plain.scores[3][0].max() - plain.scores[3][0][runner_up])
    assert divergence["position"] == 3 and divergence["token"] == runner_up
    assert divergence["plain_gap"] == pytest.approx(expected_gap) and expected_gap > 0
    assert divergence["method_gap"] == pytest.approx(-expected_gap)
    assert divergence["disagreement"] == pytest.approx(0.0)

    prefix = copy.deepcopy(plain)
    prefix.sequences = plain.sequences[:, :-2]
    stopped = first_divergence(plain, prefix, prompt_length=6)
    assert stopped["position"] == 6 and stopped["disagreement"] is None  # a stopping difference: never a near-tie


def test_plot_shows_labelled_bars_on_integer_axes_from_zero_with_the_settings_in_the_title(llama_target, fitted_draft):
    torch.manual_seed(0)
    prompts = {"set-a": [torch.randint(1, 90, (1, 7))], "set-b": [torch.randint(1, 90, (1, 5))]}
    methods = methods_from_names(["plain", "prompt-lookup", "chain", "tree"], 4, 3, 12)
    result = run_benchmark(llama_target, fitted_draft, prompts, methods, max_new_tokens=16, repetitions=1,
                           progress=False)
    summary = json.loads(json.dumps(result["summary"]))  # as read back from bench.json
    settings = {"machine": "Test CPU (avx2)", "dtype": "float32", "torch_threads": 2, "temperature": 0.0,
                "max_new_tokens": 16, "limit": 1, "repetitions": 1}
    figure = plot_summary(summary, settings)

    assert figure._suptitle.get_text() == (
        "hf-eagle3 bench: Test CPU (avx2), float32, 2 torch threads, greedy, 16 new tokens, the first 1 prompt of "
        "each set, median of 1 interleaved repetitions")
    rows = [figure.axes[3 * row:3 * row + 3] for row in range(2)]
    for (speed, alpha, lengths), set_name in zip(rows, summary):
        # speedup: one labelled bar per method but plain, which is the dashed line at 1
        assert [tick.get_text() for tick in speed.get_xticklabels()] == ["prompt-lookup", "chain (4x1x4)",
                                                                         "tree (4x3x12)"]
        assert [text.get_text() for text in speed.texts if text.get_text().endswith("x")] == [
            f"{summary[set_name][name]['speedup']:.2f}x" for name in ("prompt-lookup", "chain", "tree")]
        # n-α: drafted positions 0..3 as integer ticks, one bar per EAGLE-3 method and position, values on them
        assert [tick.get_text() for tick in alpha.get_xticklabels()] == ["0", "1", "2", "3"]
        assert len(alpha.patches) == 2 * 4 and alpha.get_ylim()[0] == 0
        tree_rates = summary[set_name]["tree"]["n_alpha"]
        assert [text.get_text() for text in alpha.texts][4:] == [
            "-" if rate is None else f"{rate:.2f}" for rate in tree_rates]
        # tokens per target forward: bars from zero at integer lengths, named axes
        emitted = sorted({int(n) for name in ("chain", "tree") for n in summary[set_name][name][
            "accepted_length_histogram"]})
        assert [tick.get_text() for tick in lengths.get_xticklabels()] == [str(n) for n in emitted]
        assert lengths.get_ylim()[0] == 0 and len(lengths.patches) == 2 * len(emitted)
        assert "accepted drafted tokens + 1" in lengths.get_xlabel()
        assert alpha.get_xlabel().startswith("drafted position")
        # a method keeps its colour in every panel
        tree_colour = speed.patches[2].get_facecolor()
        assert alpha.patches[4].get_facecolor() == tree_colour == lengths.patches[len(emitted)].get_facecolor()


def test_verification_cost_is_written_to_the_output_directory(llama_target, tmp_path):
    table = verification_cost_report(llama_target, [1, 4], [2, 4, 6], tmp_path / "results")
    record = json.loads((tmp_path / "results" / "verification-cost.json").read_text())
    seconds = record["seconds"]["standard"]
    assert set(seconds) == {"1", "4"} and all(value > 0 for value in seconds.values())
    assert record["dtype"] == "float32" and record["torch_threads"] >= 1 and record["machine"]
    assert (tmp_path / "results" / "verification-cost.md").read_text() == table
    assert "| 4 |" in table and table.startswith("Measured on ")


def _entry(speedup: float, tokens_per_second: float, n_alpha=None, histogram=None, shape=None) -> dict:
    entry = {"speedup": speedup, "tokens_per_second": tokens_per_second, "prompts": 2, "greedy_mismatches": [],
             "near_tie_mismatches": []}
    if n_alpha is not None:
        entry |= {"tau": 2.0, "n_alpha": n_alpha, "accepted_length_histogram": histogram, "shapes": [shape],
                  "cycle_ms": {"draft": 1.0, "verify": 2.0, "other": 0.5}}
    return entry


# as bench.json holds it: a chain of depth 2 whose cycles of 6 and 7 tokens took a context n-gram branch
SUMMARY = {
    "mt-bench": {"plain": _entry(1.0, 40.0), "chain": _entry(1.3, 52.0, [0.6, 0.4], {"1": 5, "2": 3, "3": 2, "6": 1,
                                                                                       "7": 1}, "2x1x2")},
    "humaneval": {"plain": _entry(1.0, 38.0), "chain": _entry(2.4, 91.0, [0.8, 0.6], {"1": 2, "2": 3, "3": 4, "7": 2},
                                                               "2x1x2")},
}


def test_bench_defaults_to_comparing_auto_the_decoding_generate_uses():
    from hf_eagle3.commands.cli import build_parser

    assert "auto" in build_parser().parse_args(["bench"]).methods


def test_bench_md_says_what_each_column_means_and_how_speedup_differs_from_tokens_per_second():
    report = bench_markdown(SUMMARY, "Test CPU", "float32", 2)
    assert report.startswith("Measured on Test CPU, float32, 2 torch threads.")
    assert "| mt-bench | chain | 2x1x2 | 1.30x | - | - | 52.0 |" in report
    for column in ("tree (DxKxN)", "speedup", "predicted (error)", "at measured τ", "tokens/s", "τ", "n-α",
                   "draft / verify / other ms per cycle",
                   "greedy mismatches (near-ties)"):
        assert f"- **{column}**: " in report
    assert "median over the set's prompts of the method's tokens/s over plain decoding's" in report
    assert "can therefore differ from their speedup" in report


def test_plot_shares_the_speedup_scale_and_marks_the_cycles_only_an_ngram_branch_explains():
    figure = plot_summary(SUMMARY)
    (speed_a, _, lengths_a), (speed_b, _, _) = figure.axes[:3], figure.axes[3:6]
    assert speed_a.get_ylim() == speed_b.get_ylim() and speed_a.get_ylim()[1] > 2.4
    assert not [text for text in speed_a.texts if text.get_text() == "plain"]  # the line is named in the legend
    assert [text.get_text() for text in speed_a.get_legend().get_texts()] == ["plain generate (1x)"]
    # lengths 1 2 3 6 7: depth 2 drafts at most 3 tokens per cycle; 6 and 7 are hatched, and the legend says why
    assert [bool(bar.get_hatch()) for bar in lengths_a.patches] == [False, False, False, True, True]
    assert "longer than the tree: an n-gram branch" in [text.get_text() for text in lengths_a.get_legend().get_texts()]
    assert "only a context n-gram branch" in figure.texts[-1].get_text()


def test_verification_cost_with_the_cpu_layout_tables_every_layout(llama_target, tmp_path):
    target = copy.deepcopy(llama_target)
    table = verification_cost_report(target, [1, 4], [2, 4, 6], tmp_path, compare_layouts=True)
    record = json.loads((tmp_path / "verification-cost.json").read_text())
    layouts = ["standard", "column-major"] + (["onednn"] if torch.backends.mkldnn.is_available() else [])
    assert list(record["seconds"]) == layouts
    assert ("| tokens verified |" + "".join(f" {layout} ms | x 1 token |" for layout in layouts)) in table
    assert weight_layout(target) == "standard"  # left as loaded


def test_a_method_that_ends_its_answer_sooner_is_compared_by_tokens_per_second_not_by_time():
    """In bfloat16 a method can part from plain decoding at a near-tie and stop sooner: half the tokens in half the
    time is plain decoding's speed."""
    methods = methods_from_names(["plain", "prompt-lookup"], 3, 3, 8)
    records = [{"set": "set-a", "prompt": 0, "method": method, "seconds": seconds, "new_tokens": new_tokens,
                "prompt_tokens": 7, "identical_to_plain": method == "plain"}
               for method, seconds, new_tokens in (("plain", 2.0, 8), ("prompt-lookup", 1.0, 4))]
    entry = summarise(records, methods, True)["summary"]["set-a"]["prompt-lookup"]
    assert entry["speedup"] == 1.0 and entry["tokens_per_second"] == 4.0


def test_a_compiled_auto_method_s_prediction_is_checked_against_compiled_plain_decoding():
    from hf_eagle3.decoding.calibration import TreeChoice

    def record(method, seconds, **eagle3):
        fields = {"acceptance_lengths": [1], "shape": "plain", "depth": 1, "prefill_seconds": 0.1,
                  "draft_seconds": 0.0, "verify_seconds": 0.5, "other_seconds": 0.0} if eagle3 else {}
        return {"set": "set-a", "prompt": 0, "method": method, "seconds": seconds, "new_tokens": 8,
                "prompt_tokens": 7, "identical_to_plain": True} | fields

    methods = methods_from_names(["plain", "compiled", "auto+compiled"], 3, 3, 8, max_cache_len=64)
    records = [record("plain", 2.0), record("compiled", 1.0), record("auto+compiled", 1.0, eagle3=True)]
    plainly = {"auto+compiled": TreeChoice(None, 1.0, "decodes plainly", None, [])}  # predicted: as fast as plain
    entry = summarise(records, methods, True, plainly)["summary"]["set-a"]["auto+compiled"]
    assert entry["speedup"] == 2.0 and entry["prediction_baseline"] == "compiled"
    assert entry["measured_speedup_over_path_plain"] == 1.0 and entry["prediction_error"] == 0.0
    assert "1.00x (+0 % against 1.00x over compiled)" in markdown_table({"set-a": {"auto+compiled": entry}})
    without_compiled = summarise(records[::2], methods[::2], True, plainly)["summary"]["set-a"]["auto+compiled"]
    assert "predicted_speedup" not in without_compiled  # nothing on its path to check the prediction against


def test_the_plain_steps_of_a_call_the_online_check_sent_on_plainly_are_not_counted_as_tree_cycles():
    methods = methods_from_names(["plain", "auto"], 3, 3, 8)
    eagle3 = {"acceptance_lengths": [3, 1, 1, 2], "plain_cycles": [1, 2], "shape": "2x4x8", "depth": 2,
              "prefill_seconds": 0.1, "draft_seconds": 0.1, "verify_seconds": 0.3, "other_seconds": 0.0}
    records = [{"set": "set-a", "prompt": 0, "method": method, "seconds": 1.0, "new_tokens": 8, "prompt_tokens": 7,
                "identical_to_plain": True} | (eagle3 if method == "auto" else {}) for method in ("plain", "auto")]
    entry = summarise(records, methods, True)["summary"]["set-a"]["auto"]
    assert entry["tau"] == 2.5 and entry["plain_cycles"] == 2
    assert entry["n_alpha"] == [1.0, 0.5] and entry["accepted_length_histogram"] == {2: 1, 3: 1}
    assert entry["cycle_ms"]["verify"] == pytest.approx(75.0)  # per target forward, the plain steps included
    # the cycles emit tokens 1-7 (0 is the prefill's): the tree cycles end on 3 and 7, the plain ones on 4 and 5
    new_tokens = torch.arange(8)
    drafted = torch.ones(8, dtype=torch.bool)
    drafted[[4, 5]] = False  # the plain steps' tokens
    assert cycles_ending_outside_vocabulary(new_tokens, [3, 1, 1, 2], drafted, [1, 2]) == 0
    assert cycles_ending_outside_vocabulary(new_tokens, [3, 1, 1, 2], drafted) == 2
