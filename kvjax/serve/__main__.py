import sys

from kvjax.serve.cli import main

sys.exit(main())
