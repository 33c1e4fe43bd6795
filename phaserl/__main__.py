"""`python -m phaserl ...` is the `phaserl` command (also under torchrun)."""
import sys

from .cli import main

sys.exit(main())
