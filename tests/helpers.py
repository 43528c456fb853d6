"""Test helpers: tiny random transformers targets, EAGLE-3 drafts that fit them, and the exact sampling distribution
of a target small enough to enumerate. Fixtures built from these live in conftest.py."""

import hashlib

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_eagle3  # noqa: F401  (installs the generate hooks)
from hf_eagle3 import Eagle3Config, Eagle3DraftModel
from hf_eagle3.decoding.tree import DraftTree
from hf_eagle3.decoding.verify import greedy_paths

VOCAB = 96
HIDDEN = 32
LAYERS = 8
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
TARGET_FAMILIES = {
    "llama": lambda fields: LlamaForCausalLM(LlamaConfig(**fields)),
    "qwen2": lambda fields: Qwen2ForCausalLM(Qwen2Config(**fields, use_sliding_window=False)),
    "qwen3": lambda fields: Qwen3ForCausalLM(Qwen3Config(**fields, head_dim=8, use_sliding_window=False)),
    "mistral": lambda fields: MistralForCausalLM(MistralConfig(**fields, sliding_window=None)),
}
# Sliding-window targets, with a window far shorter than the test sequences so that it matters
WINDOW = 5
SLIDING_TARGETS = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_TINY, sliding_window=WINDOW)),
    # Qwen: layers 0-3 full attention, 4-7 sliding (the model takes one mask per kind of layer)
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_TINY, use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=4)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_TINY, head_dim=8, use_sliding_window=True,
                                                  sliding_window=WINDOW, max_window_layers=4)),
}


def tiny_target(family: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", vocab_size: int = VOCAB,
                key_value_heads: int = 2):
    """4 query heads over `key_value_heads` key/value heads (2: grouped-query attention; 4: one key/value head each)."""
    torch.manual_seed(seed)
    model = TARGET_FAMILIES[family](_TINY | {"vocab_size": vocab_size, "num_key_value_heads": key_value_heads})
    model.config._attn_implementation = attn_implementation
    return model.eval()


def sliding_target(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return SLIDING_TARGETS[family]().eval()


def tiny_draft(seed: int = 0, draft_vocab_size: int = 64, vocab_size: int = VOCAB, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    config = Eagle3Config(
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_num_hidden_layers=LAYERS,
        max_position_embeddings=512,
        **({"tree_depth": 4, "tree_top_k": 3, "tree_total_tokens": 12} | overrides),
    )
    draft = Eagle3DraftModel(config).eval()
    draft.set_draft_vocabulary(torch.randperm(vocab_size)[:draft_vocab_size])
    return draft


_FITTED: dict[str, dict[str, torch.Tensor]] = {}  # fingerprint of (draft, target, steps, seed) -> fitted weights


def fit_draft(draft: Eagle3DraftModel, target, steps: int = 200, seed: int = 0) -> Eagle3DraftModel:
    """`draft`, fitted to `target` by a few hundred steps of plain next-token fitting on the target's own greedy
    continuations, so that it accepts tokens (a random draft accepts none). Test scaffolding only;
    `hf_eagle3.training.trainer` is the real trainer.

    Each fit is run once per test session: a later call with the same draft, target (weights and config), steps and
    seed loads the fitted weights into the fresh `draft` it is given. The fit leaves the global random state alone."""
    key = _fingerprint(draft, target, steps, seed)
    draft.attach_target_embedding(target.get_input_embeddings())
    if key not in _FITTED:
        with torch.random.fork_rng(devices=[]):
            _fit(draft, target, steps, seed)
        _FITTED[key] = {name: tensor.clone() for name, tensor in draft.state_dict().items()
                        if not name.startswith("embed_tokens.")}  # the target's own embedding
    draft.load_state_dict(_FITTED[key], strict=False)
    return draft.eval()


def _fit(draft: Eagle3DraftModel, target, steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    draft.set_draft_vocabulary(torch.arange(draft.config.draft_vocab_size))
    prompts = torch.randint(1, draft.config.draft_vocab_size, (16, 6))
    with torch.no_grad():
        sequences = target.generate(prompts, max_new_tokens=40, do_sample=False,
                                    attention_mask=torch.ones_like(prompts))
        hidden = target(sequences, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in draft.config.target_layer_ids], dim=-1)
    labels = sequences[:, 2:]
    in_vocab = labels < draft.config.draft_vocab_size
    trainable = [p for name, p in draft.named_parameters() if not name.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    draft.train()
    for _ in range(steps):
        logits = draft(sequences[:, 1:-1], features[:, :-2], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[in_vocab], labels[in_vocab])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _fingerprint(*parts) -> str:
    """A hash of models (their configs, generation configs, attention implementation and every weight) and values."""
    hasher = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.nn.Module):
            hasher.update(part.config.to_json_string().encode())
            hasher.update(part.generation_config.to_json_string().encode())
            hasher.update(str(part.config._attn_implementation).encode())
            for name, tensor in part.state_dict().items():
                hasher.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
                hasher.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        else:
            hasher.update(repr(part).encode())
    return hasher.hexdigest()


# The exact sampling distribution of a target over a vocabulary small enough to enumerate every 3-token continuation
SAMPLING_VOCAB = 32
SAMPLES = 1200
SETTINGS = {
    "temperature-0.7": dict(temperature=0.7),
    "temperature-1.0": dict(temperature=1.0),
    "top-p-0.9": dict(temperature=1.0, top_p=0.9),
    "top-k-20": dict(temperature=1.0, top_k=20),
}


def peaked_target():
    """A tiny Llama over `SAMPLING_VOCAB` tokens whose distributions are peaked: most mass in few cells, as in real
    LMs."""
    model = tiny_target(vocab_size=SAMPLING_VOCAB, seed=7)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def _warpers(settings: dict) -> LogitsProcessorList:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])])
    if "repetition_penalty" in settings:  # as generate orders them: the penalty before the warpers
        warpers.insert(0, RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    if "top_k" in settings:
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    return warpers


@torch.no_grad()
def exact_joint(target, settings: dict, prompt: torch.Tensor) -> torch.Tensor:
    """`[V, V, V]` probability of each 3-token continuation of `prompt` under plain sampling."""
    warpers = _warpers(settings)
    vocab = target.config.vocab_size

    def next_probs(sequences: torch.Tensor) -> torch.Tensor:
        logits = target(sequences).logits[:, -1].float()
        return warpers(sequences, logits).softmax(-1)

    first = next_probs(prompt)[0]  # [V]
    tokens = torch.arange(vocab)
    one = torch.cat([prompt.expand(vocab, -1), tokens[:, None]], dim=1)  # [V, L + 1]
    second = next_probs(one)  # [V, V]
    two = torch.cat([one.repeat_interleave(vocab, 0), tokens.repeat(vocab)[:, None]], dim=1)  # [V^2, L + 2]
    third = next_probs(two).view(vocab, vocab, vocab)
    return first[:, None, None] * second[:, :, None] * third


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of `counts` to `probs`, cells expecting fewer than 5 pooled into one."""
    expected = probs.flatten().double() * counts.sum()
    observed = counts.flatten().double()
    kept = expected >= 5
    expected = torch.cat([expected[kept], expected[~kept].sum()[None]])
    observed = torch.cat([observed[kept], observed[~kept].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    degrees = kept.sum().item()  # (cells - 1) with the pooled cell
    return torch.special.gammaincc(torch.tensor(degrees / 2.0), statistic / 2.0).item()


def greedy_path(tree: DraftTree, target_choices: torch.Tensor) -> torch.Tensor:
    """`verify.greedy_paths` of one tree without a batch dimension: its accepted node indices, root first."""
    batched = DraftTree(tree.tokens[None], tree.parents[None], tree.depths[None], tree.ancestors[None],
                        tree.candidate_ids[None], tree.candidate_rank_keys[None], tree.candidate_depths[None],
                        tree.max_depth)
    lengths, path = greedy_paths(batched, target_choices[None])
    return path[0, : int(lengths[0])]
