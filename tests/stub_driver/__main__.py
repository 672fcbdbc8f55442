"""python -m tests.stub_driver [DIR]: build the stub driver into DIR (default build/stub_driver) and
print the directory to put on LD_LIBRARY_PATH."""

import sys
from pathlib import Path

from . import build

print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "build/stub_driver")))
