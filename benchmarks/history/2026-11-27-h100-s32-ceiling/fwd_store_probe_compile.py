"""fwd_store_probe.py's kernel compiled for sm_90 without a GPU (registers, shared memory, stores), each epilogue.

    PYTHONPATH=benchmarks:. python benchmarks/history/2026-11-27-h100-s32-ceiling/fwd_store_probe_compile.py
"""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_compile import compile_gluon, report
from nsa.ops.triton import hopper_forward as hf, hopper_selected_forward as hs
import fwd_store_probe as p
D, h = 64, 6
for store in (0, 1, 2):
    cfg = hs.hopper_selected_forward_config(D); warps = cfg.pop('num_warps')
    kv = torch.empty(1, 256, 2, D, dtype=torch.bfloat16)
    descs = {'k_desc': hf._descriptor(kv, cfg['BLOCK_N']), 'v_desc': hf._descriptor(kv, cfg['BLOCK_N'])}
    types = {'Q': '*bf16', 'OPART': '*bf16', 'LSEPART': '*fp32', 'SINK': '*fp32', 'scale_log2': 'fp32'}
    types |= {n: '*i32' for n in ('ITEM_KEY', 'ITEM_START', 'ITEM_COUNT', 'ENTRIES')}
    consts = dict(n=16, h=h, D=D, STORE=store, **cfg)
    c = compile_gluon(p._probe_kernel, descs, consts, types, warps, divisible=True)
    print(store, report(c), "st.global:", c.asm['ptx'].count('st.global'), flush=True)
