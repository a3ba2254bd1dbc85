"""``python -m rolecall.calibrate`` = ``calibrate-delta`` (so ``accelerate launch -m rolecall.calibrate ...`` works)."""

import sys

from rolecall.calibrate.cli import main

sys.exit(main())
