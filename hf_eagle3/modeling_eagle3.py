"""The EAGLE-3 draft model (arXiv:2503.01840), in the layout of the official SafeAILab/EAGLE checkpoints.

The draft reads, at every position `i` of a sequence, the target's fused hidden state `g_i` (or, at drafted
positions, its own previous output `a_i`) together with the embedding of token `i + 1`, and predicts token `i + 2`:

    g = fc([l ; m ; h])                                   # [B, T, 3 k_t] -> [B, T, k], target features only
    x = g  (target features)  or  a  (draft features)     # residual stream, [B, T, k]
    attn_in = [input_layernorm(embed(ids)) ; hidden_norm(x)]          # [B, T, 2k]
    x = x + o_proj(attention(q/k/v_proj(attn_in)))        # the embedding never enters the residual
    a = x + mlp(post_attention_layernorm(x))              # next feature, [B, T, k]
    logits = lm_head(norm(a))                             # [B, T, draft_vocab_size]

EAGLE 3.1 options (arXiv:2605.09992): `fc_norm` normalises each of `l`, `m`, `h` before `fc`
(`g = fc([fc_norm_0(l) ; fc_norm_1(m) ; fc_norm_2(h)])`); `norm_before_residual` starts the residual stream from
`hidden_norm(x)` instead of `x` (`x = hidden_norm(x)` before the attention block); `norm_output` feeds back the
normalised feature (`a <- norm(a)`, logits `lm_head(a)`).

Variants of public drafts: `norm_before_fc` normalises the whole `[l ; m ; h]` (`input_norm`) before `fc`;
`num_hidden_layers > 1` runs plain Llama decoder layers (`extra_layers.*`, reading `x` alone) after `midlayer`, as
vLLM does; `layer_types` / `sliding_window` restrict `"sliding_attention"` layers to a window of recent positions;
`qk_norm` adds Qwen3's per-head RMSNorm on queries and keys before RoPE; `share_target_lm_head` takes the target's
`lm_head` (attached like the shared embedding) as the draft's head.

Weight names match the official and SpecForge checkpoints (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).
This file only imports torch, transformers and safetensors (a transformers dependency), so it also serves as the
remote code of saved checkpoints.
"""

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils import (
    GENERATION_CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    ModelOutput,
    cached_file,
)

from .configuration_eagle3 import Eagle3Config


def _is_sliding(config: Eagle3Config, layer_idx: int) -> bool:
    return config.layer_types is not None and config.layer_types[layer_idx] == "sliding_attention"


class Eagle3Attention(nn.Module):
    """Grouped-query self-attention. In the first decoder layer (`layer_idx` 0) the q / k / v projections read the
    2k-wide `[embedding ; feature]` input, in later layers the k-wide feature."""

    def __init__(self, config: Eagle3Config, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if _is_sliding(config, layer_idx) else None
        in_features, bias = (2 if layer_idx == 0 else 1) * config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(in_features, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.qk_norm:  # Qwen3: one RMSNorm over each head's query / key
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[B, T, 2k]` input -> rotated queries `[B, H, T, D]`, rotated keys and values `[B, KV, T, D]`."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if self.config.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, T, 2k]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,  # additive, [B, 1, T, past + T]
        cache: Cache | None = None,
    ) -> torch.Tensor:
        query, key, value = self.project(hidden_states, position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )
        return self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))


class Eagle3DecoderLayer(nn.Module):
    """A Llama decoder layer. The first (`layer_idx` 0, `midlayer`) has two input streams, the token embedding and
    the feature (residual) stream; later ones (`num_hidden_layers > 1`, as vLLM runs them) read the feature alone."""

    def __init__(self, config: Eagle3Config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        # Normalises the embedding in the first layer, the feature in later ones (the plain Llama layer's norm).
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_idx == 0:
            self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # normalises the feature
        self.self_attn = Eagle3Attention(config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(
        self, inputs_embeds: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What q / k / v read and the residual `[B, T, k]`. First layer: `[input_layernorm(embedding) ;
        hidden_norm(feature)]` `[B, T, 2k]`, and the feature itself or, with `norm_before_residual`, its normalised
        form. Later layers: `input_layernorm(feature)` `[B, T, k]` and the feature (the embedding is not read)."""
        if self.layer_idx > 0:
            return self.input_layernorm(hidden_states), hidden_states
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        return torch.cat([self.input_layernorm(inputs_embeds), normed], dim=-1), residual

    def finish(self, residual: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
        """Residual add of the attention output `[B, T, k]`, then the MLP block."""
        hidden_states = residual + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [B, T, k]
        hidden_states: torch.Tensor,  # [B, T, k]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        attn_input, residual = self.attention_input(inputs_embeds, hidden_states)
        return self.finish(residual, self.self_attn(attn_input, position_embeddings, attention_mask, cache))


@dataclass
class Eagle3DraftOutput(ModelOutput):
    """
    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, sequence_length, draft_vocab_size)`):
            Scores over the draft vocabulary; `draft_to_target` maps their indices to target token ids.
        hidden_states (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`):
            The draft's output features `a` (before the final norm, unless `config.norm_output`), fed back as input
            at the next draft step.
        cache (`Cache`):
            The draft's key / value cache, including the positions of this call.
    """

    logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None
    cache: Cache | None = None


class Eagle3PreTrainedModel(PreTrainedModel):
    config: Eagle3Config
    config_class = Eagle3Config
    base_model_prefix = "model"
    _supports_sdpa = True
    _supports_flex_attn = False
    _supports_flash_attn = False
    _no_split_modules = ["Eagle3DecoderLayer"]

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding) and module.weight is None:
            return  # the target's embedding, not attached yet
        super()._init_weights(module)
        if isinstance(module, Eagle3DraftModel):
            # Identity vocabulary (draft id i = target id i) until `set_draft_vocabulary` is called.
            init.zeros_(module.d2t)
            init.copy_(module.t2d, torch.arange(module.t2d.numel()) < module.d2t.numel())


class _PerThread(threading.local):
    """One value per thread, released when the thread ends; a copied or pickled model starts without any."""

    value = None

    def __reduce__(self):
        return type(self), ()


class Eagle3DraftModel(Eagle3PreTrainedModel):
    """The EAGLE-3 draft: fusion `fc`, one decoder layer (`midlayer`), final `norm` and a reduced-vocabulary `lm_head`.

    Pass it as `assistant_model` to `target.generate` once `hf_eagle3` is imported. With
    `config.share_target_embedding` (the default), the token embedding is the target's, attached by
    `attach_target_embedding` (which `generate` does for you) and never saved with the draft; until then
    `embed_tokens` holds no weight (for Llama-3.1-8B's vocabulary, 1 GB in bfloat16 never allocated). The same holds
    for `lm_head` with `config.share_target_lm_head`.

    `generation_config` holds the draft's own generation settings, as an assistant's does in transformers (where
    `num_assistant_tokens` is read from the assistant's): `tree_depth`, `tree_top_k`, `tree_total_tokens`,
    `tree_shape` and `exact_attention` set there override the config's tree defaults, and are saved as (and loaded
    from) `generation_config.json`.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         device="meta" if config.share_target_embedding else None)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps) for _ in range(3)
            )
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * config.target_hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.extra_layers = nn.ModuleList(Eagle3DecoderLayer(config, i) for i in range(1, config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False,
                                 device="meta" if config.share_target_lm_head else None)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        # Official convention: target id of draft id i is i + d2t[i]; t2d[t] says whether target id t is drafted.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        for name in self._shared_module_names():  # the target's, attached at run time: nothing allocated until then
            getattr(self, name).weight = None
        self.post_init()
        self.generation_config = GenerationConfig()
        self._generation_stats = _PerThread()  # each thread's last `Eagle3GenerationStats` (see `generation_stats`)
        self._target_embedding_attached = not config.share_target_embedding
        self._target_lm_head_attached = not config.share_target_lm_head
        shared = self._shared_module_names()
        if shared:  # the target's modules: neither saved nor read from checkpoints
            self._keys_to_ignore_on_save = {f"{name}.weight" for name in shared}
            self._keys_to_ignore_on_load_unexpected = {rf"^{name}\.weight$" for name in shared}

    # Set by `register_checkpoint_reader` / `register_checkpoint_writer` / `register_pusher` (`import hf_eagle3`
    # registers all three); the remote-code copy of this file, loaded without hf_eagle3, keeps transformers' own
    # behaviour.
    _checkpoint_reader: Callable | None = None
    _checkpoint_writer: Callable | None = None
    _pusher: Callable | None = None

    @classmethod
    def register_checkpoint_reader(cls, reader: Callable) -> None:
        """Let `from_pretrained` load checkpoints saved in other projects' formats, as `AutoConfig.register` lets
        transformers load new model types.

        `reader(source, from_format, hub_kwargs)` returns `(config, state_dict)` of the draft at `source` converted
        in memory, or `None` when `source` is a checkpoint of this class (which the regular loader then reads);
        `hub_kwargs` are the `from_pretrained` arguments that say where a Hub checkpoint's files are.
        """
        cls._checkpoint_reader = staticmethod(reader)

    @classmethod
    def register_checkpoint_writer(cls, writer: Callable) -> None:
        """Let `save_pretrained` write the layout the serving engines load by id.

        `writer(model, save_directory, **kwargs)` saves `model` with `save_pretrained`'s keyword arguments; it may
        call `model.save_pretrained(save_directory, served_layout=False, ...)` for hf-eagle3's own layout.
        """
        cls._checkpoint_writer = staticmethod(writer)

    @classmethod
    def register_pusher(cls, pusher: Callable) -> None:
        """Let `push_to_hub` upload through `pusher(model, repo_id, **kwargs)` (hf_eagle3's adds a model card)."""
        cls._pusher = staticmethod(pusher)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing checkpoints that leave any draft weight uninitialised.

        With a checkpoint reader registered (`import hf_eagle3` registers one), a folder or Hub repo saved in another
        project's format (official EAGLE-3, SpecForge / SGLang, AngelSlim, vLLM speculators, NVIDIA ModelOpt) is
        converted in memory and loaded; `from_format="sglang"` (etc.) names the format where detection cannot settle
        it. The served layout `save_pretrained` writes needs no reader: `Eagle3Config` reads it (so does the
        remote-code copy, which `AutoModel.from_pretrained(..., trust_remote_code=True)` builds from it).
        """
        output_loading_info = kwargs.pop("output_loading_info", False)
        from_format = kwargs.pop("from_format", None)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        hub_kwargs = {name: kwargs[name] for name in _HUB_KWARGS if name in kwargs}
        if cls._checkpoint_reader is not None and source is not None:
            foreign = cls._checkpoint_reader(source, from_format, hub_kwargs)
        elif from_format is not None:
            raise ValueError(
                f"from_format={from_format!r} reads another project's checkpoint, which needs hf-eagle3 (no package "
                "index serves it: `pip install ./hf-eagle3` in a clone of its repository), then "
                "`from hf_eagle3 import Eagle3DraftModel` and load with it."
            )
        else:
            foreign = None
        if foreign is not None:  # loaded from memory by the same code path as a saved draft
            config, state_dict = foreign
            kwargs.pop("pretrained_model_name_or_path", None)
            args, kwargs = (None, *args[1:]), {**kwargs, "config": config, "state_dict": state_dict}
        elif source is not None and isinstance(kwargs.get("config"), PreTrainedConfig) and not isinstance(
            kwargs["config"], cls.config_class
        ):
            # `AutoModel.from_pretrained(..., trust_remote_code=True)` of the served layout (`model_type: llama`) hands
            # over the `LlamaConfig` AutoConfig read: this class's config reads the same file.
            kwargs["config"] = cls.config_class.from_pretrained(source, **hub_kwargs)
        try:
            if foreign is None and source is not None:  # before anything of the config's size is allocated
                _check_stored_shapes(cls, source, kwargs.get("config"), hub_kwargs)
            model, loading_info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except SafetensorError as error:
            raise ValueError(
                f"The weights of the draft at {source!r} cannot be read ({error}): the file is truncated or damaged. "
                "Download or save the draft again."
            ) from error
        missing = set(loading_info["missing_keys"])
        if missing:
            raise _incomplete(source, [f"missing {', '.join(sorted(missing))}"])
        not_finite = [name for name, tensor in model.state_dict().items()
                      if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
        if not_finite:
            raise ValueError(
                f"The checkpoint at {source!r} has NaN or infinite values in {', '.join(not_finite)}: it would draft "
                "garbage. Load a checkpoint saved before training diverged."
            )
        target_ids = model.draft_to_target
        in_vocabulary = bool(((target_ids >= 0) & (target_ids < model.config.vocab_size)).all())
        if not in_vocabulary or target_ids.unique().numel() != target_ids.numel():
            raise ValueError(
                f"The checkpoint at {source!r} maps its draft vocabulary (d2t) to target ids outside [0, "
                f"{model.config.vocab_size}) or to one id twice: convert it with `hf-eagle3 convert`, which checks and "
                "repairs the mapping's order."
            )
        model.generation_config = _saved_generation_config(source, hub_kwargs)
        return (model, loading_info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, served_layout: bool = True, **kwargs):
        """`PreTrainedModel.save_pretrained`, also writing `generation_config.json` when `generation_config` holds
        settings (transformers writes it only for models that generate on their own).

        With a checkpoint writer registered (`import hf_eagle3` registers one), the draft is saved in the layout vLLM
        and SGLang load by id (SpecForge / SGLang `LlamaForCausalLMEagle3`), which `from_pretrained` reads back
        exactly; `served_layout=False` writes hf-eagle3's own layout (`model_type: eagle3`) instead.
        """
        if Path(save_directory).is_file():  # transformers logs this and writes nothing; a caller would not notice
            raise NotADirectoryError(
                f"save_pretrained writes a folder, and {save_directory} is a file: pass a folder's path (it is made "
                "when missing)."
            )
        if served_layout and self._checkpoint_writer is not None:
            return self._checkpoint_writer(self, save_directory, *args, **kwargs)
        super().save_pretrained(save_directory, *args, **kwargs)
        settings = {key for key in self.generation_config.to_diff_dict() if key != "transformers_version"}
        if settings and kwargs.get("is_main_process", True):
            self.generation_config.save_pretrained(save_directory)

    def generate(self, *args, **kwargs):
        """A draft does not generate on its own; transformers' assisted decoding calls this where hf-eagle3 does not
        run the draft, so the error says how to make it."""
        raise TypeError(
            "An EAGLE-3 draft does not generate on its own: it drafts inside its target's generate, "
            "`target.generate(**inputs, assistant_model=draft)`, which needs hf-eagle3 (no package index serves it: "
            "`pip install ./hf-eagle3` in a clone of its repository), then `import hf_eagle3` and load the draft "
            "after the import with `Eagle3DraftModel.from_pretrained`. A draft loaded with trust_remote_code=True is "
            "the checkpoint's own copy of this class (for a draft in the served layout, also after the import), "
            "which hf-eagle3 does not drive."
        )

    def _supports_logits_to_keep(self) -> bool:
        """`forward` takes `logits_to_keep` (transformers' assisted decoding asks before calling `generate`)."""
        return True

    def push_to_hub(self, repo_id: str, **kwargs):
        """The registered pusher's upload (`import hf_eagle3` registers one that writes a model card: target, usage,
        measured results), else `PreTrainedModel.push_to_hub`."""
        if self._pusher is None:
            return super().push_to_hub(repo_id, **kwargs)
        return self._pusher(self, repo_id, **kwargs)

    def _shared_module_names(self) -> list[str]:
        """The draft's modules that are the target's (`embed_tokens`, `lm_head`), as its config says."""
        return [name for name, shared in (("embed_tokens", self.config.share_target_embedding),
                                          ("lm_head", self.config.share_target_lm_head)) if shared]

    def _attached_module_names(self) -> list[str]:
        attached = {"embed_tokens": getattr(self, "_target_embedding_attached", False),
                    "lm_head": getattr(self, "_target_lm_head_attached", False)}
        return [name for name in self._shared_module_names() if attached[name]]

    def _apply(self, fn, recurse=True):
        """`to()`, `half()`, `cuda()`... convert the draft's own tensors, never the target's attached modules."""
        attached = self._attached_module_names()
        if not attached:
            return super()._apply(fn, recurse)
        modules = self._modules
        self._modules = {name: module for name, module in modules.items() if name not in attached}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules = modules

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The draft's own parameters: an attached target embedding or lm_head is the target's, not the draft's (so
        `draft.dtype`, `draft.parameters()` and `draft.requires_grad_()` leave it alone)."""
        hidden = {f"{prefix}.{name}.weight" if prefix else f"{name}.weight" for name in self._attached_module_names()}
        for name, parameter in super().named_parameters(prefix, recurse, remove_duplicate):
            if name not in hidden:
                yield name, parameter

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.embed_tokens = value

    def attach_target_embedding(self, embedding: nn.Embedding) -> None:
        """Share `embedding` (the target's input embedding) as the draft's token embedding; nothing is copied."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(embedding.weight.shape) != expected:
            raise ValueError(
                f"The target's input embedding has shape {tuple(embedding.weight.shape)}, the draft expects "
                f"{expected} (vocab_size, hidden_size). This draft was not made for this target."
            )
        self.embed_tokens.weight = embedding.weight
        self._target_embedding_attached = True

    def attach_target_lm_head(self, lm_head: nn.Linear) -> None:
        """Share `lm_head` (the target's output layer) as the draft's head (`share_target_lm_head`); nothing is
        copied."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head.weight.shape) != expected or getattr(lm_head, "bias", None) is not None:
            raise ValueError(
                f"The target's lm_head has shape {tuple(lm_head.weight.shape)}"
                f"{' and a bias' if getattr(lm_head, 'bias', None) is not None else ''}; the draft expects {expected} "
                "(vocab_size, hidden_size) without bias. This draft was not made for this target."
            )
        self.lm_head.weight = lm_head.weight
        self._target_lm_head_attached = True

    def attach_target(self, target: PreTrainedModel) -> None:
        """Share the target's modules the draft's config says it shares (input embedding, lm_head); nothing is
        copied, and what is attached already stays."""
        if self.config.share_target_embedding and self.embed_tokens.weight is not target.get_input_embeddings().weight:
            self.attach_target_embedding(target.get_input_embeddings())
        if self.config.share_target_lm_head and self.lm_head.weight is not target.get_output_embeddings().weight:
            self.attach_target_lm_head(target.get_output_embeddings())

    def check_target_attached(self) -> None:
        """Raise unless the target's modules this draft shares are attached."""
        missing = [name for name in self._shared_module_names() if name not in self._attached_module_names()]
        if missing:
            what = " and ".join({"embed_tokens": "token embedding", "lm_head": "lm_head"}[name] for name in missing)
            raise RuntimeError(
                f"This draft shares the target's {what}, which is not attached yet: call `draft.attach_target(target)`"
                ", or pass the draft to `target.generate(..., assistant_model=draft)`, which attaches it."
            )

    def set_draft_vocabulary(self, target_token_ids: torch.Tensor) -> None:
        """Set the reduced vocabulary from the `draft_vocab_size` distinct target ids it predicts (any order)."""
        ids = torch.as_tensor(target_token_ids, dtype=torch.long, device=self.d2t.device).flatten().unique(sorted=True)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"The draft vocabulary needs {self.config.draft_vocab_size} distinct token ids, got {ids.numel()}."
            )
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"Draft vocabulary ids must lie in [0, {self.config.vocab_size}).")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    @property
    def generation_stats(self):
        """What this thread's last EAGLE-3 `generate` call with this draft did (an
        `hf_eagle3.decoding.stats.Eagle3GenerationStats`), `None` before its first: threads sharing one draft each read
        their own call's, and a thread's is released when the thread ends. `generate(..., return_dict_in_generate=True)`
        returns it too, as `output.eagle3_stats`."""
        return self._generation_stats.value

    @generation_stats.setter
    def generation_stats(self, stats) -> None:
        self._generation_stats.value = stats

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of every draft vocabulary entry, `[draft_vocab_size]`."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def fuse(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """Target features `[l ; m ; h]` of shape `[B, T, 3 k_t]` -> fused feature `g`, `[B, T, k]`."""
        if self.config.fc_norm:
            captures = target_hidden_states.chunk(3, dim=-1)
            target_hidden_states = torch.cat([norm(capture) for norm, capture in zip(self.fc_norm, captures)], dim=-1)
        if self.config.norm_before_fc:
            target_hidden_states = self.input_norm(target_hidden_states)
        return self.fc(target_hidden_states)

    @property
    def decoder_layers(self) -> list[Eagle3DecoderLayer]:
        """`midlayer`, then the `extra_layers`: the decoder layers in the order they run."""
        return [self.midlayer, *self.extra_layers]

    def output_feature(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's output `[B, T, k]` -> the feature `a` fed back at the next draft step (the output
        itself, or its final norm with `norm_output`)."""
        return self.norm(hidden_states) if self.config.norm_output else hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft features `a` `[B, T, k]` -> logits over the draft vocabulary `[B, T, draft_vocab_size]`."""
        return self.lm_head(hidden_states if self.config.norm_output else self.norm(hidden_states))

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> Eagle3DraftOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`):
                Target-vocabulary ids of the token *following* each position's feature.
            hidden_states (`torch.Tensor` of shape `(batch_size, seq_len, 3 * target_hidden_size | hidden_size)`):
                Target features `[l ; m ; h]` (fused through `fc`) or the draft's own output features `a`.
            position_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`, *optional*):
                RoPE positions; default: consecutive after the cached positions.
            attention_mask (`torch.Tensor` of shape `(batch_size, 1, seq_len, past_len + seq_len)`, *optional*):
                Which keys each query sees: boolean (`True` = attend) or additive float. Default: causal. Tree
                expansion passes the tree's ancestor mask here.
            cache (`Cache`, *optional*):
                The draft's own key / value cache; created when `use_cache` and absent.
            logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
                Compute logits for the last `logits_to_keep` positions only (0: all); a 1-D tensor: for the positions
                it lists (empty: none), as transformers' models take it.
        """
        self.check_target_attached()
        hidden_states = hidden_states.to(self.fc.weight.dtype)  # target features may come in the target's dtype
        width = hidden_states.shape[-1]
        if width == 3 * self.config.target_hidden_size:
            hidden_states = self.fuse(hidden_states)
        elif width != self.config.hidden_size:
            raise ValueError(
                f"hidden_states must hold target features (width 3 * {self.config.target_hidden_size}) or draft "
                f"features (width {self.config.hidden_size}), got width {width}."
            )
        if use_cache and cache is None:
            cache = DynamicCache()
        past_length = cache.get_seq_length() if cache is not None else 0
        query_length = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + query_length, device=input_ids.device)[None]
        inputs_embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)
        attention_mask = _additive_mask(attention_mask, query_length, past_length, hidden_states)

        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        windowed_mask = None
        if self.config.sliding_window is not None:
            if past_length == 0 and bool((position_ids[..., 0] != 0).any()):
                raise ValueError(
                    "Sliding-window draft layers take a key's position from its place in the cache: a sequence fed "
                    "to an empty cache must start at position 0."
                )
            windowed_mask = _windowed(
                attention_mask, position_ids, past_length + query_length, self.config.sliding_window, hidden_states
            )
        for layer in self.decoder_layers:
            mask = windowed_mask if layer.self_attn.sliding_window is not None else attention_mask
            hidden_states = layer(inputs_embeds, hidden_states, position_embeddings, mask, cache)
        hidden_states = self.output_feature(hidden_states)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.compute_logits(hidden_states[:, kept])
        return Eagle3DraftOutput(logits=logits, hidden_states=hidden_states, cache=cache)


def _windowed(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor, key_length: int, window: int, like: torch.Tensor
) -> torch.Tensor:
    """`attention_mask` (additive, or `None` for a single query seeing every key) restricted to a sliding window.

    A key's position is its index in the cache (sequences start at position 0): exact for the verified prefix, and an
    upper bound for speculative tree entries, which all lie within the tree's depth of the query (shallower than any
    window in use).
    """
    key_positions = torch.arange(key_length, device=like.device)
    outside = key_positions[None, None, None, :] <= position_ids[:, None, :, None] - window  # [B, 1, T, K]
    base = attention_mask if attention_mask is not None else torch.zeros((), dtype=like.dtype, device=like.device)
    return base.masked_fill(outside, torch.finfo(like.dtype).min)


def _incomplete(source, problems: list[str]) -> ValueError:
    return ValueError(
        f"The checkpoint at {source!r} does not hold a complete Eagle3DraftModel ({'; '.join(problems)}). Its "
        "weights do not match its config: save or download the draft again (a checkpoint of another project "
        "loads directly only with that project's own config.json)."
    )


def _check_stored_shapes(cls, source, config, hub_kwargs: dict) -> None:
    """Refuse a checkpoint whose stored tensors have other shapes than its config gives them, from the safetensors
    headers and a model built on the meta device, so that a config claiming huge sizes allocates nothing. A
    checkpoint whose weights are no safetensors file is left to the loader."""
    index = cached_file(source, SAFE_WEIGHTS_INDEX_NAME, _raise_exceptions_for_missing_entries=False,
                        _raise_exceptions_for_connection_errors=False, **hub_kwargs)
    if index:
        names = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        files = [Path(index).parent / name for name in names]
    else:
        single = cached_file(source, SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False,
                             _raise_exceptions_for_connection_errors=False, **hub_kwargs)
        files = [Path(single)] if single else []
    stored = {}
    for path in files:
        if path.is_file():
            with safe_open(path, framework="pt") as weights:
                stored |= {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    if not stored:
        return
    if not isinstance(config, cls.config_class):
        config = cls.config_class.from_pretrained(source, **hub_kwargs)
    with torch.device("meta"):
        expected = {name: tuple(tensor.shape) for name, tensor in cls(config).state_dict().items()}
    mismatched = [f"{name} {stored[name]} (its config expects {shape})" for name, shape in sorted(expected.items())
                  if name in stored and stored[name] != shape]
    if mismatched:
        raise _incomplete(source, [f"wrong shape {', '.join(mismatched)}"])


# `from_pretrained` arguments that say where a checkpoint's files are.
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


def _saved_generation_config(source, hub_kwargs: dict) -> GenerationConfig:
    """The draft's `generation_config.json` where its folder or Hub repo has one, else an empty config."""
    path = cached_file(source, GENERATION_CONFIG_NAME, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **hub_kwargs)
    return GenerationConfig.from_pretrained(Path(path).parent) if path else GenerationConfig()


def _additive_mask(
    attention_mask: torch.Tensor | None, query_length: int, past_length: int, like: torch.Tensor
) -> torch.Tensor | None:
    """The float mask (0 = attend, dtype minimum = masked) every attention backend reads the same way.

    `None` stays `None` for a single query (it sees every cached key); otherwise `None` means causal.
    """
    if attention_mask is None:
        if query_length == 1:
            return None
        key_positions = torch.arange(past_length + query_length, device=like.device)
        query_positions = torch.arange(past_length, past_length + query_length, device=like.device)
        attention_mask = (key_positions[None, :] <= query_positions[:, None])[None, None]
    if attention_mask.dtype == torch.bool:  # built in `like`'s dtype: a float32 minimum would not hold float64's
        return torch.zeros(attention_mask.shape, dtype=like.dtype, device=like.device).masked_fill(
            ~attention_mask, torch.finfo(like.dtype).min)
    return attention_mask.to(like.dtype)


__all__ = ["Eagle3DraftModel", "Eagle3DraftOutput", "Eagle3PreTrainedModel"]
