import sys

from kvjax.serve.cli import main

sys.exit(main(restart=True))  # restarts under the allocator settings once its checks pass (kvjax.allocator says why)
