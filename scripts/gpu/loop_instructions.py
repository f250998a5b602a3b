#!/usr/bin/env python3
"""The machine instructions of each kernel's main loop, from the CUBINs that
`attnres device --compile-for ARCH --save DIR` writes: how many one trip issues, and how many
of them do the work (tensor-core products, exponentials, shared-memory loads, copies), so that
a kernel's overhead can be read without a GPU.

    python3 scripts/gpu/loop_instructions.py DIR [KERNEL ...]

KERNEL filters by substring (default: every kernel with a loop of 100 instructions or more).
The main loop is the longest backward branch of a kernel. A trip is a path through it that
issues all of its tensor-core products and global copies (the next tile's): the fewest
instructions such a path takes (a tile off the causal mask's diagonal, where the mask's branch
is not taken), then the most (a tile the mask crosses). A loop inside the main one, which ptxas did not unroll, counts once. Needs
`cuobjdump` and the `nvdisasm` it calls, on PATH or from PyPI's nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm (CUDA 13).
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
    sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
             "or put it on PATH")


def functions(sass):
    """(name, [(address, instruction)]) for each function of cuobjdump's listing."""
    for part in sass.split("Function : ")[1:]:
        name, _, body = part.partition("\n")
        code = [(int(a, 16), text) for a, text in INSTRUCTION.findall(body)]
        yield name.strip(), code


def main_loop(code):
    """The (address, instruction)s of the longest backward branch's span, or []."""
    best = (0, 0)
    for at, text in code:
        m = TARGET.search(text)
        if m and int(m.group(1), 16) < at:
            start = int(m.group(1), 16)
            if at - start > best[1] - best[0]:
                best = (start, at)
    return [(at, text) for at, text in code if best[0] <= at <= best[1]] if best[1] else []


def trips(loop):
    """The fewest and the most instructions' opcodes on a path from the loop's first
    instruction to its last (the backward branch) that issues the most tensor-core products,
    then the most global copies.
    Branches go forward inside the loop or leave it (a path that leaves is no trip); one that
    goes back inside it is taken as not taken."""
    index = {at: i for i, (at, _) in enumerate(loop)}
    last = len(loop) - 1

    def successors(i):
        at, text = loop[i]
        if i == last:
            return []
        op = opcode(text)
        guarded = GUARD.match(text) is not None
        if op == "EXIT" and not guarded:
            return None
        m = TARGET.search(text) if op == "BRA" else None
        if not m:
            return [i + 1]
        target = int(m.group(1), 16)
        taken = [index[target]] if target > at and target in index else []
        return taken + [i + 1] if guarded else (taken or None)

    products, copies = WORK["tensor-core products"], WORK["global copies"]
    fewest, most = [None] * len(loop), [None] * len(loop)
    for i in range(last, -1, -1):
        op = opcode(loop[i][1])
        mine = (int(op in products), int(op in copies))
        nexts = successors(i)
        if nexts is None:
            continue
        if not nexts:
            fewest[i] = most[i] = (mine, [op])
            continue
        for table, longer in ((fewest, False), (most, True)):
            ways = [table[j] for j in nexts if table[j] is not None]
            if not ways:
                continue
            key = lambda w: (w[0], len(w[1]) if longer else -len(w[1]))
            (p, c), ops = max(ways, key=key)
            table[i] = ((p + mine[0], c + mine[1]), [op] + ops)
    return [t[1] if t else [] for t in (fewest[0], most[0])]


def opcode(text):
    return GUARD.sub("", text).split()[0].split(".")[0]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    wanted = sys.argv[2:]
    tool = cuobjdump()
    # cuobjdump runs nvdisasm, which the wheels put beside it.
    os.environ["PATH"] = os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", "")
    for cubin in sorted(glob.glob(os.path.join(sys.argv[1], "*.cubin"))):
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True)
        if sass.returncode != 0:
            sys.exit(f"cuobjdump -sass {cubin}: {sass.stderr.strip()}")
        for name, code in sorted(functions(sass.stdout)):
            if wanted and not any(w in name for w in wanted):
                continue
            loop = main_loop(code)
            if len(loop) < (1 if wanted else 100):
                continue
            fewest, most = trips(loop)
            parts = [f"{sum(fewest.count(o) for o in codes)} {what}" for what, codes in WORK.items()]
            work = sum(fewest.count(o) for codes in WORK.values() for o in codes)
            print(f"{name}: {len(fewest)} instructions a trip ({', '.join(parts)}; "
                  f"{len(fewest) - work} other), {len(most)} on a tile the mask crosses")

if __name__ == "__main__":
    main()
