"""`python -m fairfl.compose ARGS`: the `fairfl` console script without the installed script."""

import sys

from fairfl.compose.cli import main

sys.exit(main())
