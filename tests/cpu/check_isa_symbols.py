#!/usr/bin/env python3
"""Checks that the per-ISA CPU kernel objects keep their instructions to themselves.

Usage: check_isa_symbols.py ARCHIVE [ARCHIVE ...] (static libraries holding src/cpu/kernels_<level>.cpp.o; the
build passes the library and a copy compiled at -O0, where no shared inline function is inlined away).

An inline or template function is emitted weakly in every object that uses it, and the linker keeps one copy:
if kernels_avx512.cpp.o exported such a function compiled with AVX-512 instructions under a name the baseline
code also uses, the archive order alone would decide whether an AVX2-only machine runs it. So every global
symbol a per-ISA object defines must be its level's own: in the level's namespace
(kvsift::cpu::detail::isa_<level>), or a kernel entry point templated on its SimdLevel. Any other function (an
inline function of a shared header that a debug build leaves out of line) must contain no instruction of the
level: no VEX or EVEX encoding, no ymm or zmm register. Exits 1, listing the offenders, otherwise 0.
"""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2}  # kvsift::cpu::SimdLevel's values


def run(*cmd, cwd=None):
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout


def function_bodies(obj):
    """Demangled function name -> its disassembly lines."""
    bodies, current = {}, None
    for line in run("objdump", "-d", "-C", "--no-show-raw-insn", obj).splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            current = bodies.setdefault(header.group(1), [])
        elif current is not None and line.startswith(" "):
            current.append(line)
    return bodies


# Beyond baseline x86-64 (SSE2) without a VEX prefix: the bit instructions the avx2 target implies (POPCNT,
# LZCNT, BMI1/2; AT&T adds a size suffix) and the AVX-512 mask-register instructions.
EXTRA_MNEMONIC = re.compile(r"^((popcnt|lzcnt|tzcnt|andn|bextr|blsi|blsmsk|blsr|bzhi|pdep|pext|sarx|shlx|shrx|rorx)"
                            r"[wlq]?|k(mov|and|andn|or|xor|xnor|not|add|shift|unpck|test|ortest)\w*)$")


def uses_level_instructions(lines):
    # AT&T syntax: every VEX/EVEX-encoded instruction's mnemonic starts with 'v' (vmovss, vfmadd231ps, ...);
    # baseline x86-64 code is SSE2 at most (movss, addps, ...).
    for line in lines:
        parts = line.split("\t")
        mnemonic = parts[1].split()[0] if len(parts) > 1 and parts[1].split() else ""
        if (mnemonic.startswith("v") or EXTRA_MNEMONIC.match(mnemonic) or "%ymm" in line or "%zmm" in line
                or re.search(r"%k[0-7]\b", line)):
            return True
    return False


def main():
    failed = 0
    for path in sys.argv[1:]:
        failed |= check_archive(Path(path).resolve())
    return failed


def check_archive(archive):
    members = [m for m in run("ar", "t", str(archive)).split() if re.match(r"kernels_(\w+)\.cpp\.o$", m)]
    found = {re.match(r"kernels_(\w+)\.cpp\.o$", m).group(1) for m in members}
    if found != set(LEVELS):
        print(f"expected the objects of levels {sorted(LEVELS)} in {archive}, found {sorted(found)}")
        return 1
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        run("ar", "x", str(archive), *members, cwd=tmp)
        for member in members:
            level = re.match(r"kernels_(\w+)\.cpp\.o$", member).group(1)
            obj = str(Path(tmp) / member)
            namespace = f"isa_{level}"
            # Demangled, or mangled where the demangler gives up (length-prefixed source names).
            own_namespace = (f"kvsift::cpu::detail::{namespace}::", f"{len(namespace)}{namespace}")
            own_entry = f"(kvsift::cpu::SimdLevel){LEVELS[level]}"
            bodies = None
            exported = 0
            for line in run("nm", "-C", "-g", "--defined-only", obj).splitlines():
                _, kind, name = line.split(" ", 2)
                exported += 1
                if kind not in "TW":
                    continue  # data (e.g. a shared header's inline constexpr variable) holds no instructions
                if any(n in name for n in own_namespace) or own_entry in name:
                    continue
                if level == "scalar":
                    continue  # baseline code: sharing it is harmless
                if bodies is None:
                    bodies = function_bodies(obj)
                body = next((b for n, b in bodies.items() if n == name or n.endswith(name)), None)
                if body is None or uses_level_instructions(body):
                    failures.append(f"{member}: exports '{name}', not specific to level {level}, "
                                    + ("with its instructions" if body else "(no disassembly found)"))
            print(f"{archive.name}: {member}: {exported} exported symbols checked")
    for f in failures:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
