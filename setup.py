"""Builds kvformat's optional C extension (kvformat.format._kvfnative); all metadata lives in pyproject.toml.

The extension is optional: if the compiler is missing or the build fails, the install still succeeds and
kvformat uses its pure-Python paths (python-xxhash, os.preadv/os.writev). Set KVFORMAT_REQUIRE_NATIVE=1 to
make a failed build fail the install (CI does, so a broken build cannot silently fall back).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # no compiler at all (distutils raises before building)
            self._failed(e)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        if os.environ.get("KVFORMAT_REQUIRE_NATIVE") == "1":
            raise
        print(f"kvformat: the optional C extension was not built ({e}); using the pure-Python fallback")


setup(
    ext_modules=[Extension(
        "kvformat.format._kvfnative",
        sources=["csrc/kvf_native.c", "csrc/kvf_xxh3.c"],
        depends=["csrc/kvf_xxh3.h"],
        extra_compile_args=["-O3", "-std=c11", "-D_GNU_SOURCE", "-fvisibility=hidden"],
    )],
    cmdclass={"build_ext": OptionalBuildExt},
)
