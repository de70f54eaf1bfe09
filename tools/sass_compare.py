#!/usr/bin/env python3
"""Compares the machine code (SASS) of the kernels in two CUDA objects, kernel by kernel.

Runs without a GPU: it answers "did this refactor leave the default kernels exactly as they
were?", which no timing can answer as cleanly. Compile the translation unit before and after the
change (the same nvcc flags), then:

    nvcc -std=c++17 --expt-relaxed-constexpr -O3 -gencode=arch=compute_90a,code=sm_90a -I. -Icsrc \\
        -c cuda/ops_matmul.cu -o /tmp/after.o     # and /tmp/before.o from the old tree
    python tools/sass_compare.py /tmp/before.o /tmp/after.o --match mul_mat_rows
    python tools/sass_compare.py /tmp/before.o /tmp/after.o --match mul_mat_rows \\
        --rename '(Li8E|Li16E)(EEv)=\\1NS1_12StreamedFeedE\\2'   # a template argument added

A kernel's code is compared without its instruction addresses and encodings. ptxas may allocate
the registers of a kernel whose source did not change differently when its translation unit
changes (seen on the quantized k_mul_mat kernels), so a "differs" outside the kernels a change
touched is worth a look at the diff (--show), not proof of a change.

Needs cuobjdump and nvdisasm on the PATH: the CUDA toolkit's, or the PyPI packages
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (their bin/ folders).
"""
from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"^\s+Function : (\S+)")
ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")


def kernels(obj: str) -> dict[str, list[str]]:
    """Mangled kernel name -> its instructions (addresses and encodings dropped)."""
    out = subprocess.run(["cuobjdump", "-sass", obj], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"cuobjdump -sass {obj}: {out.stderr.strip()}")
    found: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in out.stdout.splitlines():
        m = FUNCTION.match(line)
        if m:
            body = found.setdefault(m.group(1), [])
            continue
        if body is not None and "/*" in line:
            ins = ADDRESS.sub("", line).split(";")[0].strip()
            if ins and not ins.startswith("/*"):  # an encoding-only line
                body.append(ins)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--match", default="", help="only kernels whose mangled name matches this regex")
    ap.add_argument("--rename", action="append", default=[], metavar="REGEX=REPLACEMENT",
                    help="maps a kernel's name in BEFORE to its name in AFTER (re.sub; repeatable)")
    ap.add_argument("--show", type=int, default=0, metavar="N", help="print the first N diff lines of each that differs")
    args = ap.parse_args()
    for tool in ("cuobjdump", "nvdisasm"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on the PATH (CUDA toolkit, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    renames = []
    for r in args.rename:
        pattern, sep, repl = r.partition("=")
        if not sep:
            ap.error(f"--rename {r!r}: expected REGEX=REPLACEMENT")
        renames.append((re.compile(pattern), repl))
    before, after = kernels(args.before), kernels(args.after)
    want = re.compile(args.match)
    same = differs = missing = 0
    for name, code in before.items():
        if not want.search(name):
            continue
        new_name = name
        for pattern, repl in renames:
            if new_name not in after:
                new_name = pattern.sub(repl, new_name)
        if new_name not in after:
            missing += 1
            print(f"missing  {name}")
            continue
        if after[new_name] == code:
            same += 1
            continue
        differs += 1
        print(f"differs  {new_name} ({len(code)} -> {len(after[new_name])} instructions)")
        if args.show:
            diff = difflib.unified_diff(code, after[new_name], lineterm="", n=0)
            for line in list(diff)[2:2 + args.show]:
                print("    " + line)
    print(f"{same} the same, {differs} differ, {missing} not in {args.after}")
    return 1 if differs or missing else 0


if __name__ == "__main__":
    sys.exit(main())
