"""Reproduce the seed papers' testable claims on one model (see ``--help`` and ``--list``).

python experiments/reproduce.py --threads 1 --out runs/repro

The claims live in `experiments.claims` (one module per paper); docs/reproduction.md holds the
results and how to read them.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` is not an installed package

from experiments.claims import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
