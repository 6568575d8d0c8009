"""The kernels compile for sm_90 without a GPU (Triton's own ptxas, outside the interpreter): every kernel that
benchmarks/offline_compile.py lists, with no GPU-wide fence in any of them, and the Gluon kernels, which have no CPU
interpreter, so this compile is what a machine without a GPU can check of them (their numbers are checked on the
GPU, tests/ops/test_triton_gpu.py)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _offline_compile():
    spec = importlib.util.spec_from_file_location("offline_compile", BENCHMARKS / "offline_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_compile_builds_every_listed_kernel_for_sm90():
    # benchmarks/offline_compile.py names each kernel's arguments: a kernel whose signature changed must be
    # updated there too. It compiles for sm_90 with Triton's own ptxas (no GPU), outside the interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "offline_compile.py"), "all"], capture_output=True,
                         text=True, env=env, timeout=600, cwd=BENCHMARKS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    reports = re.findall(r"registers \d+  spill stack \d+ B  LDL/STL \d+  shared \d+ B  SASS \d+", out.stdout)
    assert len(reports) == len(_offline_compile().KERNELS), out.stdout
    # Atomic adds are relaxed: an acq_rel one (Triton's default) fences the whole GPU around each instruction.
    fences = re.findall(r"GPU fences (\d+)", out.stdout)
    assert len(fences) == len(reports) and set(fences) == {"0"}, out.stdout


def _run_check(check: str, cases: int) -> list[str]:
    """Run `check` (a script printing one report line per compiled case, `... True registers ...` where the case
    holds) in a fresh interpreter without TRITON_INTERPRET (the compile needs the real backend); assert it printed
    `cases` lines, each True, and return them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=600,
                         cwd=BENCHMARKS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().split("\n")
    assert len(lines) == cases and all(" True registers " in line for line in lines), out.stdout
    return lines


def _assert_built(check: str, cases: int) -> list[str]:
    """_run_check, and every case without local-memory traffic."""
    lines = _run_check(check, cases)
    assert all(" spill stack 0 B " in line for line in lines), "\n".join(lines)
    return lines


def test_gluon_forward_builds_for_every_branch_and_head_dim():
    check = (
        "import sys; sys.path.insert(0, 'benchmarks'); import torch\n"
        "from offline_compile import compile_gluon, report\n"
        "from nsa.ops.gluon import common, forward as hf\n"
        "for D, h, mode, gated in ((64, 6, 0, False), (64, 6, 1, False), (64, 6, 2, True), (128, 16, 2, True)):\n"
        "    cfg = hf.config(D); warps = cfg.pop('num_warps')\n"
        "    kv = torch.empty(1, 256, 2, D, dtype=torch.bfloat16)\n"
        "    descs = {f'{x}_desc': common.descriptor(kv, cfg['BLOCK_N']) for x in 'kv'}\n"
        "    types = {'LSE': '*fp32', 'BITS': '*i64', 'scale_log2': 'fp32'}\n"
        "    types |= {n: '*bf16' for n in ('Q', 'O', 'O_CMP', 'O_WIN', 'GATES', 'OUT')}\n"
        "    consts = dict(h=h, MODE=mode, DK=D, DV=D, GATED=gated, **cfg)\n"
        "    c = compile_gluon(hf._span_forward_kernel, descs, consts, types, warps)\n"
        "    ptx = c.asm['ptx']\n"
        "    print(D, mode, 'wgmma.mma_async' in ptx and 'cp.async.bulk.tensor' in ptx, report(c))\n"
    )
    _assert_built(check, 4)


def test_gluon_dkdv_builds_for_every_branch_and_head_dim():
    check = (
        "import sys; sys.path.insert(0, 'benchmarks'); import torch\n"
        "from offline_compile import compile_gluon, report\n"
        "from nsa.ops.gluon import backward as hb, common\n"
        "for D, h, mode, atomic in ((64, 6, 0, True), (64, 6, 1, False), (64, 6, 2, True), (128, 16, 2, True)):\n"
        "    cfg = hb.config(D); warps = cfg.pop('num_warps')\n"
        "    kv = torch.empty(1, 256, 2, D, dtype=torch.bfloat16)\n"
        "    descs = {f'{x}_desc': common.descriptor(kv, cfg['BLOCK_N']) for x in 'kv'}\n"
        "    types = {n: '*fp32' for n in ('LSE', 'DELTA')} | {'Q': '*bf16', 'DO': '*bf16'}\n"
        "    types |= {n: '*fp32' if atomic else '*bf16' for n in ('DKo', 'DVo')}  # stored once: in k's type\n"
        "    types |= {'BITS': '*i64', 'scale_log2': 'fp32', 'scale': 'fp32'}\n"
        "    consts = dict(h=h, MODE=mode, D=D, ATOMIC=atomic, **cfg)\n"
        "    c = compile_gluon(hb._span_dkdv_kernel, descs, consts, types, warps, divisible=True)\n"
        "    ptx = c.asm['ptx']\n"
        "    print(D, mode, 'wgmma.mma_async' in ptx and 'cp.async.cg' in ptx, report(c))\n"
    )
    _assert_built(check, 4)


def test_gluon_query_grad_builds_for_each_selected_share():
    check = (
        "import sys; sys.path.insert(0, 'benchmarks'); import torch\n"
        "from offline_compile import compile_gluon, report\n"
        "from nsa.ops.gluon import common, query_grad as hq\n"
        "for D, h, sel in ((64, 6, 1), (64, 6, 2), (64, 6, 0), (128, 16, 3)):\n"
        "    cfg = hq.config(D); warps = cfg.pop('num_warps')\n"
        "    kv = torch.empty(1, 256, 2, D, dtype=torch.bfloat16)\n"
        "    descs = {f'{x}{c}_desc': common.descriptor(kv, cfg['BLOCK_N']) for x in 'kv' for c in 'csw'}\n"
        "    types = {f'{x}_{c}': '*fp32' for x in ('LSE', 'DELTA') for c in 'CSW'} | {'DQ_SEL': '*fp32'}\n"
        "    types |= {n: '*bf16' for n in ('Q', 'DO', 'DQ', 'PARTS')} | {'SEL_IDX': '*i64'}\n"
        "    types |= {'scale_log2': 'fp32', 'scale': 'fp32'}\n"
        "    consts = dict(h=h, HAS_CMP=True, HAS_WIN=True, SEL=sel, NP=16, D=D, **cfg)\n"
        "    c = compile_gluon(hq._query_grad_kernel, descs, consts, types, warps, divisible=True)\n"
        "    ptx = c.asm['ptx']\n"
        "    print(D, sel, 'wgmma.mma_async' in ptx and 'cp.async.bulk.tensor' in ptx, report(c))\n"
    )
    _assert_built(check, 4)


def test_gluon_selected_backward_builds_with_dq_shares_dq_adds_and_without_dq():
    check = (
        "import sys; sys.path.insert(0, 'benchmarks'); import torch\n"
        "from offline_compile import compile_gluon, report\n"
        "from nsa.ops.gluon import backward as hb, common, selected_backward as hs\n"
        "for D, h, write_dq, partials, add in ((64, 6, True, False, False), (64, 6, True, False, True),\n"
        "                                      (64, 1, True, True, False), (128, 16, False, True, False),\n"
        "                                      (32, 6, True, False, True), (16, 6, True, False, True)):\n"
        "    cfg = hb.config(D); warps = cfg.pop('num_warps')\n"
        "    kv = torch.empty(1, 256, 2, D, dtype=torch.bfloat16)\n"
        "    descs = {f'{x}_desc': common.descriptor(kv, cfg['BLOCK_N']) for x in 'kv'}\n"
        "    types = {n: '*fp32' for n in ('LSE', 'DELTA', 'DKo', 'DVo')}\n"
        "    types |= {n: '*bf16' for n in ('Q', 'DO')} | {'DQPART': '*fp32' if add else '*bf16'}\n"
        "    types |= {n: '*i32' for n in ('ITEM_KEY', 'ITEM_START', 'ITEM_COUNT', 'ENTRIES')}\n"
        "    types |= {'scale_log2': 'fp32', 'scale': 'fp32'}\n"
        "    consts = dict(n=16, h=h, D=D, WRITE_DQ=write_dq, PARTIALS=partials, DQ_ADD=add, **cfg)\n"
        "    c = compile_gluon(hs._selected_backward_kernel, descs, consts, types, warps, divisible=True)\n"
        "    ptx = c.asm['ptx']\n"
        "    print(D, h, 'wgmma.mma_async' in ptx and 'cp.async.cg' in ptx, report(c), 'atomics', add,\n"
        "          ptx.count('red.global') + ptx.count('atom.global'))\n"
    )
    lines = _assert_built(check, 6)
    shares, adds = (int(line.split()[-1]) for line in lines[:2])
    # A 64-row step's [64, 64] float32 dQ on 128 threads: 32 values each, as 8 four-wide reductions.
    assert adds == shares + 8, lines[:2]


def test_gluon_selected_forward_builds_for_both_head_dims():
    check = (
        "import sys; sys.path.insert(0, 'benchmarks'); import torch\n"
        "from offline_compile import compile_gluon, report\n"
        "from nsa.ops.gluon import common, selected_forward as hs\n"
        "for D, h in ((64, 6), (64, 1), (128, 4)):\n"
        "    cfg = hs.config(D); warps = cfg.pop('num_warps')\n"
        "    kv = torch.empty(1, 256, 2, D, dtype=torch.bfloat16)\n"
        "    descs = {f'{x}_desc': common.descriptor(kv, cfg['BLOCK_N']) for x in 'kv'}\n"
        "    types = {'Q': '*bf16', 'OPART': '*bf16', 'LSEPART': '*fp32', 'scale_log2': 'fp32'}\n"
        "    types |= {n: '*i32' for n in ('ITEM_KEY', 'ITEM_START', 'ITEM_COUNT', 'ENTRIES')}\n"
        "    consts = dict(n=16, h=h, D=D, **cfg)\n"
        "    c = compile_gluon(hs._selected_forward_kernel, descs, consts, types, warps, divisible=True)\n"
        "    ptx = c.asm['ptx']\n"
        "    print(D, h, 'wgmma.mma_async' in ptx and 'cp.async.cg' in ptx, report(c))\n"
    )
    _assert_built(check, 3)


def test_gluon_kernels_build_for_packed_documents():
    # PACKED reads nsa.ops.packing's tables (int32): each Gluon kernel's packed variant builds for sm_90 without
    # spilling (their numbers are checked against the Triton kernels on the GPU).
    check = (
        "import sys; sys.path.insert(0, 'benchmarks'); import torch\n"
        "from offline_compile import compile_gluon, report\n"
        "from nsa.ops.gluon import backward as hb, common, forward as hf, query_grad as hq\n"
        "from nsa.ops.gluon import selected_backward as hsb, selected_forward as hsf\n"
        "tables = ('DOC_START', 'CMP_START', 'DOC_END', 'CMP_READY', 'CMP_DOC_END', 'BLOCK_START', 'BLOCK_END')\n"
        "base = {n: '*i32' for n in tables + ('ITEM_KEY', 'ITEM_START', 'ITEM_COUNT', 'ENTRIES')}\n"
        "base |= {n: '*bf16' for n in ('Q', 'O', 'O_CMP', 'O_WIN', 'GATES', 'OUT', 'DO', 'DQ', 'PARTS', 'OPART')}\n"
        "base |= {n: '*fp32' for n in ('LSE', 'DELTA', 'DKo', 'DVo', 'LSEPART', 'DQPART', 'DQ_SEL')}\n"
        "base |= {f'{x}_{c}': '*fp32' for x in ('LSE', 'DELTA') for c in 'CSW'}\n"
        "base |= {'BITS': '*i64', 'SEL_IDX': '*i64', 'scale_log2': 'fp32', 'scale': 'fp32'}\n"
        "cases = ((hf._span_forward_kernel, hf.config, 'kv', dict(h=6, MODE=0, DK=64, DV=64, GATED=False)),\n"
        "         (hf._span_forward_kernel, hf.config, 'kv', dict(h=6, MODE=1, DK=64, DV=64, GATED=False)),\n"
        "         (hb._span_dkdv_kernel, hb.config, 'kv', dict(h=6, MODE=0, D=64, ATOMIC=True)),\n"
        "         (hb._span_dkdv_kernel, hb.config, 'kv', dict(h=6, MODE=1, D=64, ATOMIC=False)),\n"
        "         (hq._query_grad_kernel, hq.config, 'csw',\n"
        "          dict(h=6, HAS_CMP=True, HAS_WIN=True, SEL=3, NP=16, D=64)),\n"
        "         (hsf._selected_forward_kernel, hsf.config, 'kv', dict(n=16, h=6, D=64)),\n"
        "         (hsb._selected_backward_kernel, hb.config, 'kv',\n"
        "          dict(n=16, h=6, D=64, WRITE_DQ=True, PARTIALS=False, DQ_ADD=True)))\n"
        "for kernel, config, names, consts in cases:\n"
        "    cfg = config(64); warps = cfg.pop('num_warps')\n"
        "    kv = torch.empty(1, 256, 2, 64, dtype=torch.bfloat16)\n"
        "    if names == 'kv':\n"
        "        descs = {f'{x}_desc': common.descriptor(kv, cfg['BLOCK_N']) for x in 'kv'}\n"
        "    else:\n"
        "        descs = {f'{x}{c}_desc': common.descriptor(kv, cfg['BLOCK_N']) for x in 'kv' for c in names}\n"
        "    types = {n: t for n, t in base.items() if n in kernel.arg_names}\n"
        "    c = compile_gluon(kernel, descs, dict(consts, PACKED=True, **cfg), types, warps, divisible=True)\n"
        "    print(kernel.__name__, 'wgmma.mma_async' in c.asm['ptx'], report(c))\n"
    )
    _assert_built(check, 7)


def test_float32_launches_build_without_heavy_spills_within_shared_memory():
    # Float32 inputs with TF32 off multiply as IEEE FMA loops; their launches take the tiles of
    # nsa.ops.triton.common.ieee_products (read here from the launch helpers, on a stand-in CUDA float32 tensor).
    # At the bf16 tiles these kernels spilled tens of kilobytes a thread; at these they must stay under 2 KB and
    # fit sm_90's shared memory. With TF32 allowed, the block items at head dim 128 must fit it too (128 rows of
    # float32 tiles did not).
    check = (
        "import sys, types, re; sys.path.insert(0, 'benchmarks'); import torch\n"
        "import offline_compile as oc\n"
        "from nsa.ops.triton.common import tile_sizes\n"
        "from nsa.ops.triton import selected_attention as sa\n"
        "fake = types.SimpleNamespace(is_cuda=True, dtype=torch.float32, device=types.SimpleNamespace(type='cuda'),\n"
        "                             shape=(1, 64, 16, 128), element_size=lambda: 4)\n"
        "wide = dict(DK=128, DV=128, BLOCK_DK=128, BLOCK_DV=128, h=16)\n"
        "cases = []\n"
        "for precision in ('ieee', 'tf32'):\n"
        "    torch.backends.cuda.matmul.fp32_precision = precision\n"
        "    span = tile_sizes(fake, 64, 64, 'dkdv'); item = sa._item_launch(fake, 128)\n"
        "    rows = dict(wide, BLOCK_R=item['BLOCK_R'], DOT_PRECISION=precision)\n"
        "    if precision == 'ieee':\n"
        "        cases.append(('span_dkdv_win', {k: span[k] for k in ('BLOCK_M', 'BLOCK_N')}, span))\n"
        "    cases += [('sel_bwd', rows, item), ('sel_fwd_partial', rows, item)]\n"
        "torch.backends.cuda.matmul.fp32_precision = 'ieee'\n"
        "for name, consts, launch in cases:\n"
        "    c = oc.compile_kernel(name, consts, launch['num_warps'], launch.get('num_stages', 3), float32=True)\n"
        "    r = oc.report(c)\n"
        "    ok = int(re.search(r'spill stack (\\d+)', r).group(1)) < 2048 and c.metadata.shared <= oc.SM90_SHARED_BYTES\n"
        "    print(name, consts['DOT_PRECISION'] if 'DOT_PRECISION' in consts else 'ieee', ok, r)\n"
    )
    _run_check(check, 5)
