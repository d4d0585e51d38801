"""``python -m r3rdma``: the ``r3rdma`` command line (:mod:`r3rdma.cli`); exits with its status."""

import sys

from r3rdma.cli import main

sys.exit(main())
