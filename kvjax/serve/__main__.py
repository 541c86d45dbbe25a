import sys

from kvjax import allocator
from kvjax.serve.cli import main

allocator.reexec()  # huge pages for the weights: a restart, before any work (kvjax.allocator says why)
sys.exit(main())
