"""The sweep program as a script (same as ``python -m fp8track.examples.train``).

    python examples/sweep_train.py --recipe=current --bf16_layers=auto:2 --steps=120
    wandb sweep integrations/wandb/fp8_sweep.yaml   # its program runs fp8track.examples.train
"""

import sys

from fp8track.examples.train import main

if __name__ == "__main__":
    sys.exit(main())
