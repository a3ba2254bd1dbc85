"""``python -m train`` = ``train-heads`` (so ``accelerate launch -m train ...`` works)."""

import sys

from train.cli import main

sys.exit(main())
