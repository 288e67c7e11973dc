"""`python -m mok.kernels.native`: builds the native eager path ahead of its first call (mok/kernels/native).
Guarded: tools that import every module of mok.kernels (rl/contract.py's kernel_configuration) import this one too."""
import sys

from mok.kernels import native

if __name__ == "__main__":
    built = native.load() is not None
    print("mok native eager path:", "built" if built else "not available (the Python path runs)")
    sys.exit(0 if built else 1)
