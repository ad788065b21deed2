"""write_kv on the GPU against the reference writer, byte for byte (H200; nothing here ships): random K/V
rows into per-token and per-tensor caches (D 128, pages 64, 5-D V), counting the scale entries and cache
bytes that differ. Found with it: Triton's fp32 `/` (div.full.f32, approximate) left per-token scales 1 ulp
off the reference's IEEE division (the long-decode GPU test's byte-equality failed); write_kv now divides
with div_rn. Run from the repo root: python3 benchmarks/pa_probe/write_kv_bytes.py"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from pa_backend import write_kv  # noqa: E402
from pa_backend.fp8 import fp8_dtype_for  # noqa: E402

dev = torch.device("cuda")
fp8 = fp8_dtype_for(dev)
NB, Hkv, D, bs, T = 512, 2, 128, 64, 20000
g = torch.Generator().manual_seed(1)
for scales in ("token", "tensor"):
    sides = []
    for impl in ("triton", "torch"):
        kc = torch.zeros(NB, Hkv, D // 16, bs, 16, dtype=torch.uint8, device=dev).view(fp8)
        vc = torch.zeros(NB, Hkv, bs // 16, D, 16, dtype=torch.uint8, device=dev).view(fp8)
        if scales == "token":
            ks, vs = (torch.zeros(NB, Hkv, bs, device=dev) for _ in range(2))
        else:
            ks, vs = torch.tensor(0.02, device=dev), torch.tensor(0.015, device=dev)
        sides.append((kc, vc, ks, vs))
    k = (torch.randn(T, Hkv, D, generator=g) * 3).bfloat16().to(dev)
    v = (torch.randn(T, Hkv, D, generator=g) * 2).bfloat16().to(dev)
    slots = torch.randperm(NB * bs, generator=g)[:T].to(dev)
    for impl, (kc, vc, ks, vs) in zip(("triton", "torch"), sides):
        write_kv(k, v, kc, vc, slots, ks, vs, backend=impl)
    (a, b) = sides
    nk = int((a[0].view(torch.uint8) != b[0].view(torch.uint8)).sum())
    nv = int((a[1].view(torch.uint8) != b[1].view(torch.uint8)).sum())
    ns = int((a[2] != b[2]).sum()) + int((a[3] != b[3]).sum())
    print(f"{scales:6s} scales: {T} tokens x {Hkv} heads: differing K bytes {nk}, V bytes {nv}, scale entries {ns}")
