"""python -m pyspec.convert: the same as the pyspec-convert console script."""

import sys

from . import main

sys.exit(main())
