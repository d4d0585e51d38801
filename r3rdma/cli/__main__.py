import sys

from r3rdma.cli import main

sys.exit(main())
