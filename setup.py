"""
The one compiled part: mode received's system calls made from C
(native/_hostpid_received.c).  Optional: where it cannot be built (no
compiler, no Python headers) the install goes on and the broker makes the
same calls from Python (hostpid/broker/descriptors.py), only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "_hostpid_received",
            sources=["native/_hostpid_received.c"],
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
