"""Training data: prompts from text that ships with Python, continued by the target itself.

Prompt sources (never evaluation prompts): the pydoc topic texts (`pydoc_data.topics`), the
docstrings of standard-library modules, classes and functions, and standard-library source code,
all read from the running interpreter's own files (nothing is downloaded). Each snippet becomes
either a chat request (rendered with the target's chat template: explain / summarise / rewrite /
write code for it) or a raw continuation prompt, and the target generates the rest of the
sequence (greedy for some, sampled at a temperature for others), so the drafter learns the
target's own distribution on the kind of text it will be asked to draft for.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path
from typing import Iterator, List, Optional

import torch
from tqdm.auto import tqdm

CHAT_TEMPLATES = (
    "Explain the following in simple terms:\n\n{text}",
    "Summarize this text in a few sentences.\n\n{text}",
    "What is this about? Give an example.\n\n{text}",
    "Write a short Python function inspired by this description, with a docstring.\n\n{text}",
    "Answer briefly: what does the following documentation describe?\n\n{text}",
    "Rewrite this paragraph so a beginner understands it.\n\n{text}",
)
CODE_TEMPLATES = (
    "What does this Python code do?\n\n```python\n{text}\n```",
    "Explain this function step by step.\n\n```python\n{text}\n```",
    "Add comments to this code.\n\n```python\n{text}\n```",
    "Find a possible bug or improvement in this code.\n\n```python\n{text}\n```",
)


def _clip(text: str, n_chars: int, rng: random.Random) -> str:
    text = text.strip()
    if len(text) <= n_chars:
        return text
    start = rng.randrange(0, len(text) - n_chars)
    cut = text.find("\n", start)
    start = cut + 1 if 0 <= cut < start + n_chars // 2 else start
    return text[start:start + n_chars].strip()


def stdlib_snippets(rng: random.Random, limit: int = 20000) -> Iterator[tuple]:
    """(kind, text) pairs: kind "doc" for prose, "code" for source."""
    try:
        from pydoc_data.topics import topics
        for text in topics.values():
            yield "doc", text
    except ImportError:   # pragma: no cover - stripped Pythons
        pass
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts and "idlelib" not in p.parts)
    rng.shuffle(files)
    n = 0
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    yield "doc", doc
                    n += 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if 120 < len(body) < 3000:
                    yield "code", body
                    n += 1
            if n >= limit:
                return


def make_prompts(tokenizer, n: int, max_prompt_tokens: int, seed: int,
                 chat_fraction: float = 0.75) -> List[List[int]]:
    """n prompt token lists of at most max_prompt_tokens tokens."""
    from ..chat import ChatTemplate
    rng = random.Random(seed)
    pool = list(stdlib_snippets(rng))
    rng.shuffle(pool)
    try:
        template: Optional[ChatTemplate] = ChatTemplate.from_tokenizer(tokenizer)
    except Exception:
        template = None
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    prompts: List[List[int]] = []
    i = 0
    while len(prompts) < n and pool:
        kind, text = pool[i % len(pool)]
        i += 1
        snippet = _clip(text, rng.randint(150, 900), rng)
        if template is not None and rng.random() < chat_fraction:
            tmpl = rng.choice(CODE_TEMPLATES if kind == "code" else CHAT_TEMPLATES)
            msgs = [{"role": "user", "content": tmpl.format(text=snippet)}]
            try:
                rendered = template.render(msgs, add_generation_prompt=True)
                ids = tokenizer.encode(rendered, add_special=False, parse_special=True)
            except Exception:
                template = None
                continue
            if len(ids) > max_prompt_tokens:
                continue            # a cut chat prompt would lose the assistant header
        else:
            ids = tokenizer.encode(snippet, add_special=False)
            ids = ids[: rng.randint(8, max(8, max_prompt_tokens))]
        if bos is not None and bos >= 0 and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        if len(ids) >= 2:
            prompts.append(ids)
    return prompts


def generate_dataset(target, tokenizer, n_seqs: int, seq_len: int, device, batch: int,
                     seed: int, greedy_fraction: float = 0.5, temperature: float = 0.8,
                     progress: bool = True) -> List[List[int]]:
    """n_seqs sequences of at most seq_len tokens: prompt + the target's continuation."""
    from .target import generate
    max_prompt = max(8, seq_len // 2)
    prompts = make_prompts(tokenizer, n_seqs, max_prompt, seed)
    if not prompts:
        raise RuntimeError("no training prompts could be made")
    while len(prompts) < n_seqs:
        prompts += prompts[: n_seqs - len(prompts)]
    rng = random.Random(seed + 1)
    # Similar prompt lengths in a batch waste less padding.
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))
    gen = torch.Generator(device=device if str(device).startswith("cuda") else "cpu")
    gen.manual_seed(seed)
    eog = sorted(tokenizer.eog_ids) if hasattr(tokenizer, "eog_ids") else []
    seqs: List[List[int]] = []
    bar = tqdm(total=len(order), desc="generating data", unit="seq", disable=not progress)
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        ps = [prompts[j] for j in idx]
        temps = [0.0 if rng.random() < greedy_fraction else temperature for _ in ps]
        max_new = seq_len - max(len(p) for p in ps)
        out = generate(target, ps, max_new, temps, eog, gen, device)
        seqs += [s[:seq_len] for s in out]
        bar.update(len(idx))
    bar.close()
    return seqs
