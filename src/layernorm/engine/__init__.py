"""The C++ CPU engine: its sources (``csrc/``), its build (:mod:`.build`) and its loader
(:mod:`.loader`).

The kernels of every norm (``csrc/engine.h``; ``forward.cpp``, ``backward.cpp``), compiled once
per instruction set (x86-64-v3: AVX2 and FMA; x86-64-v4: AVX-512), and the operator that runs
them on torch's threads (``csrc/operator.h``), which registers the ops' CPU kernels for
:mod:`layernorm.torch` and the entry points of :mod:`layernorm.cpu`. The wheel holds them built
(``_built/``); ``layernorm build`` builds them for another torch into the user's cache. Nothing
is compiled at an import or a call. Importing this package imports neither torch nor an API.
"""
