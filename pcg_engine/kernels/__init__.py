"""The project's Triton kernels (and, on CPU tensors, their runs in Triton's interpreter)."""

import os

# Triton's own reading of TRITON_INTERPRET (triton.knobs, getenv_bool): these values in any case, not
# stripped. The project read "1" alone in places: with TRITON_INTERPRET=true, Triton interpreted
# while the attention launcher took the GPU fast path ("0 active drivers" on the first step).
_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET as Triton reads it; the
    variable matters when triton is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE
