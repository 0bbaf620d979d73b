"""Session 24 scratch: why kernels/step_upload.py (commit 27cd7b0) raised 'misaligned address'.
Each variant in its own process (a CUDA error poisons the context), CUDA_LAUNCH_BLOCKING=1."""
import os, subprocess, sys

VARIANTS = ["all_cuda", "src_pinned", "pairs_pinned", "all_pinned", "src_pinned_scalar", "index_pinned", "value_pinned"]

def child(variant):
    import torch, triton, triton.language as tl

    @triton.jit(do_not_specialize=["n", "k"])
    def kern(dst_ptr, src_ptr, n, table_ptr, index_ptr, value_ptr, k, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        words = i < n
        tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=words), mask=words)
        pairs = i < k
        where = tl.load(index_ptr + i, mask=pairs, other=0)
        tl.store(table_ptr + where, tl.load(value_ptr + i, mask=pairs, other=0), mask=pairs)

    @triton.jit
    def copy1(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):   # one element a thread, n specialised
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)

    n, k = 900, 16
    src = torch.arange(n, dtype=torch.int64)
    index = torch.randperm(4096)[:k]
    value = torch.arange(k, dtype=torch.int32) + 7
    dst = torch.zeros(n, dtype=torch.int64, device="cuda")
    table = torch.zeros(4096, dtype=torch.int32, device="cuda")
    pin = lambda t: t.pin_memory()
    cuda = lambda t: t.cuda()
    s, ix, v = {"all_cuda": (cuda, cuda, cuda), "src_pinned": (pin, cuda, cuda), "pairs_pinned": (cuda, pin, pin),
                "all_pinned": (pin, pin, pin), "index_pinned": (cuda, pin, cuda), "value_pinned": (cuda, cuda, pin),
                "src_pinned_scalar": (pin, cuda, cuda)}[variant]
    S, I, V = s(src), ix(index), v(value)
    print(variant, "ptrs", [hex(t.data_ptr()) for t in (S, I, V)], "pinned", [t.is_pinned() for t in (S, I, V) if not t.is_cuda])
    if variant == "src_pinned_scalar":
        copy1[(2,)](dst, S, n, BLOCK=512)
    else:
        kern[(2,)](dst, S, n, table, I, V, k, BLOCK=512)
    torch.cuda.synchronize()
    ok = torch.equal(dst.cpu(), src)
    if variant != "src_pinned_scalar":
        ok = ok and torch.equal(table.cpu()[index], value)
    print(variant, "OK" if ok else "WRONG")

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        for v in VARIANTS:
            r = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
            tail = (r.stdout + r.stderr).strip().splitlines()
            print(f"{v}: rc={r.returncode}", *[l for l in tail if "ptrs" in l or "OK" in l or "WRONG" in l or "Error" in l][-3:], sep="\n  ")
