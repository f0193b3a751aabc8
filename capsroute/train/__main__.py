"""`python -m capsroute.train` and `torchrun -m capsroute.train`: capsroute train's command line."""

import sys

from . import main

sys.exit(main())
