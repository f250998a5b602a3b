#!/usr/bin/env python3
"""The machine instructions of each kernel's main loop, from the CUBINs that
`attnres device --compile-for ARCH --save DIR` writes: how many there are per trip, and how many
of them do the work (tensor-core products, exponentials, shared-memory loads, copies), so that
a kernel's overhead can be read without a GPU.

    python3 scripts/gpu/loop_instructions.py DIR [KERNEL ...]

KERNEL filters by substring (default: every kernel with a loop of 100 instructions or more).
The main loop is the longest backward branch of a kernel; its instructions are counted as they
stand, so a loop inside it (which ptxas did not unroll) counts once, and a branch taken on some
trips only (as the causal mask's) counts whole. Needs `cuobjdump`, on PATH or from PyPI's
nvidia-cuda-cuobjdump (CUDA 13).
"""
import glob
import os
import re
import shutil
import subprocess
import sys

INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,6})\*/\s+(.*?);")
TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
GUARD = re.compile(r"^@!?U?P\w+\s+")
# Opcodes by what they do; the rest is overhead (addresses, masks, conversions, control).
WORK = {
    "tensor-core products": ("HMMA",),
    "exp2 and reciprocals": ("MUFU",),
    "shared loads": ("LDSM", "LDS"),
    "global copies": ("LDGSTS", "LDG", "STG"),
}


def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in list(getattr(nvidia, "__path__", [])):
        path = os.path.join(root, "cu13", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or put it on PATH")


def functions(sass):
    """(name, [(address, instruction)]) for each function of cuobjdump's listing."""
    for part in sass.split("Function : ")[1:]:
        name, _, body = part.partition("\n")
        code = [(int(a, 16), text) for a, text in INSTRUCTION.findall(body)]
        yield name.strip(), code


def main_loop(code):
    """The instructions of the longest backward branch's span, or []."""
    best = (0, 0)
    for at, text in code:
        m = TARGET.search(text)
        if m and int(m.group(1), 16) < at:
            start = int(m.group(1), 16)
            if at - start > best[1] - best[0]:
                best = (start, at)
    return [text for at, text in code if best[0] <= at <= best[1]] if best[1] else []


def opcode(text):
    return GUARD.sub("", text).split()[0].split(".")[0]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    wanted = sys.argv[2:]
    tool = cuobjdump()
    for cubin in sorted(glob.glob(os.path.join(sys.argv[1], "*.cubin"))):
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True)
        for name, code in sorted(functions(sass.stdout)):
            if wanted and not any(w in name for w in wanted):
                continue
            loop = main_loop(code)
            if len(loop) < (1 if wanted else 100):
                continue
            ops = [opcode(t) for t in loop]
            parts = [f"{sum(ops.count(o) for o in codes)} {what}" for what, codes in WORK.items()]
            work = sum(ops.count(o) for codes in WORK.values() for o in codes)
            print(f"{name}: {len(loop)} instructions a trip ({', '.join(parts)}; "
                  f"{len(loop) - work} other)")


if __name__ == "__main__":
    main()
