"""Settings of this repository's own test session (the packaged suite does not use them)."""

from __future__ import annotations

import os

# PyTensor's default mode (Numba, in PyTensor 3) compiles each new function in about a second,
# a cost a user pays once per function; this suite compiles thousands of small ones, which
# would take many minutes on a cold cache.  FAST_COMPILE runs the same graphs; the adapter's
# tests also exercise the default mode explicitly.  A value the caller set is kept.
os.environ.setdefault("PYTENSOR_FLAGS", "mode=FAST_COMPILE")
