"""CPU reference paths: the same semantics as the Triton kernels, batch-invariant by construction.

Why not BLAS: MKL/oneDNN/OpenBLAS may treat a row differently by its position inside a micro-kernel
block, so a row's bits can depend on its neighbours. Here every reduction is written as a sequential
loop of element-wise ops (multiply, then add: two roundings, never a fused multiply-add), and an
element-wise op is exactly rounded per element whatever the tensor's size or vectorisation. A row's
bits therefore depend only on that row and the reduction length.
"""
