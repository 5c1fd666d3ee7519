"""`python -m jaxpar ...`: the same command line as `jaxpar ...`."""

import sys

from jaxpar.cli import main

sys.exit(main())
