"""Runs in vLLM's own virtualenv (`make engines` builds it): greedy decoding in float32, plainly or with an EAGLE-3
draft drafting a chain, one prompt a request (`protocol.py`). Settings: `target` and `draft` (folders; `draft` null
for plain decoding) and `k`, the chain's length.

    python vllm_side.py '{"target": DIR, "draft": DIR, "k": 3}'
"""

import time

from protocol import serve

DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"


def load(settings: dict):
    import vllm
    from vllm.inputs import TokensPrompt

    speculative = None
    if settings["draft"] is not None:
        speculative = {"method": "eagle3", "model": settings["draft"], "num_speculative_tokens": settings["k"]}
    llm = vllm.LLM(model=settings["target"], dtype="float32", enforce_eager=True, speculative_config=speculative,
                   disable_log_stats=False, max_model_len=2048, seed=0)

    def decode(prompt: list[int], max_new_tokens: int) -> dict:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        before = _counters(llm)
        start = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        after = _counters(llm)
        return {"tokens": list(output.outputs[0].token_ids), "seconds": seconds,
                "cycles": after[DRAFTS] - before[DRAFTS], "accepted": after[ACCEPTED] - before[ACCEPTED]}

    return {"engine": "vLLM", "version": vllm.__version__}, decode


def _counters(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters (drafting steps and accepted tokens: none without a draft)."""
    values = {metric.name: metric.value for metric in llm.get_metrics() if hasattr(metric, "value")}
    return {name: int(values.get(name, 0)) for name in (DRAFTS, ACCEPTED)}


if __name__ == "__main__":
    serve(load)
