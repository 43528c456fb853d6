"""Runs in vLLM's own virtualenv (`tests/engines/run.py` makes it): greedy decoding of the prompts in a job file,
plainly or with an EAGLE-3 draft, one prompt at a time; prints one line, `RESULT` and JSON, with the tokens, the seconds
and vLLM's own speculative-decoding counters.

    python vllm_side.py JOB.json plain|eagle3
"""

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

RESULT = "vllm_side result: "  # the line holding the result: vLLM logs to stdout too, also while it shuts down


def main(job_file: str, method: str) -> None:
    job = json.loads(open(job_file).read())
    speculative = None
    if method == "eagle3":
        speculative = {"method": "eagle3", "model": job["draft"], "num_speculative_tokens": job["k"]}
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, speculative_config=speculative,
              disable_log_stats=False, max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params, use_tqdm=False)  # warm-up
    before = _counters(llm)
    tokens, seconds = [], []
    for prompt in job["prompts"]:
        start = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - start)
        tokens.append(list(output.outputs[0].token_ids))
    after = _counters(llm)
    counters = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    print(RESULT + json.dumps({"tokens": tokens, "seconds": seconds, "counters": counters}), flush=True)


def _counters(llm: LLM) -> dict[str, float]:
    """vLLM's speculative-decoding counters (`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`, ...)."""
    return {metric.name: metric.value for metric in llm.get_metrics()
            if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value")}


if __name__ == "__main__":
    main(*sys.argv[1:])
