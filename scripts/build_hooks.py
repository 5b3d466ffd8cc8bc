"""setuptools commands that also install ``kvcompress-autoload.pth`` into site-packages (see
kvcompress/_autoload.py): for a regular install through ``build_py``, for an editable install
(``pip install -e``) by adding it to the editable wheel."""

import os
import shutil

from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "kvcompress-autoload.pth"


class BuildPy(build_py):
    def run(self):
        super().run()
        shutil.copy(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class _WithPth:
    """Wraps setuptools' editable strategy: the same wheel, plus the .pth file."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        with open(PTH, "rb") as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


class EditableWheel(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _WithPth(super()._select_strategy(*args, **kwargs))
