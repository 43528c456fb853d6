"""EAGLE-3 decoding for the target this draft was made for, as a transformers `custom_generate` repository entry:

    from hf_eagle3 import Eagle3DraftModel
    draft = Eagle3DraftModel.from_pretrained(repo)
    target.generate(**inputs, custom_generate=repo, trust_remote_code=True, assistant_model=draft)

transformers hands this `generate` every argument of the `generate` call; it runs hf_eagle3's decoding loop
(`hf_eagle3.generation.eagle3_generate`) with the draft passed as `assistant_model` and the call's tree settings
(`tree_depth`, `tree_top_k`, `tree_total_tokens`, `tree_shape`, `ngram_candidates`, `exact_attention`). The loop is
hf_eagle3's, not a copy. There is no `requirements.txt`: transformers checks one whenever it loads this file, which
`AutoModel.from_pretrained(repo, trust_remote_code=True)` does too, so the draft would not load without hf-eagle3;
hf-eagle3 is needed only here, when this `generate` runs, and its error says how to install it.
"""

from transformers import GenerationMixin


def generate(model, assistant_model=None, streamer=None, **generate_arguments):
    try:  # inside `try`: transformers' import check of remote code skips it
        from hf_eagle3.generation import eagle3_generate
    except ImportError as error:
        raise ImportError(
            "EAGLE-3 decoding needs hf-eagle3, which no package index serves: install it from a clone of its "
            "repository (`pip install ./hf-eagle3`)."
        ) from error
    if assistant_model is None:
        raise ValueError(
            "Pass the EAGLE-3 draft as assistant_model: draft = Eagle3DraftModel.from_pretrained(<this repository>)."
        )
    return GenerationMixin.generate(model, **generate_arguments, custom_generate=eagle3_generate,
                                    draft=assistant_model, eagle3_streamer=streamer)
