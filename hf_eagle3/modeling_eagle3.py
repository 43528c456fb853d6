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
`hidden_norm(x)` instead of `x` (`x = hidden_norm(x)` before the attention block).

Weight names match the official and SpecForge checkpoints (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).
This file only imports torch, transformers and safetensors (a transformers dependency), so it also serves as the
remote code of saved checkpoints.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
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
from transformers.utils import GENERATION_CONFIG_NAME, ModelOutput, cached_file

from .configuration_eagle3 import Eagle3Config


class Eagle3Attention(nn.Module):
    """Grouped-query self-attention whose q / k / v projections read the 2k-wide `[embedding ; feature]` input."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.layer_idx = 0
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        in_features, bias = 2 * config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(in_features, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[B, T, 2k]` input -> rotated queries `[B, H, T, D]`, rotated keys and values `[B, KV, T, D]`."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
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
    """A Llama decoder layer with two input streams: the token embedding and the feature (residual) stream."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # normalises the embedding
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # normalises the feature
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(
        self, inputs_embeds: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`([input_layernorm(embedding) ; hidden_norm(feature)]` `[B, T, 2k]`, what q / k / v read, and the residual
        `[B, T, k]`: the feature itself, or its normalised form with `norm_before_residual`)."""
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
            The draft's output features `a` (before the final norm), fed back as input at the next draft step.
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
        super()._init_weights(module)
        if isinstance(module, Eagle3DraftModel):
            # Identity vocabulary (draft id i = target id i) until `set_draft_vocabulary` is called.
            init.zeros_(module.d2t)
            init.copy_(module.t2d, torch.arange(module.t2d.numel()) < module.d2t.numel())


class Eagle3DraftModel(Eagle3PreTrainedModel):
    """The EAGLE-3 draft: fusion `fc`, one decoder layer (`midlayer`), final `norm` and a reduced-vocabulary `lm_head`.

    Pass it as `assistant_model` to `target.generate` once `hf_eagle3` is imported. With
    `config.share_target_embedding` (the default), the token embedding is the target's, attached by
    `attach_target_embedding` (which `generate` does for you) and never saved with the draft.

    `generation_config` holds the draft's own generation settings, as an assistant's does in transformers (where
    `num_assistant_tokens` is read from the assistant's): `tree_depth`, `tree_top_k`, `tree_total_tokens`,
    `tree_shape` and `exact_attention` set there override the config's tree defaults, and are saved as (and loaded
    from) `generation_config.json`.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps) for _ in range(3)
            )
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        # Official convention: target id of draft id i is i + d2t[i]; t2d[t] says whether target id t is drafted.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.post_init()
        self.generation_config = GenerationConfig()
        self._generation_stats_of_thread = {}  # thread id -> `Eagle3GenerationStats` (see `generation_stats`)
        self._target_embedding_attached = not config.share_target_embedding
        if config.share_target_embedding:  # the target's embedding: neither saved nor expected in checkpoints
            self._keys_to_ignore_on_save = {"embed_tokens.weight"}
            self._keys_to_ignore_on_load_missing = {r"^embed_tokens\.weight$"}

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing checkpoints that leave any draft weight uninitialised."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        try:
            model, loading_info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except SafetensorError as error:
            raise ValueError(
                f"The weights of the draft at {source!r} cannot be read ({error}): the file is truncated or damaged. "
                "Download or save the draft again."
            ) from error
        missing = set(loading_info["missing_keys"])
        if model.config.share_target_embedding:
            missing.discard("embed_tokens.weight")
        mismatched = loading_info.get("mismatched_keys") or []
        if missing or mismatched:
            raise ValueError(
                f"The checkpoint at {source!r} does not hold a complete Eagle3DraftModel: missing {sorted(missing)}, "
                f"wrong shape {sorted(mismatched)}. Convert foreign checkpoints with `hf-eagle3 convert` instead of "
                "loading them directly."
            )
        target_ids = model.draft_to_target
        in_vocabulary = bool(((target_ids >= 0) & (target_ids < model.config.vocab_size)).all())
        if not in_vocabulary or target_ids.unique().numel() != target_ids.numel():
            raise ValueError(
                f"The checkpoint at {source!r} maps its draft vocabulary (d2t) to target ids outside [0, "
                f"{model.config.vocab_size}) or to one id twice: convert it with `hf-eagle3 convert`, which checks and "
                "repairs the mapping's order."
            )
        model.generation_config = _saved_generation_config(source, kwargs)
        return (model, loading_info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, also writing `generation_config.json` when `generation_config` holds
        settings (transformers writes it only for models that generate on their own)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        settings = {key for key in self.generation_config.to_diff_dict() if key != "transformers_version"}
        if settings and kwargs.get("is_main_process", True):
            self.generation_config.save_pretrained(save_directory)

    def generate(self, *args, **kwargs):
        """A draft does not generate on its own; transformers' assisted decoding calls this where hf-eagle3 does not
        run the draft, so the error says how to make it."""
        raise TypeError(
            "An EAGLE-3 draft does not generate on its own: it drafts inside its target's generate, "
            "`target.generate(**inputs, assistant_model=draft)`, which needs hf-eagle3: `pip install hf-eagle3`, then "
            "`import hf_eagle3` and load the draft after the import (`Eagle3DraftModel.from_pretrained` or "
            "`AutoModel.from_pretrained`). A draft loaded before it with trust_remote_code=True is the checkpoint's "
            "own copy of this class, which hf-eagle3 does not drive."
        )

    def _supports_logits_to_keep(self) -> bool:
        """`forward` takes `logits_to_keep` (transformers' assisted decoding asks before calling `generate`)."""
        return True

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the draft with a generated model card (target, usage, measured results): `hf_eagle3.hub.push_draft`."""
        # hf_eagle3 is not part of the remote code saved with the draft: inside `try`, transformers' import check of
        # remote code skips this import.
        try:
            from hf_eagle3.hub import push_draft
        except ImportError as error:
            raise ImportError("Pushing an EAGLE-3 draft with its model card needs `pip install hf-eagle3`.") from error
        return push_draft(self, repo_id, **kwargs)

    def _shares_attached_embedding(self) -> bool:
        return self.config.share_target_embedding and getattr(self, "_target_embedding_attached", False)

    def _apply(self, fn, recurse=True):
        """`to()`, `half()`, `cuda()`... convert the draft's own tensors, never the target's attached embedding."""
        if not self._shares_attached_embedding():
            return super()._apply(fn, recurse)
        modules = self._modules
        self._modules = {name: module for name, module in modules.items() if name != "embed_tokens"}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules = modules

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The draft's own parameters: an attached target embedding is the target's, not the draft's (so
        `draft.dtype`, `draft.parameters()` and `draft.requires_grad_()` leave it alone)."""
        shared = f"{prefix}.embed_tokens.weight" if prefix else "embed_tokens.weight"
        hide = self._shares_attached_embedding()
        for name, parameter in super().named_parameters(prefix, recurse, remove_duplicate):
            if not (hide and name == shared):
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

    def set_draft_vocabulary(self, target_token_ids: torch.Tensor) -> None:
        """Set the reduced vocabulary from the `draft_vocab_size` distinct target ids it predicts (any order)."""
        ids = torch.as_tensor(target_token_ids, dtype=torch.long).flatten().unique(sorted=True)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"The draft vocabulary needs {self.config.draft_vocab_size} distinct token ids, got {ids.numel()}."
            )
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"Draft vocabulary ids must lie in [0, {self.config.vocab_size}).")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    @property
    def generation_stats(self):
        """What this thread's last EAGLE-3 `generate` call with this draft did (an
        `hf_eagle3.generation.Eagle3GenerationStats`), `None` before its first: threads sharing one draft each read
        their own call's. `generate(..., return_dict_in_generate=True)` also returns it, as `output.eagle3_stats`."""
        return self._generation_stats_of_thread.get(threading.get_ident())

    @generation_stats.setter
    def generation_stats(self, stats) -> None:
        self._generation_stats_of_thread[threading.get_ident()] = stats

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of every draft vocabulary entry, `[draft_vocab_size]`."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def fuse(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """Target features `[l ; m ; h]` of shape `[B, T, 3 k_t]` -> fused feature `g`, `[B, T, k]`."""
        if self.config.fc_norm:
            captures = target_hidden_states.chunk(3, dim=-1)
            target_hidden_states = torch.cat([norm(capture) for norm, capture in zip(self.fc_norm, captures)], dim=-1)
        return self.fc(target_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft features `a` `[B, T, k]` -> logits over the draft vocabulary `[B, T, draft_vocab_size]`."""
        return self.lm_head(self.norm(hidden_states))

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
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
            logits_to_keep (`int`, *optional*, defaults to 0):
                Compute logits for the last `logits_to_keep` positions only (0: all).
        """
        if not self._target_embedding_attached:
            raise RuntimeError(
                "This draft shares the target's token embedding, which is not attached yet: call "
                "`draft.attach_target_embedding(target.get_input_embeddings())`, or pass the draft to "
                "`target.generate(..., assistant_model=draft)`, which attaches it."
            )
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
        hidden_states = self.midlayer(inputs_embeds, hidden_states, position_embeddings, attention_mask, cache)
        logits = self.compute_logits(hidden_states[:, -logits_to_keep:])
        return Eagle3DraftOutput(logits=logits, hidden_states=hidden_states, cache=cache)


def _saved_generation_config(source, from_pretrained_kwargs: dict) -> GenerationConfig:
    """The draft's `generation_config.json` where its folder or Hub repo has one, else an empty config."""
    download = {name: from_pretrained_kwargs[name] for name in (
        "cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
        if name in from_pretrained_kwargs}
    path = cached_file(source, GENERATION_CONFIG_NAME, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **download)
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
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, 0.0, torch.finfo(like.dtype).min).to(like.dtype)
    return attention_mask.to(like.dtype)


__all__ = ["Eagle3DraftModel", "Eagle3DraftOutput", "Eagle3PreTrainedModel"]
