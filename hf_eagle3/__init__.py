"""EAGLE-3 speculative decoding for Hugging Face transformers.

Importing this package registers `Eagle3Config` / `Eagle3DraftModel` with the Auto classes and lets
`target.generate(**inputs, assistant_model=draft)` run EAGLE-3 whenever `draft` is an `Eagle3DraftModel`, also inside
`pipeline("text-generation", model=target, assistant_model=draft)` (the draft, or its path or Hub id);
`target.generate(**inputs, custom_generate=eagle3_generate, draft=draft)` runs the same loop through transformers'
`custom_generate` extension point. Nothing else of transformers changes (docs/compatibility.md); the first
verification forward registers the "sdpa" attention function that a forward can ask, by a keyword argument, to attend
over each key/value head once, without repeating the cache for every query head (or, with `exact_attention=True`,
node by node).
`hf_eagle3.optimize(model)` lays a model's linear layers out for fast multi-token forwards on CPU, explicitly
(`decoding.cpu_layout`).
"""

from transformers import AutoConfig, AutoModel

from .configuration_eagle3 import Eagle3Config
from .conversion.foreign import read_foreign
from .conversion.served import save_served
from .decoding.compatibility import check_compatibility
from .decoding.cpu_layout import optimize, standard_layout
from .decoding.generate import Eagle3GenerateOutput, Eagle3GenerationStats, Eagle3RowStats, eagle3_generate, install
from .decoding.pipelines import install as install_pipeline_support
from .modeling_eagle3 import Eagle3DraftModel
from .publishing.hub import push_draft
from .utils.transformers_api import check_version

check_version()

AutoConfig.register(Eagle3Config.model_type, Eagle3Config, exist_ok=True)
AutoModel.register(Eagle3Config, Eagle3DraftModel, exist_ok=True)
# Saved drafts carry `auto_map` and this modeling code, so they also load where hf_eagle3 is not installed.
Eagle3Config.register_for_auto_class()
Eagle3DraftModel.register_for_auto_class("AutoModel")
# Foreign checkpoint formats for `from_pretrained`, the layout the serving engines load for `save_pretrained`, and
# model cards for `push_to_hub` (the remote-code copy has none of them).
Eagle3DraftModel.register_checkpoint_reader(read_foreign)
Eagle3DraftModel.register_checkpoint_writer(save_served)
Eagle3DraftModel.register_pusher(push_draft)
install()
install_pipeline_support()

__version__ = "0.1.0"
__all__ = [
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3GenerateOutput",
    "Eagle3GenerationStats",
    "Eagle3RowStats",
    "check_compatibility",
    "eagle3_generate",
    "optimize",
    "standard_layout",
]
