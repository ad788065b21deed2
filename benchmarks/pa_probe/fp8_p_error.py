"""How far an FP8 P (one e4m3 term) moves the attention output, on CPU: the error bound question behind an
FP8 P.V for the prefill target (issue 15). float64 throughout except P, which is rounded as a kernel would
round it (p in [0, 1] scaled by 256, one e4m3 term); K and V are FP8 bytes of a normal draw, as in `bench pa`.
Prints the output's relative error (Frobenius norm, `pa_backend.benchmark.accuracy`'s measure) against the
project's 3e-3 bound. Run: python benchmarks/pa_probe/fp8_p_error.py
"""

import torch

ACCURACY_TARGET = 3e-3


def one_term_error(n: int, rows: int = 64, D: int = 128, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, D, generator=g, dtype=torch.float64)
    k = torch.randn(n, D, generator=g).to(torch.float8_e4m3fn).double()
    v = torch.randn(n, D, generator=g).to(torch.float8_e4m3fn).double()
    s = (q @ k.T) / D ** 0.5
    p = torch.exp(s - s.max(1, keepdim=True).values)
    L = p.sum(1, keepdim=True)
    ref = (p @ v) / L
    p8 = (p * 256).to(torch.float8_e4m3fn).double() / 256
    return (((p8 @ v) / L - ref).norm() / ref.norm()).item()


if __name__ == "__main__":
    for n in (1024, 8192, 32768):
        e = max(one_term_error(n, seed=s) for s in range(4))
        print(f"{n:6d} tokens: one-term FP8 P, rel. error {e:.2e} "
              f"({'meets' if e <= ACCURACY_TARGET else 'misses'} {ACCURACY_TARGET:g})")
