"""pip's entry to the CMake build: builds the targets tidal_python and tidal_cli in
TIDAL_BUILD_DIR (default build/, configured here if it is not yet), then installs the package
python/tidal with the module and the CLI (as tidal/bin/tidal, run by the `tidal` command).

    pip install --no-build-isolation .     # the build needs torch and pybind11 as installed
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build = os.path.abspath(os.environ.get("TIDAL_BUILD_DIR", os.path.join(ROOT, "build")))
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            subprocess.check_call([
                "cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython3_EXECUTABLE={sys.executable}", "-DTIDAL_BUILD_PYTHON=ON",
                "-DTIDAL_BUILD_TESTS=OFF", "-DTIDAL_BUILD_BENCH=OFF"])
        jobs = os.environ.get("TIDAL_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", build, "-j", jobs, "--target", "tidal_python",
                               "tidal_cli"])
        module = os.path.join(build, "python", "tidal", os.path.basename(
            self.get_ext_filename(ext.name)))
        if not os.path.exists(module):
            sys.exit(f"setup.py: {module} was not built: is TIDAL_BUILD_PYTHON off in {build}?")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(module, target)
        # `tidal` runs plan/simulate/bench-io and hands train/profile to `tidal-torch` beside it.
        bin_dir = os.path.join(os.path.dirname(target), "bin")
        os.makedirs(bin_dir, exist_ok=True)
        for program in ("tidal", "tidal-torch"):
            shutil.copy2(os.path.join(build, program), os.path.join(bin_dir, program))


setup(
    name="tidal",
    version="0.1.0",
    description="Train models larger than GPU memory by offloading tensors to NVMe SSDs",
    packages=["tidal"],
    package_dir={"": "python"},
    ext_modules=[Extension("tidal._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={"console_scripts": ["tidal = tidal.__main__:main"]},
    options={"build": {"build_base": os.path.join("build", "setuptools")}},
    python_requires=">=3.8",
    zip_safe=False,
)
