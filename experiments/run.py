"""Run one self-speculative decoding experiment (see ``--help`` and ``--list``).

python experiments/run.py --selector static --length confidence --limit 2
"""

import sys

from framework.runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
