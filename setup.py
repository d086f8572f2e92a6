"""pip's entry to the CMake build: builds the targets tidal_python and tidal_cli in
TIDAL_BUILD_DIR (default build/, configured here if it is not yet), then installs the package
python/tidal with the module and the CLI (as tidal/bin/tidal, run by the `tidal` command).

    pip install --no-build-isolation .     # the build needs torch and pybind11 as installed

Without build isolation the environment's setuptools builds the wheel: 70.1 or later (or the
`wheel` package) is needed, and an older one is told so here rather than by setuptools'
"invalid command 'bdist_wheel'".
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def can_build_wheels() -> bool:
    """Whether setuptools has a bdist_wheel command: its own (70.1+), or the `wheel` package's."""
    for module in ("setuptools.command.bdist_wheel", "wheel.bdist_wheel"):
        try:
            __import__(module)
            return True
        except ImportError:
            pass
    return False


# pip runs dist_info (the wheel's metadata, made by bdist_wheel) and then bdist_wheel.
if {"bdist_wheel", "dist_info", "editable_wheel"} & set(sys.argv[1:]) and not can_build_wheels():
    import setuptools

    sys.exit(
        f"setup.py: this environment's setuptools {setuptools.__version__} cannot build a wheel "
        f"(pip install --no-build-isolation builds with the environment's own packages): run "
        f"`{sys.executable} -m pip install 'setuptools>=70.1' pybind11` and install again "
        f"(scripts/setup.sh does this for the project's .venv)")


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
