"""Runs in OpenVINO GenAI's own virtualenv (`make engines` builds it): greedy decoding in float32 with
`openvino_genai.LLMPipeline`, plainly or with an exported EAGLE-3 draft drafting a tree, one prompt a request
(`protocol.py`). Settings: `target` and `draft` (exported folders; `draft` null for plain decoding), and the tree's
`tree_depth`, `branching_factor` and `num_assistant_tokens`. The draft's target layers are in its exported model's
rt_info (`hidden_layers_list`, which `hf_eagle3/engines/openvino.py` writes).

    python openvino_side.py '{"target": DIR, "draft": DIR, "tree_depth": 3, "branching_factor": 1,
                              "num_assistant_tokens": 3}'
"""

import time

from protocol import serve

FLOAT32 = {"INFERENCE_PRECISION_HINT": "f32"}  # else bf16 on CPUs with bf16 units


def load(settings: dict):
    import numpy as np
    import openvino as ov
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.do_sample = False
    properties = dict(FLOAT32)
    if settings["draft"] is not None:
        properties["draft_model"] = openvino_genai.draft_model(settings["draft"], "CPU", **FLOAT32)
        config.tree_depth, config.branching_factor = settings["tree_depth"], settings["branching_factor"]
        config.num_assistant_tokens = settings["num_assistant_tokens"]
    pipe = openvino_genai.LLMPipeline(settings["target"], "CPU", **properties)

    def decode(prompt: list[int], max_new_tokens: int) -> dict:
        config.max_new_tokens = max_new_tokens
        input_ids = ov.Tensor(np.array([prompt], dtype=np.int64))
        start = time.perf_counter()
        output = pipe.generate(input_ids, config)
        seconds = time.perf_counter() - start
        tokens = list(output.tokens[0])
        cycles = accepted = 0
        if settings["draft"] is not None:  # one main-model inference per verification, after the prompt's
            cycles = len(output.extended_perf_metrics.main_model_metrics.raw_metrics.m_durations) - 1
            accepted = len(tokens) - 1 - cycles  # the prompt's inference makes the first token
        return {"tokens": tokens, "seconds": seconds, "cycles": cycles, "accepted": accepted}

    return {"engine": "OpenVINO GenAI", "version": openvino_genai.__version__}, decode


if __name__ == "__main__":
    serve(load)
