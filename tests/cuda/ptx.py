"""Compile every kernel to PTX for a target without a GPU, and assemble it with nvJitLink.

    python tests/cuda/ptx.py 9.0        # sm_90
    python tests/cuda/ptx.py 12.0a      # sm_120a (the original engine's target)
    python tests/cuda/ptx.py 9.0 gemv   # only the cases whose name holds "gemv"

Prints one JSON object: kernel name -> {"target": ".target sm_90", "sass_bytes": n,
"registers": r, "spill_bytes": s, "python_name", "pdl_aware", "grid_dep"} or {"error": "..."}.
Assembling the PTX to machine code checks what `compile_ptx` cannot: the inline-asm instructions (dp4a, mma.sync, vector loads)
must exist for the target, and the resource report shows registers and spills.

numba-cuda asks the driver for the current device's compute capability when it types a call
to a device function (even inside `compile_ptx`), so on a machine without a GPU this tool
answers that question with the target's capability.
"""

from __future__ import annotations

import json
import os
import re
import sys

# every module that compiles kernels (tests/test_ptx.py checks that none is missing)
KERNEL_MODULES = (
    "kernels.dequant", "kernels.gemv", "kernels.gemv_folds", "kernels.gemm", "kernels.norm", "kernels.rope",
    "kernels.attn_decode", "kernels.attn_lp", "kernels.attn_prefill", "kernels.flash", "kernels.swiglu", "kernels.embed",
    "kernels.act_quant", "kernels.sampler", "pages",
    "kernels.gdn", "kernels.gated_attn",
)  # fmt: skip


def parse_cc(text: str) -> tuple:
    m = re.fullmatch(r"(\d+)\.(\d+)(a?)", text)
    if not m:
        raise SystemExit(f"compute capability like 9.0 or 12.0a expected, got {text!r}")
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    return (major, minor, "a") if arch else (major, minor)


def _answer_device_queries(cc: tuple) -> None:
    import numba.cuda.dispatcher as dispatcher

    class _Target:
        compute_capability = cc[:2]

    dispatcher.get_current_device = lambda: _Target()


def all_cases():
    """(name, pyfunc, signature) of every module's ptx_cases()."""
    import importlib

    return [case for name in KERNEL_MODULES for case in importlib.import_module(f"ninfer.gpu.cuda.{name}").ptx_cases()]


def assemble(ptx: str, cc: tuple) -> dict:
    """Assemble PTX with nvJitLink; registers / spills parsed from its verbose log."""
    from cuda.bindings import nvjitlink

    arch = f"-arch=sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"
    handle = nvjitlink.create(2, [arch, "-verbose"])
    data = ptx.encode()
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
        nvjitlink.complete(handle)
        size = nvjitlink.get_linked_cubin_size(handle)
        log = _log(nvjitlink, handle, "info")
    except Exception as exc:  # the error log says which instruction the assembler refused
        return {"error": f"{exc}: {_log(nvjitlink, handle, 'error')[-2000:]}"}
    finally:
        nvjitlink.destroy(handle)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    stack = re.findall(r"(\d+) bytes stack frame", log)
    return {
        "sass_bytes": int(size),
        "registers": max(map(int, regs)) if regs else None,
        "spill_bytes": max(map(int, spills)) if spills else 0,
        "stack_bytes": max(map(int, stack)) if stack else 0,
    }


def _log(nvjitlink, handle, kind: str) -> str:
    size = getattr(nvjitlink, f"get_{kind}_log_size")(handle)
    buf = bytearray(size)
    getattr(nvjitlink, f"get_{kind}_log")(handle, buf)
    return buf.decode(errors="replace").rstrip("\x00")


def _pdl_report(ptx: str) -> dict:
    """The kernel's Python name as graphs.programmatic_edges reads it from the entry symbol,
    whether pdl.py counts it aware, and whether its PTX holds both griddepcontrol instructions."""
    from ninfer.gpu.cuda.kernels import pdl

    entry = re.search(r"\.entry\s+(\S+?)\(", ptx)
    mangled = entry.group(1) if entry else ""
    return {
        "python_name": pdl.python_name(mangled),
        "pdl_aware": pdl.is_aware(mangled),
        "grid_dep": "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx,
    }


def compile_all(cc: tuple, only: str | None = None) -> dict:
    from numba import cuda

    _answer_device_queries(cc)
    results = {}
    for name, fn, sig in all_cases():
        if only and only not in name:
            continue
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            continue
        target = next((line.strip() for line in ptx.splitlines() if line.startswith(".target")), "")
        results[name] = {"target": target, **assemble(ptx, cc), **_pdl_report(ptx)}
    return results


def main(argv: list[str]) -> int:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise SystemExit("PTX compilation needs the real numba-cuda target: unset NUMBA_ENABLE_CUDASIM")
    cc = parse_cc(argv[0] if argv else "9.0")
    results = compile_all(cc, argv[1] if len(argv) > 1 else None)
    json.dump(results, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
