"""Build of the C extension; all other metadata lives in pyproject.toml.

``lightning_dlrover.parity._gf256`` holds the CPU GF(2^8) kernels. It is compiled for plain
x86-64 (no -march): the AVX2/AVX-512/GFNI kernels carry per-function target attributes and are
chosen at run time, so one build runs on any x86-64 CPU. It is optional: if no C compiler is
available the package still installs, and lightning_dlrover.parity warns and uses its
(much slower) portable torch kernels.
"""

import sys

from setuptools import Extension, setup

extra_compile_args = [] if sys.platform == "win32" else ["-O3", "-std=c11"]

setup(
    ext_modules=[
        Extension(
            "lightning_dlrover.parity._gf256",
            sources=["lightning_dlrover/parity/_gf256.c"],
            extra_compile_args=extra_compile_args,
            optional=True,
        )
    ]
)
