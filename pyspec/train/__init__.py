"""Training DSpark drafters for pyspec (`pyspec-train-drafter`, needs PyTorch: `pip install
'pyspec[train]'`).

A DSpark drafter (reference shared/docs/reference/dflash-dspark.md §1, §2, §8): block size 7 in
the anchor-first layout (sample_from_anchor = true: slot k of the block [anchor, MASK x 6] predicts
the token at anchor + k + 1), Qwen3-style layers of the target's hidden size that attend to fused
target features (fc over the concatenated layer inputs of ~5 target layers spread over its depth)
and to the block, the target's embedding and head (shared, frozen, not stored in the drafter),
a vanilla low-rank Markov head and a confidence head. The target is a frozen GGUF dequantized
into torch (`target.py`), run as pyspec's engine runs it.

Modules: target (GGUF -> torch target, its forward with layer inputs, KV-cached generation),
data (prompts from Python's own documentation and sources, continued by the target), drafter
(the torch drafter, identical to csrc/model/dflash.cpp, and its Hugging Face checkpoint), loss
(0.1·CE + 0.9·L1 + BCE on the confidence head, weights exp(-k/4)), shards (generated data as
carryable data-*.npz files), validation (the held-out split and its proxies), loop (training,
resumable checkpoints, best-by-validation hf/, conversion), cli (the command line).

Mask token. Every vocabulary row of SmolLM2 is a real token, so there is no free row for the
mask. We reuse a rarely used id rather than a trained mask embedding: with a trained embedding
the converter must give the drafter its own patched copy of token_embd plus the target's output
matrix (2 x 49152 x 576 values, more than the whole rest of the drafter), while a reused id costs
nothing and the drafter's layers learn to read that (frozen) embedding as "mask" - DFlash's own
mask token is likewise an untrained special token with a frozen embedding. Block slots 1.. are
always the mask, and the one real token of a block is at slot 0, so a (rare) anchor equal to the
mask id is still told apart by its position. The id: a '<|mask|>'-like token if the vocabulary
has one, else the last control token (GGUF token type 3) that is not BOS/EOS/EOT/PAD/UNK or a
chat marker (SmolLM2: 16, '<empty_output>', which chat never produces), else the last id;
--mask-token-id overrides it. It is written to config.json as mask_token_id and to the GGUF as
tokenizer.ggml.mask_token_id.
"""

__all__ = ["main"]


def main(argv=None) -> int:
    from .cli import main as _main
    return _main(argv)
