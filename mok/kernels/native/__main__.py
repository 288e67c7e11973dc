"""`python -m mok.kernels.native`: builds the native eager path ahead of its first call (mok/kernels/native)."""
import sys

from mok.kernels import native

built = native.load() is not None
print("mok native eager path:", "built" if built else "not available (the Python path runs)")
sys.exit(0 if built else 1)
