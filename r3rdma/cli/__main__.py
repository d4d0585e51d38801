"""``python -m r3rdma.cli``: the ``r3rdma`` command line, for environments without the console script."""

import sys

from r3rdma.cli import main

sys.exit(main())
