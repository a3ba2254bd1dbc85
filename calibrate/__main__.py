"""``python -m calibrate`` = ``calibrate-delta`` (so ``accelerate launch -m calibrate ...`` works)."""

import sys

from calibrate.cli import main

sys.exit(main())
