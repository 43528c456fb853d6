"""Configuration of the EAGLE-3 draft model."""

from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters
from transformers.utils.type_validators import interval

# Bounds of the decoding settings, checked before anything is sized from them: far beyond any tree that pays, well
# within what one forward can hold
MAX_TREE_DEPTH, MAX_TREE_TOKENS, MAX_NGRAM_MATCH = 64, 512, 64
# The layout vLLM and SGLang load by repository id (SpecForge / SGLang `LlamaForCausalLMEagle3`), which
# `save_pretrained` writes once hf_eagle3 is imported: the decoder layer's Llama fields at the top level, the target
# layers read as output-of-layer numbers in `eagle_config`, and the fields the engines have no key for (tree defaults,
# acceptance profile, n-gram settings, target) under `SERVED_SETTINGS_KEY`, which they ignore.
SERVED_ARCHITECTURE = "LlamaForCausalLMEagle3"
SERVED_SETTINGS_KEY = "hf_eagle3"
# The served layout records the target layers twice, one key for each numbering the engines read: the top-level key in
# `hidden_states` indices (vLLM, llama.cpp) and `eagle_config`'s in output-of-layer numbers (SGLang, SpecForge).
LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


@strict
class Eagle3Config(PreTrainedConfig):
    r"""
    Configuration of an [`Eagle3DraftModel`]: one Llama-style decoder layer that drafts tokens for a *target* model
    from the target's fused low / middle / high hidden states (EAGLE-3, arXiv:2503.01840), plus the default shape of
    the EAGLE-2 dynamic draft tree used at generation time.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000):
            Vocabulary size of the **target** model. `generate` checks that an assistant shares the target's
            vocabulary, and the draft's token embedding (the target's, frozen) has this many rows.
        draft_vocab_size (`int`, *optional*):
            Size of the reduced vocabulary the draft's `lm_head` predicts over (the most frequent target tokens of the
            training data). Defaults to `vocab_size` (no reduction).
        hidden_size (`int`, *optional*, defaults to 4096):
            Width `k` of the draft's residual stream. Equals the target's hidden size for every public draft.
        target_hidden_size (`int`, *optional*):
            Hidden size `k_t` of the target; `fc` maps the concatenated `3 * k_t` target features to `k`. Defaults to
            `hidden_size`.
        intermediate_size (`int`, *optional*, defaults to 14336):
            Width of the SwiGLU MLP of the decoder layer.
        num_attention_heads (`int`, *optional*, defaults to 32):
            Number of query heads of the decoder layer.
        num_key_value_heads (`int`, *optional*):
            Number of key / value heads (grouped-query attention). Defaults to `num_attention_heads`.
        head_dim (`int`, *optional*):
            Width of one attention head. Defaults to `hidden_size // num_attention_heads`.
        hidden_act (`str`, *optional*, defaults to `"silu"`):
            Activation of the MLP's gate projection.
        rms_norm_eps (`float`, *optional*, defaults to 1e-05):
            Epsilon of every RMSNorm of the draft.
        rope_parameters (`RopeParameters` or `dict`, *optional*):
            RoPE settings of the draft's attention, as in transformers 5 (`{"rope_type": ..., "rope_theta": ...}`).
            A plain `rope_theta` (what the official EAGLE-3 drafts store) or a legacy `rope_scaling` are accepted and
            converted. When absent, RoPE is the original one with base 10000: the official drafts use exactly that,
            whatever RoPE scaling their target uses.
        max_position_embeddings (`int`, *optional*, defaults to 2048):
            Longest sequence the draft's RoPE is prepared for.
        attention_bias (`bool`, *optional*, defaults to `False`):
            Whether q / k / v / o projections have a bias.
        attention_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on the attention probabilities (training only).
        mlp_bias (`bool`, *optional*, defaults to `False`):
            Whether the MLP projections have a bias.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialisation of linear layers.
        target_layer_ids (`list[int]`, *optional*):
            Which target hidden states are fused, as indices into a transformers model's `outputs.hidden_states`
            (index `i` is the residual stream *entering* decoder layer `i`; 0 is the embedding output). Sorted
            ascending, concatenated low | mid | high. Defaults to `(2, N // 2, N - 3)` for an `N`-layer target, the
            official choice, and to `(N // 4, N // 2, N - 1)` for targets too shallow for three distinct official taps
            (fewer than 7 layers). Converters translate the "output of layer i" numbering (= index `i + 1`) at the
            boundary.
        target_num_hidden_layers (`int`, *optional*):
            Number of decoder layers `N` of the target; only used to derive the default `target_layer_ids`.
        target_model_type (`str`, *optional*):
            `model_type` of the target the draft was trained for (e.g. `"llama"`), recorded for checks and cards.
        target_name_or_path (`str`, *optional*):
            Hub id or path of the target the draft was trained for, recorded for checks and cards.
        target_fingerprint (`str`, *optional*):
            What identifies the target the draft was trained for whatever its path (its architecture and a hash of
            its embeddings, `hf_eagle3.utils.fingerprint.weights_fingerprint`), recorded by `hf-eagle3 train`, so that
            a target loaded from a local copy is recognised and another model of the same shapes is not.
        bos_token_id (`int`, *optional*):
            The target's beginning-of-sequence token id. Like `eos_token_id` and `pad_token_id`, recorded from the
            target's config when the draft is attached to it (`generate`, `pipeline`): a draft shares its target's
            tokenizer, and transformers' pipelines compare these ids with the target's to tell an assistant that
            shares the tokenizer from one that needs its own.
        eos_token_id (`int` or `list[int]`, *optional*):
            The target's end-of-sequence token id(s).
        pad_token_id (`int`, *optional*):
            The target's padding token id.
        fc_norm (`bool`, *optional*, defaults to `False`):
            EAGLE 3.1 (arXiv:2605.09992): an RMSNorm (`fc_norm.{0,1,2}`, width `k_t`) on each captured target hidden
            state before `fc`, so that no tapped layer dominates the fused feature by its magnitude. SpecForge
            `fc_norm`, speculators `fc_norm.*` weights.
        norm_before_residual (`bool`, *optional*, defaults to `False`):
            EAGLE 3.1: the decoder layer's residual stream starts from the *normalised* feature
            `hidden_norm(x)` instead of `x`, so the feature fed back at the next draft step keeps a bounded magnitude
            with depth. vLLM / speculators `norm_before_residual`.
        norm_output (`bool`, *optional*, defaults to `False`):
            EAGLE 3.1 as SpecForge and speculators train it: the feature fed back at the next draft step is the final
            norm's output `norm(a)` (the one `lm_head` reads) instead of `a`. SpecForge / SGLang and speculators
            `norm_output`.
        norm_before_fc (`bool`, *optional*, defaults to `False`):
            An RMSNorm (`input_norm`, width `3 * k_t`) over the concatenated target features before `fc` (speculators
            `norm_before_fc`, e.g. its gpt-oss drafts). Exclusive with `fc_norm`.
        num_hidden_layers (`int`, *optional*, defaults to 1):
            Number of decoder layers. The first (`midlayer`) reads the embedding and the feature; the others
            (`extra_layers.*`) are plain Llama decoder layers over the feature, as vLLM, speculators and ModelOpt run
            them.
        layer_types (`list[str]`, *optional*):
            Attention of each decoder layer, `"full_attention"` or `"sliding_attention"` (speculators / vLLM
            `layer_types`). Defaults to full attention in every layer.
        sliding_window (`int`, *optional*):
            Window of the `"sliding_attention"` layers: a query at position `p` sees the keys at positions
            `p - sliding_window + 1 .. p`.
        qk_norm (`bool`, *optional*, defaults to `False`):
            Qwen3's per-head RMSNorm (`self_attn.q_norm` / `k_norm`, width `head_dim`) on queries and keys before
            RoPE, in every decoder layer (speculators drafts whose layer config is `qwen3`).
        share_target_embedding (`bool`, *optional*, defaults to `True`):
            When `True` the draft's token embedding is the target's input embedding, attached at run time and never
            written to the draft's checkpoint. When `False` the checkpoint carries its own `embed_tokens.weight`.
        share_target_lm_head (`bool`, *optional*, defaults to `False`):
            When `True` the draft has no head of its own: its logits are the target's `lm_head` applied to the
            draft's final norm, over the whole vocabulary (`draft_vocab_size == vocab_size`), attached at run time and
            never saved (ModelOpt's gpt-oss-120b drafts; SGLang's `load_lm_head_from_target`).
        tree_depth (`int`, *optional*, defaults to 6):
            Default number of draft expansion steps per decoding cycle (the depth of the draft tree; at most
            `MAX_TREE_DEPTH`).
        tree_top_k (`int`, *optional*, defaults to 8):
            Default number of children expanded per frontier node, and size of the frontier. `1` drafts a chain.
        tree_total_tokens (`int`, *optional*, defaults to 60):
            Default number of drafted tokens (tree nodes besides the root) the target verifies per cycle (at most
            `MAX_TREE_TOKENS`).
            These three sizes are the fixed tree on the CPU. On a GPU a draft without an `acceptance_profile` decodes
            with the official EAGLE-3 tree, depth 7, top-k 10, 60 tokens; set sizes in its `generation_config` or in
            the `generate` call to decode with others there.
        tree_shape (`str`, *optional*, defaults to `"fixed"`):
            `"fixed"`: decode with `tree_depth`, `tree_top_k` and `tree_total_tokens`. `"auto"`: decode with the shape
            predicted fastest on the machine at hand, from `acceptance_profile` and costs measured there once (and
            cached; see `hf_eagle3.decoding.calibration`), or plainly (without running the draft) when no shape is predicted
            to beat plain decoding; without an `acceptance_profile`, with the fixed tree (saying so once). Passing any
            tree setting to `generate` decodes with that fixed shape.
        ngram_candidates (`bool`, *optional*, defaults to `True`):
            Merge a context n-gram continuation into every draft tree (`hf_eagle3.decoding.ngram`): the tokens that followed
            the latest occurrence of the last `ngram_max_match` (or fewer) tokens in the prompt and the text generated
            so far, ranked against the draft's own candidates by an acceptance rate learnt during the call, within the
            same `tree_total_tokens` budget. Lossless like the draft's candidates. `generate(ngram_candidates=...)`
            overrides it per call.
        ngram_max_match (`int`, *optional*, defaults to 3):
            Longest suffix of the text matched for the context continuation (at most `MAX_NGRAM_MATCH`).
        ngram_max_tokens (`int`, *optional*, defaults to 10):
            Most tokens of one context continuation (transformers' `prompt_lookup_num_tokens`; at most
            `MAX_TREE_TOKENS`).
        acceptance_profile (`list[dict]`, *optional*):
            τ (tokens per target forward) of tree shapes for this draft and its target, one
            `{"tree_depth", "tree_top_k", "tree_total_tokens", "tau"}` row per shape, estimated from greedy decoding of
            calibration prompts (`hf-eagle3 tune-tree --save-to`); rows with `"ngram_candidates": true` were measured
            with context n-gram candidates in the tree. It does not depend on the hardware; `tree_shape="auto"`
            combines the rows of the call's `ngram_candidates` setting (for shapes profiled only without context
            candidates, those rows: a lower bound) with the machine's measured costs. Where the prompts came from
            several sets, a row's optional `"tau_by_set"` maps each set's name (`"mt-bench"`, `"humaneval"`) to the
            median τ of its prompts: what predictions of the median speedup over prompts of one kind read (`hf-eagle3
            bench`, `demo`); `tau` pools every cycle of them all. Optional `"prompts"` and `"cycles"` count what the
            row rests on (the prompts decoded, the decoding cycles over them).
        converted_from (`dict`, *optional*):
            Set by `hf-eagle3 convert` (and by `from_pretrained` on a foreign checkpoint) when the draft was converted
            from another project's format: `{"format": ..., "notes": [...]}`, the notes stating every reading chosen
            where that format's engines read the checkpoint differently (e.g. YaRN's `mscale`). A converted draft
            never reads `hidden_states[N]` of an `N`-layer target: the engines it comes from feed the last layer's
            output before the final norm, transformers after it.

    ```python
    >>> from hf_eagle3 import Eagle3Config, Eagle3DraftModel
    >>> config = Eagle3Config(vocab_size=49152, draft_vocab_size=8192, hidden_size=576, intermediate_size=1536,
    ...                       num_attention_heads=9, num_key_value_heads=3, target_num_hidden_layers=30)
    >>> config.target_layer_ids
    [2, 15, 27]
    >>> draft = Eagle3DraftModel(config)
    ```"""

    model_type = "eagle3"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    draft_vocab_size: int | None = None
    hidden_size: int = 4096
    target_hidden_size: int | None = None
    intermediate_size: int = 14336
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_parameters: RopeParameters | dict | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    attention_dropout: int | float = 0.0
    mlp_bias: bool = False
    initializer_range: float = 0.02
    target_layer_ids: list[int] | tuple[int, ...] | None = None
    target_num_hidden_layers: int | None = None
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    target_fingerprint: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    num_hidden_layers: int = 1
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    qk_norm: bool = False
    share_target_embedding: bool = True
    share_target_lm_head: bool = False
    # decoding settings, also validated when assigned after construction (`draft.config.tree_depth = 4`)
    tree_depth: int = interval(min=1, max=MAX_TREE_DEPTH)(default=6)
    tree_top_k: int = interval(min=1)(default=8)
    tree_total_tokens: int = interval(min=1, max=MAX_TREE_TOKENS)(default=60)
    tree_shape: Literal["fixed", "auto"] = "fixed"
    ngram_candidates: bool = True
    ngram_max_match: int = interval(min=1, max=MAX_NGRAM_MATCH)(default=3)
    ngram_max_tokens: int = interval(min=1, max=MAX_TREE_TOKENS)(default=10)
    acceptance_profile: list[dict] | None = None
    converted_from: dict | None = None
    tie_word_embeddings: bool = False

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """`PreTrainedConfig.get_config_dict`, reading a draft hf-eagle3 saved in the served layout as this config's
        fields (`served_layout_fields`)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if is_served_layout(config_dict):
            source = f"{pretrained_model_name_or_path}/config.json"
            config_dict = {"model_type": cls.model_type, **served_layout_fields(config_dict, source)}
        return config_dict, kwargs

    @classmethod
    def _dict_from_json_file(cls, json_file) -> dict:
        """`PreTrainedConfig._dict_from_json_file`, refusing contents that are not a draft's config (a JSON list or
        `null`, an `hf_eagle3` or `eagle_config` key that holds no object), naming the file and the field."""
        config_dict = super()._dict_from_json_file(json_file)
        if not isinstance(config_dict, dict):
            kind = "null" if config_dict is None else f"a JSON {type(config_dict).__name__}"
            problem = f"holds {kind}, not an object of config fields"
        else:
            problem = next((f"holds a {type(config_dict[name]).__name__} as {name!r}, not an object of fields"
                            for name in (SERVED_SETTINGS_KEY, "eagle_config")
                            if config_dict.get(name) is not None and not isinstance(config_dict[name], dict)), None)
        if problem:
            raise ValueError(f"{json_file} {problem}: it is damaged. Save or download the draft again.")
        return config_dict

    def __post_init__(self, **kwargs):
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None and self.target_num_hidden_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.target_num_hidden_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = sorted(int(i) for i in self.target_layer_ids)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation: the shapes of the draft must be buildable and unambiguous."""
        problems = []
        for name in ("vocab_size", "hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "num_hidden_layers"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if problems:  # the checks below divide by these sizes
            raise ValueError("Invalid Eagle3Config: " + "; ".join(problems) + ".")
        if not self.rms_norm_eps > 0:
            problems.append(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act {self.hidden_act!r} is unknown to transformers (e.g. 'silu', 'gelu')")
        rope = self.rope_parameters or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            problems.append(f"rope_type {rope_type!r} is unknown to transformers (one of: default, "
                            f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
        if not rope.get("rope_theta", 10000.0) > 0:
            problems.append(f"rope_theta must be > 0, got {rope.get('rope_theta')}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(
                f"draft_vocab_size ({self.draft_vocab_size}) must be in [1, vocab_size={self.vocab_size}]"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if 3 * self.target_hidden_size == self.hidden_size:
            problems.append(
                "hidden_size equals 3 * target_hidden_size, so target features and draft features cannot be told "
                "apart by width"
            )
        if self.target_layer_ids is not None:
            if len(self.target_layer_ids) != 3:
                problems.append(f"target_layer_ids must hold 3 indices (low, mid, high), got {self.target_layer_ids}")
            if min(self.target_layer_ids, default=0) < 0:
                problems.append(f"target_layer_ids must be non-negative, got {self.target_layer_ids}")
            if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
                problems.append(f"target_layer_ids must be distinct, got {self.target_layer_ids}")
        for row in self.acceptance_profile or []:
            counts = {"prompts", "cycles"}
            shape_keys = set(row) - {"ngram_candidates", "tau_by_set", *counts} if isinstance(row, dict) else set()
            tau = row.get("tau") if isinstance(row, dict) else None
            if (shape_keys != {"tree_depth", "tree_top_k", "tree_total_tokens", "tau"} or isinstance(tau, bool)
                    or not isinstance(tau, int | float) or not tau >= 1
                    or not isinstance(row.get("ngram_candidates", False), bool)
                    or not all(type(row[name]) is int and row[name] >= 0 for name in counts & set(row))):
                problems.append(
                    "acceptance_profile rows must be {tree_depth, tree_top_k, tree_total_tokens, tau >= 1} and "
                    f"optionally ngram_candidates (true or false), tau_by_set and the counts prompts and cycles, got "
                    f"{row}"
                )
                break
        if "sliding_attention" in (self.layer_types or []) and not (self.sliding_window or 0) >= 1:
            problems.append(f"sliding_attention layers need a sliding_window >= 1, got {self.sliding_window}")
        if self.share_target_lm_head and self.draft_vocab_size != self.vocab_size:
            problems.append(
                f"share_target_lm_head predicts the whole vocabulary: draft_vocab_size ({self.draft_vocab_size}) must "
                f"equal vocab_size ({self.vocab_size})"
            )
        if self.fc_norm and self.norm_before_fc:
            problems.append("fc_norm and norm_before_fc are exclusive (one norms each target state, one all three)")
        if self.converted_from is not None and (
            not isinstance(self.converted_from.get("format"), str)
            or not isinstance(self.converted_from.get("notes", []), list)
        ):
            problems.append(f"converted_from must be {{'format': str, 'notes': [str]}}, got {self.converted_from}")
        if problems:
            raise ValueError("Invalid Eagle3Config: " + "; ".join(problems) + ".")


def is_served_layout(config_dict: dict) -> bool:
    """Whether the `config.json` contents `config_dict` are those of a draft hf-eagle3 saved in the served layout
    (SpecForge / SGLang's, with hf-eagle3's settings under `SERVED_SETTINGS_KEY`)."""
    return SERVED_ARCHITECTURE in (config_dict.get("architectures") or []) and isinstance(
        config_dict.get(SERVED_SETTINGS_KEY), dict)


def served_layout_fields(config_dict: dict, source: str = "config.json") -> dict:
    """The `Eagle3Config` fields of a draft hf-eagle3 saved in the served layout (`is_served_layout`).

    This file reads that layout on its own because it is also the remote code of saved drafts, which cannot import
    hf-eagle3's converters; those read any SpecForge / SGLang draft, hf-eagle3's among them, to the same fields.
    """
    settings = config_dict[SERVED_SETTINGS_KEY]
    fields = {name: value for name, value in config_dict.items()
              if name in Eagle3Config.__annotations__ or name in ("dtype", "torch_dtype")}
    fields = {**fields, **settings, "target_layer_ids": served_target_layer_ids(config_dict, source)}
    refusal = last_layer_tap_refusal(fields["target_layer_ids"], settings.get("target_num_hidden_layers"),
                                     f"hf-eagle3 reading {source}")
    if refusal is not None:
        raise ValueError(refusal)
    return fields


def served_target_layer_ids(config_dict: dict, source: str = "config.json") -> list[int] | None:
    """The target layers the served-layout (SpecForge / SGLang) `config.json` contents `config_dict` record, as sorted
    `hidden_states` indices; `None` when no key records them. Every path reads them here (`from_pretrained`,
    `hf-eagle3 convert`, `push`); `save_pretrained` writes the two engine keys.

    Three keys may record them, each read in its own numbering: the top-level `eagle_aux_hidden_state_layer_ids`
    (`hidden_states` indices, which vLLM and llama.cpp read), `eagle_config.eagle_aux_hidden_state_layer_ids`
    (outputs of layers, `hidden_states` index i + 1, which SGLang reads) and `target_layer_ids` under
    `SERVED_SETTINGS_KEY` (`hidden_states` indices; hf-eagle3 never writes it there). Keys that disagree would have
    the engines feed the draft different layers, silently: refused, naming `source`, the values and the fix.
    """
    eagle_config = config_dict.get("eagle_config") or {}
    settings = config_dict.get(SERVED_SETTINGS_KEY) or {}
    recorded = {  # key: (value as written, as hidden_states indices)
        key: (value, _layer_ids(key, value, shift, source))
        for key, value, shift in (
            (LAYER_IDS_KEY, config_dict.get(LAYER_IDS_KEY), 0),
            (f"eagle_config.{LAYER_IDS_KEY}", eagle_config.get(LAYER_IDS_KEY), 1),
            (f"{SERVED_SETTINGS_KEY}.target_layer_ids", settings.get("target_layer_ids"), 0),
        )
        if value is not None
    }
    readings = {tuple(ids) for _, ids in recorded.values()}
    if len(readings) > 1:
        listed = "; ".join(f"{key} = {value} (hidden_states {ids})" for key, (value, ids) in recorded.items())
        raise ValueError(
            f"{source} records the draft's target layers in keys that disagree: {listed}. vLLM and llama.cpp read the "
            f"top-level {LAYER_IDS_KEY}, SGLang eagle_config's (outputs of layers: hidden_states index i + 1), so the "
            "engines would feed the draft different layers. Keep the key that holds the layers the draft was trained "
            "on, delete the others, load the draft and save it again with save_pretrained (which writes both "
            "engine keys)."
        )
    return list(readings.pop()) if readings else None


def _layer_ids(key: str, value, shift: int, source: str) -> list[int]:
    """`value`, the target layers `key` records, as sorted `hidden_states` indices (`shift` added to each)."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"{source}: {key} must be a list of integer layer ids, got {value!r}. Restore the draft's "
                         "config.json from its source or save the draft again with save_pretrained.")
    return sorted(i + shift for i in value)


def last_layer_tap_refusal(target_layer_ids: list[int] | None, num_layers: int | None, what: str) -> str | None:
    """Why a draft that reads the output of its `num_layers`-layer target's last layer cannot move between
    hf-eagle3 and the engines (`None` for any other draft, or when `num_layers` is unknown).

    SGLang and vLLM capture that output before the target's final norm; transformers' `hidden_states[N]`, which
    `Eagle3DraftModel` is fed, comes after it.
    """
    if num_layers is None or num_layers not in (target_layer_ids or []):
        return None
    return (
        f"The draft's target layers include the output of the target's last layer (hidden_states index "
        f"{num_layers} of an {num_layers}-layer target; {num_layers - 1} in output-of-layer numbering). SGLang "
        f"and vLLM take it before the target's final norm, transformers' hidden_states[{num_layers}] after it, "
        f"and hf-eagle3 does not capture the pre-norm tensor: {what} would read another tensor than it was "
        "trained on, so it is refused."
    )


def default_target_layer_ids(num_layers: int) -> list[int]:
    """The `hidden_states` indices an `num_layers`-layer target is tapped at by default: the official (2, N//2, N-3),
    or (N//4, N//2, N-1) for targets too shallow for three distinct official taps. A target of fewer than 3 layers
    has no three distinct taps below its last layer's output, and is refused."""
    if num_layers < 3:
        raise ValueError(
            f"A {num_layers}-layer target has {max(num_layers, 0)} hidden states a draft can read (hidden_states 0 .. "
            f"{num_layers - 1}: the embeddings and the outputs of the layers before the last), and an EAGLE-3 draft "
            "reads three distinct ones: use a target of at least 3 decoder layers."
        )
    official = [2, num_layers // 2, num_layers - 3]
    if len(set(official)) == 3 and num_layers - 3 > num_layers // 2:
        return official
    return [num_layers // 4, num_layers // 2, num_layers - 1]


__all__ = [
    "Eagle3Config",
    "default_target_layer_ids",
    "is_served_layout",
    "last_layer_tap_refusal",
    "served_layout_fields",
    "served_target_layer_ids",
]
