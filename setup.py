"""Only the optional C extensions live here; everything else is in pyproject.toml."""
from setuptools import Extension, setup

# optional=True: without a C compiler (or, for _float16, off x86) the install still succeeds, and
# actstore computes the same results with numpy: the saev loader's scatter (~2.5x slower) and the
# float16 cast of the zarr and lmprobe writers (~25x slower).
setup(ext_modules=[Extension("actstore._scatter", ["src/actstore/_scatter.c"], optional=True),
                   Extension("actstore._float16", ["src/actstore/_float16.c"], optional=True)])
