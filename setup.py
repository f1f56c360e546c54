"""Only the optional C extensions live here; everything else is in pyproject.toml."""
from setuptools import Extension, setup

# optional=True: without a C compiler (or, for _casts, off x86) the install still succeeds, and
# actstore computes the same results with numpy: the saev loader's scatter (~2.5x slower) and the
# float16 / bfloat16 casts of the zarr and lmprobe writers (~15x / ~3x slower), and zarr's chunk files
# written one system call at a time with the GIL taken back after each.
setup(ext_modules=[Extension("actstore._scatter", ["src/actstore/_scatter.c"], optional=True),
                   Extension("actstore._casts", ["src/actstore/_casts.c"], optional=True)])
