"""
The one compiled part: the broker's fast-path system calls made from C
(native/_hostpid_native.c).  Optional: where it cannot be built (no
compiler, no Python headers) the install goes on and the broker makes the
same calls from Python (hostpid/broker/connections.py, descriptors.py), only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "_hostpid_native",
            sources=["native/_hostpid_native.c"],
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
