"""Builds the C parts with make, so `pip install .` ships them inside the package.

- nvshare_py/_lib/libnvshare.so: the interceptor (interceptor/);
- nvshare_py/_lib/libnvshare_core.so: its client core alone, which nvshare_py.client drives;
- nvshare_py/_lib/simcuda/libcuda.so.1 and libnvidia-ml.so.1: the simulated driver
  (tests/simcuda/), which the demo and the tests use on machines without a GPU.
"""

import os
import shutil
import subprocess
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

# extension name -> (directory with a Makefile, the file it builds and we install)
LIBRARIES = {
    "nvshare_py._lib.libnvshare": ("interceptor", "libnvshare.so"),
    "nvshare_py._lib.libnvshare_core": ("interceptor", "libnvshare_core.so"),
    "nvshare_py._lib.simcuda.libcuda": ("tests/simcuda", "libcuda.so.1"),
    "nvshare_py._lib.simcuda.libnvidia_ml": ("tests/simcuda", "libnvidia-ml.so.1"),
}
# build_ext asks for file names by the last component of the extension name
FILE_NAMES = {name.rsplit(".", 1)[1]: product for name, (_, product) in LIBRARIES.items()}


class MakeBuild(build_ext):
    """Each Makefile builds all its products into $(BUILD) with its default target."""

    def get_ext_filename(self, fullname):
        return FILE_NAMES[fullname.rsplit(".", 1)[-1]]

    def run(self):
        with tempfile.TemporaryDirectory(prefix="nvshare-build-") as scratch:
            self._built = {}
            self._scratch = scratch
            super().run()

    def build_extension(self, ext):
        source_dir, product = LIBRARIES[ext.name]
        out = self._built.get(source_dir)
        if out is None:
            out = os.path.join(self._scratch, source_dir.replace("/", "_"))
            subprocess.run(["make", "-s", "-C", os.path.join(HERE, source_dir), f"BUILD={out}"], check=True)
            self._built[source_dir] = out
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(out, product), target)


setup(
    ext_modules=[Extension(name, sources=[]) for name in LIBRARIES],
    cmdclass={"build_ext": MakeBuild},
)
