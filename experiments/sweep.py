"""Hyper-parameter sweeps with or without a W&B server (``framework.sweep``; docs/howto/sweeps.md).

python experiments/sweep.py experiments/sweeps/static.yaml [--count N] [--out DIR] [--dry-run]
wandb sweep experiments/sweeps/static.yaml && wandb agent ENTITY/PROJECT/SWEEP_ID
"""

import sys

from framework.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
