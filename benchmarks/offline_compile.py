"""Compile an NSA kernel for sm_90 without a GPU: registers, spills, shared memory and the SASS instruction mix.

    python benchmarks/offline_compile.py KERNEL [NAME=VALUE ...] [--warps N] [--stages N] [--float32]

KERNEL is one of the names below, at M7C's shapes (head dim 64, 6 heads per key/value group), or `all` (each with
its own constants); NAME=VALUE overrides a compile-time constant (e.g. BLOCK_R=32). Pointers and the integer arguments that are multiples
of 16 at M7C's shapes get Triton's divisible-by-16 specialisation, as on the GPU. Registers, spills (stack bytes,
LDL/STL) and the mix of the arithmetic are what this is for: a kernel that spills on the GPU shows it here first.
"GPU fences" counts GPU-wide memory barriers: Triton's atomics default to acq_rel, which puts one (and an L1
invalidation) around every atomic instruction; the kernels' float32 reductions ask for relaxed ones.
--float32 compiles for float32 inputs (bf16 pointers become float32, products at dot_precision(float32) with TF32
off, i.e. IEEE); pass the tiles such launches take (nsa.ops.triton.common.ieee_products), e.g. `span_dkdv_win
BLOCK_M=32 BLOCK_N=32 --float32 --warps 8 --stages 1`. Shared memory past sm_90's limit is flagged: such a launch
fails on the GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nsa.ops.triton import (compression, decode, dense_decode, inverse_index, query_grad, selected_attention, selection,
                            span_attention)
from nsa.ops.triton.common import dot_precision

BF16, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
DIMS = dict(DK=64, DV=64, BLOCK_DK=64, BLOCK_DV=64)
# Integer arguments that are multiples of 16 at M7C's shapes (T = 65,536; strides of contiguous [B,T,H,64] and
# [B,T,G,64] tensors, the selection's [B,T,G,16] indices): Triton specialises those on the GPU, and the wider loads
# it then emits change the register count. Gate (t, h) and log-sum-exp t strides (36, 3, 12) are not.
DIVISIBLE = {
    *(f"s{t}{d}" for t in ("q", "do", "o", "dq", "k", "v", "dk", "dv", "c", "s", "w", "kc", "vc", "ks", "vs", "kw",
                            "vw", "ds") for d in "btghc"),
    "sgb", "slb", "sib", "sit", "sig", "T", "NS", "n", "n_sel", "sel_block", "block_len", "block_stride", "window",
    "rows_per_split", "chunk_tokens", "NC",
} - {"sgt", "sgh", "sgc"}
# Unpacked launches pass None for the packed documents' tables (constexpr: absent from the compiled kernel).
UNPACKED = dict(PACKED=False, DOC_START=None, DOC_END=None, CMP_START=None, SEL_START=None, BLOCK_START=None,
                BLOCK_END=None)
# The span and dQ kernels' tables of packed documents (nsa.ops.packing): pointers with PACKED, else None
# (constexpr: absent from the compiled kernel, which is then the unpacked one).
SPAN_TABLES = dict(DOC_START=I32, DOC_END=I32, CMP_START=I32, CMP_READY=I32, CMP_DOC_END=I32)


def span_tables(packed: bool) -> dict:
    return dict(PACKED=True) if packed else dict(PACKED=False, **dict.fromkeys(SPAN_TABLES))


# kernel: (function, constexprs, pointer types, float scalars); every other argument is an i32 scalar.
KERNELS = {
    "select": (selection._select_kernel,
               dict(DK=64, BLOCK_DK=64, BLOCK_T=16, HA=4, HB=2, K=16, C=64, R=4, TRANS=True, EXACT=True, **UNPACKED),
               dict(Q=BF16, KC=BF16, LSE=F32, IDX=I64), ("scale_log2",)),
    "sel_fwd_partial": (selected_attention._sel_fwd_partial_kernel, dict(**DIMS, BLOCK_L=64, BLOCK_R=64, h=6, n=16,
                                                                        FULL=True, **UNPACKED),
                        dict(Q=BF16, K=BF16, V=BF16, OPART=BF16, LSEPART=F32, ITEM_KEY=I32, ITEM_START=I32,
                             ITEM_COUNT=I32, ENTRIES=I32), ("scale_log2",)),
    "sel_bwd": (selected_attention._sel_bwd_kernel,
                dict(**DIMS, BLOCK_L=64, BLOCK_R=64, WRITE_DQ=True, h=6, n=16, FULL=True, **UNPACKED),
                dict(Q=BF16, K=BF16, V=BF16, DO=BF16, LSE=F32, DELTA=F32, DKo=F32, DVo=F32, DQPART=BF16,
                     ITEM_KEY=I32, ITEM_START=I32, ITEM_COUNT=I32, ENTRIES=I32), ("scale_log2", "scale")),
    "sel_token_dq": (selected_attention._sel_token_dq_kernel, dict(**DIMS, HP=16, BLOCK_L=64, **UNPACKED),
                     dict(Q=BF16, K=BF16, V=BF16, IDX=I64, DO=BF16, LSE=F32, DELTA=F32, DQ=F32),
                     ("scale_log2", "scale")),
    "finalize": (selected_attention._finalize_kernel, dict(MERGE=True, DV=64, BLOCK_DV=64, BLOCK_M=64, NP=16, h=6),
                 dict(OPART=BF16, LSEPART=F32, IDX=I64, O_CMP=BF16, O_WIN=BF16, GATES=BF16, O=BF16, O_SEL=BF16,
                      LSE_SEL=F32), ()),
    **{f"span_{kind}_{mode}{suffix}": (kernel, dict(**DIMS, MODE=m, BLOCK_M=128, BLOCK_N=64,
                                                    ONE_BLOCK=m == 2 and not packed, h=6) | extra
                                         | ({"GATED": m == 2} if kind == "fwd" else {}) | span_tables(packed),
                                         dict(Q=BF16, K=BF16, V=BF16, O=BF16, LSE=F32, IDX=I64, DO=BF16,
                                              DELTA=F32, DQ=F32, DKo=F32, DVo=F32, O_CMP=BF16, O_WIN=BF16,
                                              GATES=BF16, OUT=BF16, **SPAN_TABLES), ("scale_log2", "scale"))
       for kind, kernel, extra in (("fwd", span_attention._span_fwd_kernel, {}),
                                   ("dkdv", span_attention._span_dkdv_kernel, dict(ATOMIC=True)))
       for m, mode in enumerate(("cmp", "win", "sel"))
       for suffix, packed in (("", False), ("_packed", True))},
    **{f"query_grad_{name}{suffix}": (query_grad._query_grad_kernel,
                                       dict(**DIMS, HAS_CMP=True, HAS_WIN=True, SEL=sel, NP=16, BLOCK_M=64,
                                            BLOCK_N=32 if sel == 1 else 64, ONE_BLOCK=not packed, h=6)  # dq tiles
                                       | span_tables(packed),
                                       dict(Q=BF16, DO=BF16, DQ=BF16, KC=BF16, VC=BF16, KS=BF16, VS=BF16, KW=BF16,
                                            VW=BF16, SEL_IDX=I64, PARTS=BF16, DQ_SEL=F32, **SPAN_TABLES,
                                            **{f"{x}_{c}": F32 for x in ("LSE", "DELTA") for c in "CSW"}),
                                       ("scale_log2", "scale"))
       for name, sel, suffix, packed in (("tiled", 1, "", False), ("parts", 2, "", False),
                                         ("tiled", 1, "_packed", True))},
    "index_keys": (inverse_index._entry_keys_kernel, dict(n=16, BLOCK=1024, **UNPACKED), dict(IDX=I64, KEYS=I32), ()),
    "index_bounds": (inverse_index._key_bounds_kernel, dict(BLOCK=1024), dict(SORTED=I32, STARTS=I32, ENDS=I32),
                     ()),
    "index_counts": (inverse_index._key_items_kernel, dict(BLOCK=1024), dict(STARTS=I32, ENDS=I32, ITEMS=I32), ()),
    "index_items": (inverse_index._items_kernel, dict(STEPS=12, BLOCK=1024),
                    dict(STARTS=I32, COUNTS=I32, ITEMS=I32, ITEM_END=I32, ITEM_KEY=I32, ITEM_START=I32,
                         ITEM_COUNT=I32), ()),
    # phi's MLP at M7C's keys and values (l = 32, d = 16, hidden 128) on packed documents (PACKED=False: unpacked).
    **{f"phi_{name}": (kernel, dict(L=32, D=64, H=128, BLOCK_D=64, BLOCK_H=128, PACKED=True) | extra,
                       dict(X0=BF16, X1=BF16, POS0=F32, POS1=F32, W1_0=BF16, W1_1=BF16, W2_0=F32, W2_1=F32, OUT=BF16,
                            HID=F32, DY=BF16, DH=BF16, DH_SUM=F32, DW2=F32, DX0=BF16, DX1=BF16, DW1=F32, DPOS=F32,
                            ROW_START=I32, CHUNK_START=I32, DOC_START=I32, DOC_END=I32, CMP_START=I32) | pointers, ())
       for name, kernel, extra, pointers in (
           ("fwd", compression._phi_fwd_kernel, dict(BLOCK_M=64), {}),
           ("bwd_rows", compression._phi_bwd_rows_kernel, dict(BLOCK_M=64, ATOMIC=True), {}),
           ("bwd_tokens", compression._phi_bwd_tokens_kernel, dict(R=2, BLOCK_C=64), {}),
           ("bwd_w1", compression._phi_bwd_w1_kernel, dict(BLOCK_K=64, ATOMIC=True), dict(W1_0=F32, W1_1=F32)))},
    "decode_chunk": (decode._chunk_kernel, dict(**DIMS, HP=16, K=16, C=64, R=4, CPP=8, STAGES=3),
                     dict(Q=BF16, KC=BF16, VC=BF16, NCMP=I64, PM=F32, PL=F32, PACC=F32, PSC=F32), ("scale_log2",)),
    "decode_select_part": (decode._select_part_kernel, dict(HP=16, BLOCK_DV=64, K=16, CT=8, PT=8, PTS=64),
                           dict(PM=F32, PL=F32, PACC=F32, PSC=F32, POS=I64, PK=I64, GM=F32, GL=F32, GACC=F32), ()),
    "decode_select": (decode._select_kernel, dict(HP=16, K=16, CT=8, PT=8),
                      dict(PM=F32, PSC=F32, PL=F32, POS=I64, IDX=I64), ()),
    "decode_span": (decode._span_kernel, dict(**DIMS, HP=16, BLOCK_N=64, K=16, CT=8, RANK=True),
                    dict(Q=BF16, KS=BF16, VS=BF16, KW=BF16, VW=BF16, POS=I64, IDX=I64, PK=I64, PM=F32, PL=F32,
                         PACC=F32, PR=I32), ("scale_log2",)),
    "decode_combine": (decode._combine_kernel, dict(DV=64, BLOCK_DV=64, HP=16, PC=8, PS=16, PW=8, DVT=16, NPP=32),
                       dict(GATE=BF16, NCMP=I64, CM=F32, CL=F32, CACC=F32, PM=F32, PL=F32, PACC=F32, PR=I32, O=BF16,
                            READS=I64), ()),
    "dense_decode_split": (dense_decode._split_kernel, dict(**DIMS, HP=16, SPLIT=512, BLOCK_N=64),
                           dict(Q=BF16, K=BF16, V=BF16, POS=I64, PM=F32, PL=F32, PACC=F32), ("scale_log2",)),
    "dense_decode_merge": (dense_decode._merge_kernel, dict(DV=64, BLOCK_DV=64, HP=16, PT=16, DVT=32),
                           dict(PM=F32, PL=F32, PACC=F32, O=BF16), ()),
}


SM90_SHARED_BYTES = 232448  # the most shared memory one program may opt into on sm_90


def float32_precision_without_tf32() -> str:
    """dot_precision(float32) with PyTorch's TF32 switch off (it is restored)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        return dot_precision(torch.float32)
    finally:
        matmul.fp32_precision = before


def _constant(text: str) -> bool | int | str:
    """A NAME=VALUE override's value: True/False, an integer, or a string (e.g. DOT_PRECISION=tf32)."""
    if text in ("True", "False"):
        return text == "True"
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else text


def compile_kernel(name: str, overrides: dict, warps: int, stages: int, float32: bool = False):
    kernel, consts, pointers, floats = KERNELS[name]
    names = list(kernel.arg_names)
    dtype = torch.float32 if float32 else torch.bfloat16
    if float32:
        pointers = {n: F32 if t == BF16 else t for n, t in pointers.items()}
    # The products' precision of the inputs, for the kernels that take one (nsa.ops.triton.common.dot_precision).
    precision = float32_precision_without_tf32() if float32 else dot_precision(dtype)
    consts = ({"DOT_PRECISION": precision} if "DOT_PRECISION" in names else {}) | consts | overrides
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    divisible = (DIVISIBLE | ({"NK"} if consts.get("MODE", 0) else set())) - (
        {"sit", "sig"} if consts.get("MODE") == 2 else set())  # MODE_SEL's chosen bits are [B,T,G] int64
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n in divisible)}
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items() if k in names}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def compile_gluon(kernel, descriptors: dict, consts: dict, types: dict, warps: int, divisible: bool = False,
                  maxnreg: int | None = None):
    """A Gluon kernel compiled for sm_90: `descriptors` maps argument names to host TensorDescriptors (their
    types), `types` gives the other non-i32 arguments' types (e.g. "*bf16", "fp32"). With `divisible`, pointers
    and the integers in DIVISIBLE get the divisible-by-16 specialisation they get on the GPU at M7C's shapes (a
    kernel whose 16-byte copies rely on it compiles only with it). `maxnreg` caps the registers per thread (a
    warp-specialised kernel shares them out between its partitions)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = kernel.arg_names
    # constexpr arguments left out take their defaults, as a launch that omits them does
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    consts = dict(defaults, **consts, num_warps=warps)
    sig = {n: "constexpr" if n in consts else mangle_type(descriptors[n]) if n in descriptors else types.get(n, "i32")
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if divisible and (sig[n].startswith("*") or n in DIVISIBLE)}
    src = GluonASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items() if k in names}, attrs)
    options = {"num_warps": warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def report(compiled) -> str:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        run = lambda *a: subprocess.run([os.path.join(bindir, "cuobjdump"), *a, f.name],  # noqa: E731
                                        capture_output=True, text=True).stdout
        usage, sass = run("--dump-resource-usage"), run("-sass")
    instructions = len(re.findall(r"/\*[0-9a-f]{4,6}\*/", sass))
    regs = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    return (f"registers {regs}  spill stack {stack} B  LDL/STL {sass.count('LDL') + sass.count('STL')}  "
            f"shared {compiled.metadata.shared} B"
            f"{' (over sm_90 limit: the launch fails)' if compiled.metadata.shared > SM90_SHARED_BYTES else ''}  "
            f"SASS {instructions}  "
            f"MMA {sass.count('HMMA') + sass.count('HGMMA')}  MUFU.EX2 {sass.count('MUFU.EX2')}  "
            f"BAR {sass.count('BAR.SYNC')}  LDGSTS {sass.count('LDGSTS')}  LDG {sass.count('LDG.')}  "
            f"GPU fences {sass.count('MEMBAR.ALL.GPU') + sass.count('MEMBAR.SC.GPU')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(KERNELS) + ["all"])
    ap.add_argument("overrides", nargs="*", help="NAME=VALUE compile-time constants (integers or True/False)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--float32", action="store_true", help="float32 inputs, products at float32 accuracy")
    args = ap.parse_args()
    overrides = {}
    for item in args.overrides:
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"offline_compile: expected NAME=VALUE, got {item!r}")
        overrides[key] = _constant(value)
    for name in KERNELS if args.kernel == "all" else [args.kernel]:
        print(name, f"warps {args.warps}", *args.overrides, "float32" if args.float32 else "", "\n  " + report(
            compile_kernel(name, overrides, args.warps, args.stages, args.float32)), flush=True)


if __name__ == "__main__":
    main()
