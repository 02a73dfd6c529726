"""`python -m opdispatch`: the same as the `opdispatch` command."""

import sys

from .cli import main

sys.exit(main())
