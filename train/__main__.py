"""``python -m rolecall.train`` = ``train-heads`` (so ``accelerate launch -m rolecall.train ...`` works)."""

import sys

from rolecall.train.cli import main

sys.exit(main())
