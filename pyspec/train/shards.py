"""Generated training data as small, carryable shard files.

A shard set is a directory of data-00000.npz, data-00001.npz, ... each at most max_mib MiB (device
calls return files of limited size, and data made in several sessions is combined by listing
several sets). One shard holds:

    tokens       all sequences concatenated (uint16 when every id fits, else int32)
    offsets      int64 [n + 1]: sequence i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lens  int32 [n]: the prompt's share of each sequence (the rest is the target's)
    meta         a JSON string: target file name, n_vocab, seq_len, seed

Loading concatenates the sets in the order given and drops exact duplicate sequences (two
sessions that drew the same prompt and continued it greedily produce the same sequence).
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np

SHARD_GLOB = "data-*.npz"


def save_shards(seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], out_dir: Path,
                meta: Dict, max_mib: float = 15.0) -> List[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(SHARD_GLOB):      # a rewritten set must not keep stale shards
        old.unlink()
    top = max((max(s) for s in seqs if len(s)), default=0)
    dtype = np.uint16 if top < 2 ** 16 else np.int32
    budget = int(max_mib * (1 << 20)) - 4096        # npz header and meta
    per_seq = 8 + 4                                  # offset + prompt length
    files: List[Path] = []
    i = 0
    while i < len(seqs) or not files:
        j, size = i, 0
        while j < len(seqs) and (j == i or size + len(seqs[j]) * dtype().itemsize + per_seq <= budget):
            size += len(seqs[j]) * dtype().itemsize + per_seq
            j += 1
        chunk = seqs[i:j]
        lens = np.array([len(s) for s in chunk], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        tokens = (np.concatenate([np.asarray(s, dtype) for s in chunk]) if chunk
                  else np.zeros(0, dtype))
        path = out_dir / f"data-{len(files):05d}.npz"
        np.savez(path, tokens=tokens, offsets=offsets,
                 prompt_lens=np.asarray(prompt_lens[i:j], np.int32),
                 meta=np.array(json.dumps(meta)))
        files.append(path)
        i = j
    return files


def shard_files(specs: Union[str, Path, Sequence[Union[str, Path]]]) -> List[Path]:
    """Directories (their data-*.npz), files and glob patterns -> shard files, in order."""
    if isinstance(specs, (str, Path)):
        specs = [specs]
    files: List[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            found = sorted(p.glob(SHARD_GLOB)) or sorted(p.glob("*/" + SHARD_GLOB))
        elif p.exists():
            found = [p]
        else:
            found = [Path(f) for f in sorted(glob.glob(str(spec)))]
        if not found:
            raise FileNotFoundError(f"no data shards ({SHARD_GLOB}) at {spec}")
        files += [f for f in found if f not in files]
    return files


def load_shards(specs, n_vocab: int = 0) -> Tuple[List[List[int]], List[int], Dict]:
    """(sequences, prompt lengths, info) from shard sets; exact duplicates dropped. n_vocab, when
    given, must match the vocabulary the data was generated with."""
    seqs: List[List[int]] = []
    prompt_lens: List[int] = []
    seen = set()
    info = dict(files=0, duplicates=0, metas=[])
    for f in shard_files(specs):
        with np.load(f) as z:
            meta = json.loads(str(z["meta"]))
            if n_vocab and meta.get("n_vocab") not in (None, n_vocab):
                raise ValueError(f"{f} was generated for a vocabulary of {meta['n_vocab']} "
                                 f"tokens, the target has {n_vocab}")
            tokens, offsets, pl = z["tokens"].astype(np.int64), z["offsets"], z["prompt_lens"]
        info["files"] += 1
        if meta not in info["metas"]:
            info["metas"].append(meta)
        for k in range(len(offsets) - 1):
            s = tokens[offsets[k]:offsets[k + 1]]
            key = hashlib.blake2b(s.tobytes(), digest_size=16).digest()
            if key in seen:
                info["duplicates"] += 1
                continue
            seen.add(key)
            seqs.append(s.tolist())
            prompt_lens.append(int(pl[k]))
    return seqs, prompt_lens, info
