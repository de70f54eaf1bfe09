#!/usr/bin/env python3
"""Cut a DSpark drafter's draft vocabulary to the ids its target generates most, without training.

A reduced-vocabulary drafter (a `d2t` map) reads its output head and its Markov head's second
matrix (`markov_w2`) once per draft row: on the CPU those rows are a large part of a drafting
pass. This keeps `--keep` of its draft ids: the ones the target itself generated most often,
counted by decoding prompts made like the training data's (pyspec.train.data.prompt_requests:
text that ships with Python and synthesised requests, never evaluation prompts) with pyspec's
engine, two in three greedily and one in three sampled at T 0.8, ties broken by how often the id
appears in the prompts, then by the smaller id; the target's end-of-generation ids are always
kept. The output head's and markov_w2's rows and `d2t` are cut to those ids (in ascending id
order, as d2t is); every other tensor and key is copied byte for byte. A draft whose best id was
dropped becomes the best kept one, which the target would then rarely have chosen.

    python tools/shrink_draft_vocab.py --drafter IN.gguf --out OUT.gguf --keep 4096 [--model T.gguf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Sequence

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUT_ROWS = ("output.weight", "markov_w2.weight")   # [n_embd or rank, n_draft_vocab]: rows per id


def target_counts(model_path: str, n_prompts: int, n_tokens: int, seed: int, threads: int):
    """(generated, prompt) token counts over the target's own continuations of n_prompts
    training-style prompts."""
    import pyspec
    from pyspec import _core
    from pyspec.chat import ChatTemplate
    from pyspec.tokenizer import Tokenizer
    from pyspec.train.data import prompt_requests

    model = pyspec.Model(model_path, n_threads=threads)
    tok = Tokenizer.from_gguf(model_path)
    template = ChatTemplate.from_tokenizer(tok)
    prompts: List[List[int]] = []
    for kind, text, _ in prompt_requests(seed=seed):
        if len(prompts) >= n_prompts:
            break
        if kind == "chat":
            rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
            ids = tok.encode(rendered, add_special=True, parse_special=True)
        else:
            ids = tok.encode(text, add_special=True)
        if len(ids) + n_tokens < 1024:
            prompts.append(ids)
    n_seq = 4
    engine = _core.SpecEngine(model._model, None, n_ctx=1024 * n_seq, n_seq_max=n_seq, n_threads=threads,
                              prefill_chunk=512)
    eog = sorted(int(t) for t in tok.eog_ids)
    gen = np.zeros(model.n_vocab, np.int64)
    prm = np.zeros(model.n_vocab, np.int64)
    nxt = 0
    while nxt < len(prompts) or engine.n_requests:
        while engine.n_requests < n_seq and nxt < len(prompts):
            opts = (dict(temperature=0.0, verify="greedy") if nxt % 3 else
                    dict(temperature=0.8, seed=seed + nxt, verify="rejection"))
            engine.add_request(nxt, prompts[nxt], max_tokens=n_tokens, stop_ids=eog, draft=False, **opts)
            prm += np.bincount(prompts[nxt], minlength=model.n_vocab)[:model.n_vocab]
            nxt += 1
        for o in engine.step():
            if o["tokens"]:
                gen += np.bincount(o["tokens"], minlength=model.n_vocab)[:model.n_vocab]
    return gen, prm, set(eog)


def kept_positions(d2t: np.ndarray, gen: np.ndarray, prm: np.ndarray, always: set, keep: int) -> np.ndarray:
    """Positions in d2t of the ids to keep, ascending (so the cut d2t stays ascending)."""
    score = gen[d2t].astype(np.float64) * (1 << 20) + np.minimum(prm[d2t], (1 << 20) - 1)
    score[[i for i, t in enumerate(d2t.tolist()) if t in always]] = np.inf
    order = np.lexsort((d2t, -score))   # score descending, then the smaller id
    return np.sort(order[:keep])


def write_cut(src: str, dst: str, keep_pos: np.ndarray) -> None:
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name in CUT_ROWS:
            data = data.reshape(int(t.shape[1]), -1)[keep_pos]
        elif t.name == "d2t":
            data = data[keep_pos]
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                             gguf.GGMLQuantizationType.I32, gguf.GGMLQuantizationType.I64):
            w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
        else:   # quantized rows: bytes, one row of blocks per id
            rows = data.shape[0] if data.ndim > 1 else 1
            w.add_tensor(t.name, np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True, help="a DSpark/DFlash drafter GGUF with a d2t map")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", type=int, required=True, help="draft ids to keep")
    ap.add_argument("--model", default=None, help="the target GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--prompts", type=int, default=160, help="training-style prompts the target continues")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt at most")
    ap.add_argument("--seed", type=int, default=424242)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import pyspec
    model_path = args.model or pyspec.model.default_model_path()
    tensors = {t.name: t for t in gguf.GGUFReader(args.drafter).tensors}
    if "d2t" not in tensors:
        print(f"error: {args.drafter} has no d2t map (its draft vocabulary is the target's)", file=sys.stderr)
        return 2
    d2t = np.array(tensors["d2t"].data, np.int64)
    if not 0 < args.keep < len(d2t):
        print(f"error: --keep must be in [1, {len(d2t) - 1}] (the drafter has {len(d2t)} draft ids)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    gen, prm, eog = target_counts(model_path, args.prompts, args.tokens, args.seed, args.threads)
    pos = kept_positions(d2t, gen, prm, eog, args.keep)
    total = max(1, int(gen.sum()))
    print(f"{int(gen.sum())} generated tokens counted in {time.perf_counter() - t0:.0f} s; of them the "
          f"{len(d2t)} draft ids cover {gen[d2t].sum() / total:.4f}, the {args.keep} kept "
          f"{gen[d2t[pos]].sum() / total:.4f}")
    write_cut(args.drafter, args.out, pos)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
