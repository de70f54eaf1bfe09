"""Training data: prompts from text that ships with Python, continued by the target itself.

Prompt sources (never evaluation prompts): the pydoc topic texts (`pydoc_data.topics`), the
docstrings of standard-library modules, classes and functions, and standard-library source code,
all read from the running interpreter's own files (nothing is downloaded). Each snippet becomes
either a chat request (rendered with the target's chat template: explain / summarise / rewrite /
write code for it) or a raw continuation prompt, and the target generates the rest of the
sequence (greedy for some, sampled at a temperature for others), so the drafter learns the
target's own distribution on the kind of text it will be asked to draft for.

Conversational prompts (--chat-fraction, default 0.6 of the requests) are synthesised, not read
from any data set: templated everyday requests (explain / tell me about / write a short story or
poem about / compare / give tips on ...) over everyday topics (a built-in list, Unicode's
pictograph names from unicodedata, Python keywords, module names and pydoc topic titles), with
style suffixes, arithmetic word problems with random numbers, sentence edits of documentation
sentences, and second turns of chats the target answered earlier in the same run (a follow-up
request after its own reply). Text of the benchmark and evaluation prompts (HELD_OUT_MARKERS) is
never used.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

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


# -- conversational prompts (synthesised; nothing read from evaluation data) ----------------------

# Evaluation and benchmark prompts (bench/, shared/data/eval_*) must never become training
# prompts: a request whose text contains one of these (case-insensitive) is dropped.
HELD_OUT_MARKERS = (
    "capital of france", "once upon a time", "def fibonacci", "the best way to learn",
    "in 1969, the first", "water boils at", "my favourite colour", "haiku about autumn",
    "python software foundation license", "psf license", "license agreement",
    "palindrome", "class stack", "binary_search", "count_words", "class temperature",
)

EVERYDAY_TOPICS = (
    "cooking pasta", "baking bread", "making coffee", "brewing tea", "growing tomatoes",
    "keeping houseplants alive", "training a puppy", "adopting a cat", "learning to swim",
    "running a first marathon", "riding a bicycle in the city", "camping in the mountains",
    "planning a road trip", "packing for a beach holiday", "saving money", "making a budget",
    "starting a small business", "writing a resume", "preparing for a job interview",
    "working from home", "public speaking", "learning a new language", "learning to play guitar",
    "learning the piano", "painting with watercolours", "taking better photos",
    "reading more books", "keeping a journal", "meditation", "getting better sleep",
    "drinking enough water", "eating more vegetables", "climate change", "recycling",
    "solar power", "wind turbines", "electric cars", "the history of the printing press",
    "the Roman Empire", "ancient Egypt", "the Industrial Revolution", "the invention of the telephone",
    "the Moon landing", "black holes", "the solar system", "volcanoes", "earthquakes",
    "the water cycle", "photosynthesis", "how vaccines work", "the human heart", "dinosaurs",
    "honey bees", "octopuses", "whales", "rainforests", "deserts", "the ocean tides",
    "chess openings", "board games", "video game design", "the rules of football",
    "basketball", "tennis", "the Olympic Games", "jazz music", "classical music", "film making",
    "writing a novel", "poetry", "social media", "online privacy", "strong passwords",
    "artificial intelligence", "machine learning", "the internet", "how computers store data",
    "smartphones", "3D printing", "space exploration", "Mars", "friendship", "kindness",
    "time management", "procrastination", "moving to a new city", "renting an apartment",
    "cleaning the kitchen", "organising a closet", "a birthday party", "a wedding speech",
    "a rainy afternoon", "a snowy morning", "a summer festival", "a lost umbrella",
    "a talking robot", "a lighthouse keeper", "a dragon who is afraid of fire", "a time traveller",
    "a small village bakery", "a detective in a train station", "a cat who runs a library",
    "the first day of school", "a trip to the museum", "a garden at night", "a broken clock",
    "volunteering", "teamwork", "negotiating a salary", "giving feedback", "writing an apology",
    "choosing a laptop", "fixing a flat tyre", "composting", "bird watching", "stargazing",
    "hiking safety", "first aid basics", "healthy breakfast ideas", "vegetarian recipes",
    "soup recipes", "making pizza at home", "chocolate", "cheese making", "the history of tea",
    "the Silk Road", "pyramids", "castles", "pirates", "knights", "the Renaissance",
    "Leonardo da Vinci", "Shakespeare", "mathematics in everyday life", "prime numbers",
    "probability", "fractions", "the metric system", "electricity", "magnets", "rainbows",
    "clouds", "the seasons", "weather forecasts", "maps and navigation", "trains",
    "aeroplanes", "sailing", "bridges", "skyscrapers", "architecture", "fashion",
    "minimalism", "habits", "motivation", "stress", "exercise at home", "yoga", "running shoes",
)

CONVERSATION_TEMPLATES = (
    "Explain {x} to a ten-year-old.", "What is {x}?", "Tell me about {x}.",
    "Give me three interesting facts about {x}.", "Why do people care about {x}?",
    "What are the pros and cons of {x}?", "How does {x} work?", "Write a short story about {x}.",
    "Write a poem about {x}.", "Write a haiku about {x}.", "Write a limerick about {x}.",
    "Describe {x} in one paragraph.", "Give me a step-by-step guide to {x}.",
    "I want to get into {x}. Where should I start?", "Write a friendly email inviting a friend to "
    "try {x}.", "Suggest five titles for a blog post about {x}.", "What are common myths about {x}?",
    "Write a short dialogue between two friends talking about {x}.",
    "Summarize the most important things to know about {x}.", "Write a tweet about {x}.",
    "Can you give me some tips on {x}?", "What would a beginner get wrong about {x}?",
    "Write a product description for something related to {x}.", "Make a quiz with three "
    "questions about {x}, with answers.", "Tell me a joke about {x}.",
    "Write a diary entry of someone who just discovered {x}.", "How would you teach {x}?",
    "What questions should I ask an expert on {x}?", "hi! can you tell me something about {x}?",
    "Compare {x} and {y}.", "Which is easier to learn about, {x} or {y}? Why?",
    "Write a short story that involves {x} and {y}.", "How are {x} and {y} related?",
)
STYLE_SUFFIXES = (
    "", "", "", "", " Keep it short.", " Use bullet points.", " Answer in under 100 words.",
    " Be friendly and encouraging.", " Please be detailed.", " Use simple words.",
    " Add an example.", " Make it funny.", " Write it for a teenager.", " Thanks!",
)
MATH_TEMPLATES = (
    "What is {a} times {b}?", "What is {a} plus {b}? Show your work.",
    "If I have {a} apples and give away {b}, how many are left?",
    "A train travels {a} kilometres in {b} hours. What is its average speed?",
    "Convert {a} kilometres to miles.", "What is {b} percent of {a}?",
    "I earn {a} dollars a week and spend {b}. How much do I save in a year?",
    "Is {a} a prime number? Explain.", "Round {a}.{b} to the nearest whole number.",
    "A recipe for {b} people needs {a} grams of flour. How much for {c} people?",
    "Split a bill of {a} dollars between {c} friends, with a {b} percent tip.",
)
# Everyday programming requests (the bench's code tasks - Fibonacci, palindromes, a Stack class,
# binary search, word counts, a temperature class - are held out above and absent here).
PROGRAMMING_TASKS = (
    "reverses a list without using reversed()", "counts the vowels in a string",
    "returns the largest of three numbers", "removes duplicates from a list but keeps the order",
    "checks whether a year is a leap year", "converts a Roman numeral to an integer",
    "merges two sorted lists", "flattens a nested list", "returns the factorial of n",
    "checks whether a number is prime", "finds the second largest number in a list",
    "capitalises the first letter of every word", "reads a CSV file and prints its rows",
    "computes the average of a list of numbers", "swaps the keys and values of a dictionary",
    "returns the greatest common divisor of two numbers", "generates a random password",
    "counts how often each character appears in a string", "sorts a list of tuples by their "
    "second item", "rotates a list by k positions", "checks whether two strings are anagrams",
    "converts a decimal number to binary", "sums the digits of an integer",
    "returns all the even numbers from a list", "finds the longest word in a sentence",
    "splits a list into chunks of size n", "checks whether brackets in a string are balanced",
    "transposes a matrix given as a list of lists", "returns the n-th triangular number",
    "finds common elements of two lists", "computes compound interest",
    "validates an email address with a regular expression", "implements bubble sort",
    "implements insertion sort", "implements a simple queue with two lists",
    "parses a date string like 2024-05-17 into a date object", "downloads a web page and "
    "counts its links", "writes a dictionary to a JSON file", "renames all .txt files in a "
    "folder", "measures how long another function takes", "retries a function three times "
    "if it raises an exception", "computes the distance between two points",
    "converts miles to kilometres", "returns the median of a list",
    "groups words by their first letter", "counts the lines of a text file",
    "checks whether a list is sorted", "returns the intersection of two sets of words",
    "finds the most common element of a list", "clamps a number between a minimum and a maximum",
)
PROGRAMMING_TEMPLATES = (
    "Write a Python function that {t}.", "Write a Python function that {t}, with a docstring.",
    "Write a Python function that {t}, and show an example.", "How can I write code that {t} "
    "in Python?", "Write a short Python script that {t}.", "Can you write a function that {t}? "
    "Please explain how it works.", "Write a Python function that {t}. Add type hints.",
    "Write a JavaScript function that {t}.", "Write a Python function that {t} and a test for it.",
)
PROGRAMMING_QUESTIONS = (
    "What is the difference between a list and a tuple in Python?", "How do I read a file line "
    "by line in Python?", "What does the yield keyword do?", "How do decorators work in Python?",
    "What is a Python dictionary? Give an example.", "How do I handle exceptions in Python?",
    "What is recursion? Show a small example.", "How do I install a package with pip?",
    "What is the difference between == and is in Python?", "Explain Python's with statement.",
    "How do I sort a dictionary by value?", "What are *args and **kwargs?",
    "How do I make a virtual environment?", "What is a lambda function?",
    "Explain classes and objects in Python with an example.", "What is a generator?",
    "How do I format a string with f-strings?", "What is the difference between a set and a list?",
    "How do I convert a string to an integer safely?", "What is an API?",
    "Explain what Git is and why developers use it.", "What is the time complexity of looking "
    "up a key in a dictionary?", "How do I loop over a dictionary's keys and values?",
)


FOLLOW_UPS = (
    "Can you make that shorter?", "Thanks! Can you give me an example?",
    "Now explain it as if I were five.", "What would be a good title for that?",
    "Can you turn that into a list of key points?", "Why is that?", "Tell me more.",
    "Can you rewrite it in a more formal tone?", "That's great. What should I do next?",
    "Can you summarize your answer in one sentence?", "Are there any downsides?",
    "Could you add a few more details?", "Write a short poem based on your answer.",
    "What is the most important point?", "thanks, one more question: how do I remember all this?",
)


@functools.lru_cache(maxsize=1)
def conversation_topics() -> Tuple[str, ...]:
    """Everyday subjects: the list above, the names of Unicode's pictographs (unicodedata: 'hot
    beverage', 'sunflower', 'bicycle', ...), Python's own keywords and standard-library module
    names and the pydoc topic titles (for everyday programming questions)."""
    import keyword
    import sys
    import unicodedata
    out = list(EVERYDAY_TOPICS)
    skip = {"WITH", "SIGN", "SYMBOL", "BLACK", "WHITE", "HEAVY", "LIGHT", "SQUARED", "CIRCLED",
            "NEGATIVE", "LEFT", "RIGHT", "UP", "DOWN", "ARROW", "TYPE", "MODIFIER", "LATIN",
            "DIGIT", "BOX", "ORNAMENT", "TILE", "CARD", "PLAYING", "SQUARE", "TRIANGLE",
            "CIRCLE", "LOWER", "UPPER", "FACE", "HAND", "POINTING", "REGIONAL", "INDICATOR",
            "CHESS", "ROTATED", "NEUTRAL", "TURNED", "SIGNAL", "OUTLINED", "LOZENGE"}
    for cp in range(0x1F300, 0x1FB00):
        name = unicodedata.name(chr(cp), "")
        words = name.split()
        if words and len(words) <= 3 and all(w.isalpha() for w in words) and \
                not skip & set(words):
            out.append("the " + name.lower() if len(words) > 1 else name.lower())
    out += [f"the Python {m} module" for m in sorted(getattr(sys, "stdlib_module_names", ()))
            if not m.startswith("_")]
    out += [f"the Python keyword '{k}'" for k in keyword.kwlist]
    try:
        from pydoc_data.topics import topics
        out += [f"Python {k.replace('-', ' ')}" for k in sorted(topics)]
    except ImportError:   # pragma: no cover
        pass
    return tuple(dict.fromkeys(t for t in out if not _held_out(t)))


def _held_out(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in HELD_OUT_MARKERS)


def conversation_request(rng: random.Random) -> str:
    """One synthesised conversational request: a templated question or task over an everyday
    topic (sometimes two), an arithmetic word problem, a programming task or question, or an edit
    of a documentation sentence."""
    topics = conversation_topics()
    u = rng.random()
    if u < 0.12:
        a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 12)
        return rng.choice(MATH_TEMPLATES).format(a=a, b=b, c=c)
    if u < 0.32:
        return rng.choice(PROGRAMMING_TEMPLATES).format(t=rng.choice(PROGRAMMING_TASKS)) + \
            rng.choice(STYLE_SUFFIXES)
    if u < 0.35:
        return rng.choice(PROGRAMMING_QUESTIONS) + rng.choice(STYLE_SUFFIXES)
    if u < 0.43:
        kind, text = rng.choice(stdlib_snippets())
        while kind != "doc":
            kind, text = rng.choice(stdlib_snippets())
        sent = _clip(text, rng.randint(60, 240), rng).split("\n\n")[0]
        verb = rng.choice(("Fix the grammar of this sentence", "Rewrite this in plain English",
                           "Make this sound friendlier", "Translate this into French",
                           "Shorten this", "Turn this into a question"))
        return f"{verb}: {sent}"
    tmpl = rng.choice(CONVERSATION_TEMPLATES)
    x, y = rng.choice(topics), rng.choice(topics)
    return tmpl.format(x=x, y=y) + rng.choice(STYLE_SUFFIXES)


def prompt_requests(seed: int, chat_fraction: float = 0.6,
                    doc_chat_fraction: float = 0.75) -> Iterator[tuple]:
    """Endless ("chat", message, u) / ("raw", text, u) requests (u uniform in [0, 1) for the
    caller's own choices). A chat_fraction share are synthesised conversational requests
    (conversation_request, never repeated within a stream); the rest come from the Python
    documentation and source pool, where no snippet repeats before the whole pool is used and a
    doc_chat_fraction share become chat requests (explain / summarise / ... templates), the
    others raw continuation prompts. The seed shuffles the pool and draws the clip, the
    template, the topics and chat-or-raw, so different seeds give different prompts. Requests
    that contain held-out evaluation text (HELD_OUT_MARKERS) are skipped."""
    pool = stdlib_snippets()
    rng = random.Random(f"pyspec-train-prompts-{seed}")
    conv_rng = random.Random(f"pyspec-train-chat-{seed}")
    mix_rng = random.Random(f"pyspec-train-mix-{seed}")
    seen = set()

    def documentation():
        while True:
            for j in rng.sample(range(len(pool)), len(pool)):
                kind, text = pool[j]
                snippet = _clip(text, rng.randint(150, 900), rng)
                if rng.random() < doc_chat_fraction:
                    tmpl = rng.choice(CODE_TEMPLATES if kind == "code" else CHAT_TEMPLATES)
                    yield "chat", tmpl.format(text=snippet), rng.random()
                else:
                    yield "raw", snippet, rng.random()

    docs = documentation()
    while True:
        if mix_rng.random() < chat_fraction:
            for _ in range(1000):
                text = conversation_request(conv_rng)
                if text not in seen and not _held_out(text):
                    break
            seen.add(text)
            yield "chat", text, conv_rng.random()
        else:
            req = next(docs)
            while _held_out(req[1]):
                req = next(docs)
            yield req


def with_bos(tokenizer, ids: List[int]) -> List[int]:
    """ids with the tokenizer's BOS in front when it adds one and ids do not start with it."""
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    if bos is not None and bos >= 0 and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def make_prompt_records(tokenizer, n: int, max_prompt_tokens: int, seed: int,
                        chat_fraction: float = 0.6) -> List[Tuple[List[int], Optional[list]]]:
    """n distinct (prompt token list of at most max_prompt_tokens tokens, chat messages or None
    for a raw prompt)."""
    from ..chat import ChatTemplate
    try:
        template: Optional[ChatTemplate] = ChatTemplate.from_tokenizer(tokenizer)
    except Exception:
        template = None
    records: List[Tuple[List[int], Optional[list]]] = []
    seen = set()
    tries = 0
    reqs = prompt_requests(seed, chat_fraction, 0.75) if template else \
        prompt_requests(seed, 0.0, 0.0)
    for kind, text, u in reqs:
        tries += 1
        if len(records) >= n or tries > 20 * n + 1000:
            break
        msgs = None
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
        ids = with_bos(tokenizer, ids)
        if len(ids) >= 2 and tuple(ids) not in seen:
            seen.add(tuple(ids))
            records.append((ids, msgs))
    return records


def make_prompts(tokenizer, n: int, max_prompt_tokens: int, seed: int,
                 chat_fraction: float = 0.6) -> List[List[int]]:
    """n distinct prompt token lists of at most max_prompt_tokens tokens."""
    return [ids for ids, _ in make_prompt_records(tokenizer, n, max_prompt_tokens, seed,
                                                  chat_fraction)]


def follow_up_prompts(tokenizer, records, seqs, prompt_lens, n: int, max_prompt_tokens: int,
                      seed: int) -> List[List[int]]:
    """Up to n second-turn chat prompts built from earlier generations: [user, the target's own
    reply (cut to fit), a follow-up request]."""
    from ..chat import ChatTemplate
    try:
        template = ChatTemplate.from_tokenizer(tokenizer)
    except Exception:
        return []
    rng = random.Random(f"pyspec-train-followups-{seed}")
    eog = set(getattr(tokenizer, "eog_ids", ()))
    cands = [k for k, (_, msgs) in enumerate(records) if msgs is not None]
    rng.shuffle(cands)
    out: List[List[int]] = []
    for k in cands:
        if len(out) >= n:
            break
        reply_ids = [t for t in seqs[k][prompt_lens[k]:] if t not in eog]
        if len(reply_ids) < 8:
            continue
        follow = rng.choice(FOLLOW_UPS)
        for cut in (len(reply_ids), len(reply_ids) // 2, len(reply_ids) // 4):
            reply = tokenizer.decode(reply_ids[:cut], skip_special=True).strip()
            msgs = records[k][1] + [{"role": "assistant", "content": reply},
                                    {"role": "user", "content": follow}]
            try:
                ids = tokenizer.encode(template.render(msgs, add_generation_prompt=True),
                                       add_special=False, parse_special=True)
            except Exception:
                return out
            ids = with_bos(tokenizer, ids)
            if len(ids) <= max_prompt_tokens:
                out.append(ids)
                break
    return out


def self_prompt_prefix(tokenizer) -> Optional[List[int]]:
    """The tokens a chat opens a user turn with (system prompt included, as the template renders
    it) and nothing after: what the target continues to write a user request itself. None for a
    tokenizer without a chat template."""
    from ..chat import ChatTemplate
    try:
        template = ChatTemplate.from_tokenizer(tokenizer)
        mark = "\x00pyspec-user-turn\x00"
        rendered = template.render([{"role": "user", "content": mark}], add_generation_prompt=True)
    except Exception:
        return None
    if mark not in rendered:
        return None
    ids = tokenizer.encode(rendered[: rendered.index(mark)], add_special=False, parse_special=True)
    ids = with_bos(tokenizer, ids)
    return ids


def self_prompts(target, tokenizer, n: int, device, batch: int, seed: int, temperature: float = 0.9,
                 max_tokens: int = 96, generator=None, progress: bool = False,
                 deadline: Optional[float] = None) -> List[str]:
    """Up to n distinct user requests written by the target itself (the "Magpie" recipe): it
    continues the opening of a user turn (self_prompt_prefix) at the given temperature, and its
    turn, up to its own end-of-turn token, is the request. An instruct model writes the kind of
    requests it was tuned on, in far more variety than templates; these are its generations, not
    evaluation text (requests with HELD_OUT_MARKERS are dropped, as are unfinished turns, ones
    under 3 words or over 1,000 characters, and repeats)."""
    prefix = self_prompt_prefix(tokenizer)
    eog = set(getattr(tokenizer, "eog_ids", ()))
    if prefix is None or not eog or n <= 0:
        return []
    out: List[str] = []
    seen = set()
    for attempt in range(4):          # unfinished or repeated turns are asked for again
        want = 2 * (n - len(out)) + 8
        seqs, _ = _generate(target, tokenizer, [prefix] * want, len(prefix) + max_tokens, device,
                            batch, seed + 1009 * attempt, 0.0, temperature, progress, deadline, generator)
        for sq in seqs:
            turn = sq[len(prefix):]
            if not turn or turn[-1] not in eog:
                continue
            text = tokenizer.decode(turn[:-1], skip_special=True).strip()
            key = " ".join(text.lower().split())
            if len(text.split()) < 3 or len(text) > 1000 or key in seen or _held_out(text):
                continue
            seen.add(key)
            out.append(text)
            if len(out) >= n:
                return out
        if deadline is not None and time.time() > deadline:
            break
    return out


def self_prompt_records(target, tokenizer, n: int, max_prompt_tokens: int, device, batch: int,
                        seed: int, generator=None, progress: bool = False,
                        deadline: Optional[float] = None) -> List[Tuple[List[int], Optional[list]]]:
    """Chat prompt records (as make_prompt_records gives) of up to n self_prompts requests."""
    from ..chat import ChatTemplate
    texts = self_prompts(target, tokenizer, n, device, batch, seed, generator=generator,
                         progress=progress, deadline=deadline)
    if not texts:
        return []
    template = ChatTemplate.from_tokenizer(tokenizer)
    records = []
    for text in texts:
        msgs = [{"role": "user", "content": text}]
        ids = tokenizer.encode(template.render(msgs, add_generation_prompt=True), add_special=False,
                               parse_special=True)
        ids = with_bos(tokenizer, ids)
        if len(ids) <= max_prompt_tokens:
            records.append((ids, msgs))
    return records


def generate_dataset(target, tokenizer, n_seqs: int, seq_len: int, device, batch: int,
                     seed: int, greedy_fraction: float = 0.5, temperature: float = 0.8,
                     progress: bool = True, deadline: Optional[float] = None,
                     chat_fraction: float = 0.6, multi_turn_fraction: float = 0.25,
                     generator=None, self_prompt_fraction: float = 0.0) -> Tuple[List[List[int]], List[int]]:
    """Up to n_seqs sequences of at most seq_len tokens: prompt + the target's continuation, and
    each one's prompt length (the validation split groups sequences by prompt). A
    multi_turn_fraction share of the conversational sequences (chat_fraction of all) are
    second turns of earlier generated chats (follow_up_prompts), generated after the first
    round. Stops early, with the batches done so far, once time.time() passes deadline.
    generator: None continues prompts with the torch target; else a callable
    (prompts, max_new, temperatures, eog, seed) -> sequences (engine_generate.EngineGenerator).
    self_prompt_fraction: the share of the first-round conversational prompts whose request the
    target writes itself (self_prompts) instead of the templates."""
    max_prompt = max(8, seq_len // 2)
    n_multi = int(n_seqs * chat_fraction * multi_turn_fraction)
    n_first = n_seqs - n_multi
    n_self = int(n_first * chat_fraction * self_prompt_fraction)
    own = self_prompt_records(target, tokenizer, n_self, max_prompt, device, batch, seed, generator,
                              progress, deadline) if n_self else []
    # the other records keep the overall conversational share at chat_fraction
    rest_chat = max(0.0, chat_fraction * n_first - len(own)) / max(1, n_first - len(own))
    records = own + make_prompt_records(tokenizer, n_first - len(own), max_prompt, seed, rest_chat)
    if not records:
        raise RuntimeError("no training prompts could be made")
    prompts = [ids for ids, _ in records]
    seqs, prompt_lens = _generate(target, tokenizer, prompts, seq_len, device, batch, seed,
                                  greedy_fraction, temperature, progress, deadline, generator)
    if n_multi and len(seqs) == len(records):
        more = follow_up_prompts(tokenizer, records, seqs, prompt_lens, n_multi, max_prompt, seed)
        if more:
            s2, p2 = _generate(target, tokenizer, more, seq_len, device, batch, seed + 7,
                               greedy_fraction, temperature, progress, deadline, generator)
            seqs, prompt_lens = seqs + s2, prompt_lens + p2
    while len(seqs) < n_seqs and (deadline is None or time.time() <= deadline):
        extra = n_seqs - len(seqs)       # too few distinct prompts: the same ones sampled again
        s2, p2 = _generate(target, tokenizer, prompts[:extra], seq_len, device, batch,
                           seed + 13 + len(seqs), 0.0, temperature, progress, deadline, generator)
        if not s2:
            break
        seqs, prompt_lens = seqs + s2, prompt_lens + p2
    return seqs, prompt_lens


def _generate(target, tokenizer, prompts, seq_len: int, device, batch: int, seed: int,
              greedy_fraction: float, temperature: float, progress: bool,
              deadline: Optional[float], generator=None) -> Tuple[List[List[int]], List[int]]:
    """The target's continuations of prompts, in the prompts' order."""
    import torch  # here, so the prompt makers above work without torch (tools/shrink_draft_vocab.py)

    from .target import generate
    rng = random.Random(seed + 1)
    # Similar prompt lengths in a batch waste less padding.
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))
    gen = torch.Generator(device=device if str(device).startswith("cuda") else "cpu")
    gen.manual_seed(seed)
    eog = sorted(tokenizer.eog_ids) if hasattr(tokenizer, "eog_ids") else []
    done = {}
    # Batches run in a seeded random order, not shortest first: a run stopped by its deadline
    # then keeps a fair sample of prompt lengths (long code prompts included).
    starts = list(range(0, len(order), batch))
    rng.shuffle(starts)
    bar = tqdm(total=len(order), desc="generating data", unit="seq", disable=not progress)
    for b0 in starts:
        if deadline is not None and time.time() > deadline:
            break
        idx = order[b0:b0 + batch]
        ps = [prompts[j] for j in idx]
        temps = [0.0 if rng.random() < greedy_fraction else temperature for _ in ps]
        max_new = seq_len - max(len(p) for p in ps)
        if generator is not None:
            out = generator(ps, max_new, temps, eog, seed + b0)
        else:
            out = generate(target, ps, max_new, temps, eog, gen, device)
        for j, p, s in zip(idx, ps, out):
            done[j] = (s[:seq_len], min(len(p), seq_len))
        bar.update(len(idx))
    bar.close()
    keys = sorted(done)
    return [done[j][0] for j in keys], [done[j][1] for j in keys]
