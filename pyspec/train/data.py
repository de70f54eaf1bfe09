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
import functools
import random
import sysconfig
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
from tqdm.auto import tqdm

# Many phrasings per snippet: prompts from separate sessions (different --seed) then rarely
# coincide even when they draw the same snippet, so combined data sets add new sequences.
CHAT_TEMPLATES = (
    "Explain the following in simple terms:\n\n{text}",
    "Summarize this text in a few sentences.\n\n{text}",
    "What is this about? Give an example.\n\n{text}",
    "Write a short Python function inspired by this description, with a docstring.\n\n{text}",
    "Answer briefly: what does the following documentation describe?\n\n{text}",
    "Rewrite this paragraph so a beginner understands it.\n\n{text}",
    "{text}\n\nCan you explain this?",
    "List the key points of the following text.\n\n{text}",
    "I am reading the Python documentation and found this:\n\n{text}\n\nWhat does it mean?",
    "Write three questions a student could ask about this text, and answer them.\n\n{text}",
    "Give a one-sentence summary, then a longer explanation.\n\n{text}",
    "Translate this technical description into plain English.\n\n{text}",
    "Write a usage example in Python for what is described here.\n\n{text}",
    "What are common mistakes related to the following?\n\n{text}",
    "Continue this documentation with another paragraph in the same style.\n\n{text}",
    "Explain this to someone who knows JavaScript but not Python.\n\n{text}",
)
CODE_TEMPLATES = (
    "What does this Python code do?\n\n```python\n{text}\n```",
    "Explain this function step by step.\n\n```python\n{text}\n```",
    "Add comments to this code.\n\n```python\n{text}\n```",
    "Find a possible bug or improvement in this code.\n\n```python\n{text}\n```",
    "Write unit tests for this code.\n\n```python\n{text}\n```",
    "Add type hints to this code.\n\n```python\n{text}\n```",
    "Write a docstring for this code.\n\n```python\n{text}\n```",
    "```python\n{text}\n```\n\nSummarize what this code does in one paragraph.",
    "Rewrite this code to be more readable.\n\n```python\n{text}\n```",
    "What is the time complexity of this code? Explain.\n\n```python\n{text}\n```",
    "Show how to call this code with an example.\n\n```python\n{text}\n```",
    "Convert this Python code to JavaScript.\n\n```python\n{text}\n```",
)
WINDOW_LINES, WINDOW_STRIDE = 40, 24     # source windows overlap so every line starts one


def _clip(text: str, n_chars: int, rng: random.Random) -> str:
    text = text.strip()
    if len(text) <= n_chars:
        return text
    start = rng.randrange(0, len(text) - n_chars)
    cut = text.find("\n", start)
    start = cut + 1 if 0 <= cut < start + n_chars // 2 else start
    return text[start:start + n_chars].strip()


def _paragraph_chunks(text: str, size: int = 1200) -> Iterator[str]:
    """Consecutive paragraph groups of about size characters (long pydoc topics would otherwise
    be one snippet, of which a session sees only one random cut)."""
    chunk = ""
    for para in text.split("\n\n"):
        if chunk and len(chunk) + len(para) > size:
            yield chunk
            chunk = ""
        chunk += para + "\n\n"
    if chunk.strip():
        yield chunk


@functools.lru_cache(maxsize=1)
def stdlib_snippets() -> Tuple[Tuple[str, str], ...]:
    """All (kind, text) snippets, kind "doc" for prose and "code" for source, in a fixed order
    (the seed only picks among them): pydoc topic chunks, docstrings of modules, classes and
    functions, function sources, and overlapping line windows of every standard-library module
    (~30k snippets on CPython 3.11)."""
    out: List[Tuple[str, str]] = []
    try:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            out += [("doc", c) for c in _paragraph_chunks(topics[key]) if len(c.strip()) > 80]
    except ImportError:   # pragma: no cover - stripped Pythons
        pass
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts and "idlelib" not in p.parts)
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
                if doc and len(doc) > 60:
                    out.append(("doc", doc))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if 120 < len(body) < 3000:
                    out.append(("code", body))
        for a in range(0, max(1, len(lines) - WINDOW_LINES // 2), WINDOW_STRIDE):
            window = "\n".join(lines[a:a + WINDOW_LINES])
            if len(window.strip()) > 200:
                out.append(("code", window))
    return tuple(out)


def prompt_requests(seed: int, chat_fraction: float = 0.75) -> Iterator[tuple]:
    """Endless ("chat", message, u) / ("raw", text, u) requests (u uniform in [0, 1) for the
    caller's own choices); no snippet repeats before the whole pool is used. The seed shuffles the pool and draws the clip, the
    template and chat-or-raw, so different seeds give different prompts."""
    pool = stdlib_snippets()
    rng = random.Random(f"pyspec-train-prompts-{seed}")
    while True:
        for j in rng.sample(range(len(pool)), len(pool)):
            kind, text = pool[j]
            snippet = _clip(text, rng.randint(150, 900), rng)
            if rng.random() < chat_fraction:
                tmpl = rng.choice(CODE_TEMPLATES if kind == "code" else CHAT_TEMPLATES)
                yield "chat", tmpl.format(text=snippet), rng.random()
            else:
                yield "raw", snippet, rng.random()


def make_prompts(tokenizer, n: int, max_prompt_tokens: int, seed: int,
                 chat_fraction: float = 0.75) -> List[List[int]]:
    """n distinct prompt token lists of at most max_prompt_tokens tokens."""
    from ..chat import ChatTemplate
    try:
        template: Optional[ChatTemplate] = ChatTemplate.from_tokenizer(tokenizer)
    except Exception:
        template = None
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    prompts: List[List[int]] = []
    seen = set()
    tries = 0
    for kind, text, u in prompt_requests(seed, chat_fraction if template else 0.0):
        tries += 1
        if len(prompts) >= n or tries > 20 * n + 1000:
            break
        if kind == "chat" and template is not None:
            msgs = [{"role": "user", "content": text}]
            try:
                rendered = template.render(msgs, add_generation_prompt=True)
                ids = tokenizer.encode(rendered, add_special=False, parse_special=True)
            except Exception:
                template = None
                continue
            if len(ids) > max_prompt_tokens:
                continue            # a cut chat prompt would lose the assistant header
        else:
            ids = tokenizer.encode(text, add_special=False)
            # u (drawn with the request) picks the cut, so raw prompts stay seed-determined
            ids = ids[: 8 + int(u * max(0, max_prompt_tokens - 8))]
        if bos is not None and bos >= 0 and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        if len(ids) >= 2 and tuple(ids) not in seen:
            seen.add(tuple(ids))
            prompts.append(ids)
    return prompts


def generate_dataset(target, tokenizer, n_seqs: int, seq_len: int, device, batch: int,
                     seed: int, greedy_fraction: float = 0.5, temperature: float = 0.8,
                     progress: bool = True, deadline: Optional[float] = None
                     ) -> Tuple[List[List[int]], List[int]]:
    """Up to n_seqs sequences of at most seq_len tokens: prompt + the target's continuation, and
    each one's prompt length (the validation split groups sequences by prompt). Stops early, with
    the batches done so far, once time.time() passes deadline."""
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
    prompt_lens: List[int] = []
    bar = tqdm(total=len(order), desc="generating data", unit="seq", disable=not progress)
    for b0 in range(0, len(order), batch):
        if deadline is not None and time.time() > deadline:
            break
        idx = order[b0:b0 + batch]
        ps = [prompts[j] for j in idx]
        temps = [0.0 if rng.random() < greedy_fraction else temperature for _ in ps]
        max_new = seq_len - max(len(p) for p in ps)
        out = generate(target, ps, max_new, temps, eog, gen, device)
        seqs += [s[:seq_len] for s in out]
        prompt_lens += [min(len(p), seq_len) for p in ps]
        bar.update(len(idx))
    bar.close()
    return seqs, prompt_lens
