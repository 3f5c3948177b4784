"""``--json`` output: one JSON document on stdout, for scripts (``asyncckpt ls DIR --json | jq``)."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
