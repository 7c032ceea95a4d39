"""``python -m client.cli``: the same as the ``dpmtv-site`` command."""

from __future__ import annotations

import sys

from client.cli.main import main

sys.exit(main())
