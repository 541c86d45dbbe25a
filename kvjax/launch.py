"""`python -m kvjax.launch`: the main job's command (kvjax.job.command says what it does)."""

import sys

from kvjax.job.command import main

if __name__ == "__main__":
    sys.exit(main(restart=True))
