"""Write Baton's configuration schema (`baton config schema`) into the chart's values.schema.json.

The chart's `baton` values are Baton's configuration file, so `properties.baton` of
values.schema.json is `cluster.config.json_schema()` (less its `$schema`, which belongs to the
document's root). The rest of values.schema.json is the chart's own and is kept as it is.

    python helm/baton/scripts/sync_values_schema.py          # rewrite it (make helm-schema)
    python helm/baton/scripts/sync_values_schema.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHART = Path(__file__).resolve().parents[1]
SCHEMA_FILE = CHART / "values.schema.json"
ROOT = CHART.parents[1]


def baton_section() -> dict:
    sys.path.insert(0, str(ROOT))
    from cluster.config import json_schema

    schema = json_schema()
    schema.pop("$schema", None)
    return schema


def synced() -> str:
    schema = json.loads(SCHEMA_FILE.read_text())
    schema["properties"]["baton"] = baton_section()
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = synced()
    if "--check" in argv:
        if SCHEMA_FILE.read_text() != text:
            print(f"{SCHEMA_FILE} is stale: run `make helm-schema`", file=sys.stderr)
            return 1
        return 0
    SCHEMA_FILE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
