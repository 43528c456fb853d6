"""One training step of a Llama-3.1-8B-shaped draft on CPU: peak host memory and tokens per second.

The draft has one decoder layer (hidden 4096, 32 heads, 8 key / value heads, MLP 14336), a 32,000-token vocabulary
and the target's 128,256-token embedding; the target's features, final hidden states and output layer are random.
A step is what `hf-eagle3 train` does per batch: the target's distributions from its final hidden states, the
training-time test's forward and backward, gradient clipping and an AdamW step. Every token is an assistant token.

    OMP_NUM_THREADS=2 python benchmarks/train_step_memory.py --length 2048

prints one JSON line. Peak memory is the process's peak resident set (`ru_maxrss`), the weights and optimizer
included; the address space is capped at `--cap-gib`, so a step that needs more fails with its error printed.
"""

import argparse
import json
import resource
import time

import torch
from torch import nn

from hf_eagle3.modeling_eagle3 import Eagle3Config, Eagle3DraftModel
from hf_eagle3.training.ttt import TrainingTimeTest, target_distribution

VOCAB, DRAFT_VOCAB, HIDDEN = 128256, 32000, 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--cap-gib", type=float, default=18.0)
    args = parser.parse_args()
    cap = int(args.cap_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.manual_seed(0)
    config = Eagle3Config(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, hidden_size=HIDDEN,
                          intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          target_num_hidden_layers=32, max_position_embeddings=8192, rope_theta=500000.0)
    draft = Eagle3DraftModel(config)
    draft.attach_target_embedding(nn.Embedding(VOCAB, HIDDEN))
    draft.embed_tokens.weight.requires_grad_(False)
    draft.set_draft_vocabulary(torch.randperm(VOCAB)[:DRAFT_VOCAB])
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    ttt = TrainingTimeTest(draft, steps=args.ttt_steps).train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    input_ids = torch.randint(0, VOCAB, (1, args.length))
    features, final_hidden = torch.randn(1, args.length, 3 * HIDDEN), torch.randn(1, args.length, HIDDEN)
    loss_mask = torch.ones(1, args.length, dtype=torch.long)
    result = {"setup_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    started = time.perf_counter()
    try:
        target_probs, target_top1 = target_distribution(final_hidden, lm_head, draft.draft_to_target)
        output = ttt(input_ids, features, target_probs, target_top1, loss_mask)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        seconds = time.perf_counter() - started
        result |= {"loss": output.loss.item(), "seconds": seconds, "tokens_per_second": args.length / seconds}
    except (RuntimeError, MemoryError) as error:
        result |= {"error": str(error)[:200], "seconds": time.perf_counter() - started}
    result |= {"length": args.length, "ttt_steps": args.ttt_steps, "threads": torch.get_num_threads(),
               "peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
               "cap_gib": args.cap_gib}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
