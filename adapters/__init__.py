"""One adapter module per AD library, installed as ``abstractdiff.adapters``.

Each module imports its library at import time; the registry imports a module only
when its backend is first created, so ``import abstractdiff`` imports none of them.
"""
