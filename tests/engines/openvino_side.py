"""Runs in OpenVINO GenAI's own virtualenv (`tests/engines/run.py` makes it): greedy decoding of the prompts in a job
file with `openvino_genai.LLMPipeline`, plainly or with an exported EAGLE-3 draft drafting a tree, one prompt at a time;
prints one line, `RESULT` and JSON, with the tokens, the seconds, and the target forwards and accepted draft tokens of
each EAGLE-3 call.

    python openvino_side.py JOB.json plain|eagle3

The draft's target layers are in its exported model's rt_info (`hidden_layers_list`, which run.py writes).
"""

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai

RESULT = "openvino_side result: "
FLOAT32 = {"INFERENCE_PRECISION_HINT": "f32"}  # else bf16 on CPUs with bf16 units


def main(job_file: str, method: str) -> None:
    job = json.loads(open(job_file).read())
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = job["max_new_tokens"]
    config.do_sample = False
    properties = dict(FLOAT32)
    if method == "eagle3":
        properties["draft_model"] = openvino_genai.draft_model(job["draft"], "CPU", **FLOAT32)
        config.tree_depth, config.branching_factor = job["tree_depth"], job["branching_factor"]
        config.num_assistant_tokens = job["num_assistant_tokens"]
    pipe = openvino_genai.LLMPipeline(job["target"], "CPU", **properties)
    prompts = [ov.Tensor(np.array([prompt], dtype=np.int64)) for prompt in job["prompts"]]
    pipe.generate(prompts[0], config)  # warm-up
    tokens, seconds, forwards, accepted = [], [], [], []
    for prompt in prompts:
        start = time.perf_counter()
        output = pipe.generate(prompt, config)
        seconds.append(time.perf_counter() - start)
        tokens.append(list(output.tokens[0]))
        if method == "eagle3":  # one main-model inference per verification, after the prompt's
            metrics = output.extended_perf_metrics  # SDPerModelsPerfMetrics
            forwards.append(len(metrics.main_model_metrics.raw_metrics.m_durations))
            accepted.append(metrics.get_num_accepted_tokens())
    print(RESULT + json.dumps({"tokens": tokens, "seconds": seconds, "forwards": forwards, "accepted": accepted}),
          flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
